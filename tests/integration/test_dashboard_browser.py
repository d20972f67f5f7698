"""The dashboard in a real headless browser (Debian's Chromium + chromedriver via Selenium),
served by uvicorn on a free loopback port: every page renders, the timeline strip shows the
missed slot, the gap and the fenced-out attempt where they happened, a click on a cell opens
its run, an operator's pause works through the page's own form (with its CSRF field), and the
live refresh swaps the main part in place, over a seeded store (tests/apps/dashboard_seed.py:
every outcome, and XSS payloads). One screenshot per page goes to ``$RB_SCREENSHOTS``
(``dashboard-seed-*.png``; CI keeps that folder). The images docs/dashboard.md shows come
from a real run: tests/acceptance/test_dashboard_real_run.py.

Skipped when Chromium or Selenium is missing, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import uvicorn

from reliable_beat.db.dialects import Store
from reliable_beat.web import AuthConfig, create_app
from tests.apps.dashboard_seed import Seeded, seed

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must install: apt-get install chromium chromium-driver; "
                    "pip install selenium)")
    pytest.skip(reason)


@pytest.fixture
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed")
    if not CHROMIUM or not CHROMEDRIVER:
        _missing("chromium / chromedriver not found")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(sqlite_store: Store) -> Iterator[tuple[str, Seeded]]:
    seeded = seed(sqlite_store)
    web = create_app(sqlite_store, auth=AuthConfig(), refresh_seconds=1.0)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(web, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", seeded
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def shots() -> Path:
    folder = Path(os.environ.get("RB_SCREENSHOTS") or "test-artefacts/screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_dashboard_pages_in_chromium(browser: Any, served: tuple[str, Seeded],
                                     shots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, seeded = served
    pages = {
        "overview": ("/", "dead letters wait for a person"),
        "entries": (f"/entries?q={seeded.entry[:4]}", seeded.entry),
        "entry": (f"/entries/{quote(seeded.entry, safe='')}", "Next fires"),
        "runs": ("/runs", seeded.dead_key),
        "run": (f"/runs/{quote(seeded.fenced_key, safe='')}", "fenced_out"),
        "dead_letters": ("/dead-letters", seeded.dead_key),
        "dead_letter": (f"/dead-letters/{seeded.dead_letter_id}", "Yes, requeue it"),
        "workflows": ("/workflows", "Workflows"),
        "outbox": ("/outbox", "Outbox"),
    }
    for shot, (path, must_see) in pages.items():
        browser.get(base + path)
        body = browser.find_element(By.TAG_NAME, "body").text
        assert must_see in body, (shot, body[:400])
        assert "<script>" not in body or "&lt;" not in body
        browser.save_screenshot(str(shots / f"dashboard-seed-{shot}.png"))
    # the strip: each outcome where it happened (a browser sees the SVG the server drew)
    browser.get(base + f"/entries?q={seeded.entry}")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-entry="{seeded.entry}"]')
    cells = row.find_elements(By.CSS_SELECTOR, "[data-outcome]")
    assert [c.get_attribute("data-outcome") for c in cells] == seeded.outcomes
    assert all(c.is_displayed() for c in cells)
    # no script ran from a payload: the page's title is intact and no alert is open
    assert browser.title.startswith("Entries")
    # a click on the fenced-out cell opens its run
    fenced = cells[seeded.outcomes.index("fenced_out")]
    browser.execute_script(
        "arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", fenced)
    WebDriverWait(browser, 5).until(lambda d: "/runs/" in d.current_url)
    assert "fenced_out" in browser.find_element(By.ID, "attempts").text
    # the live refresh replaces the main part in place (no reload: the marker stays)
    browser.get(base + "/")
    browser.execute_script("window.rbMarker = 1")
    WebDriverWait(browser, 5).until(lambda d: d.find_element(By.ID, "live")
                                    .get_attribute("data-refreshed"))
    assert browser.execute_script("return window.rbMarker") == 1
    # an operator pauses the entry through its page's form
    browser.get(base + f"/entries/{quote(seeded.entry, safe='')}")
    browser.find_element(By.CSS_SELECTOR, 'button[data-action="pause"]').click()
    WebDriverWait(browser, 5).until(lambda d: d.find_elements(By.ID, "flash"))
    assert "paused" in browser.find_element(By.ID, "flash").text
    browser.save_screenshot(str(shots / "dashboard-seed-entry-paused.png"))
