"""The admin pages rendered in a real headless browser (Debian's Chromium + chromedriver,
driven by Selenium), one screenshot per page, so what a person sees is checked.

Screenshots go to ``$RB_SCREENSHOTS`` (CI keeps that folder as the test artefacts).
Skipped when Chromium or Selenium is missing, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.contrib.staticfiles.handlers import StaticFilesHandler
from django.core.management import call_command
from django.test import Client
from django.test.testcases import LiveServerThread

from reliable_beat import entries as rb_entries
from reliable_beat import runs as rb_runs
from reliable_beat import runtime
from reliable_beat import schedules as sch
from reliable_beat.contrib.django import conf
from reliable_beat.entries import EntryDefinition

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must install: apt-get install chromium chromium-driver; "
                    "pip install selenium)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    call_command("migrate", verbosity=0)
    server = LiveServerThread("127.0.0.1", StaticFilesHandler, port=0)
    server.daemon = True
    server.start()
    server.is_ready.wait()
    if server.error:
        raise server.error
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def shots() -> Path:
    folder = Path(os.environ.get("RB_SCREENSHOTS") or "test-artefacts/screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_admin_pages_render_in_chromium(browser: Any, live: str, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    store = conf.store()
    tag = os.urandom(3).hex()
    name = f"report-{tag}"
    rb_entries.save_runtime_entry(store, EntryDefinition(
        name=name, task="dj.pay", schedule=sch.CronSchedule("30 6 * * 1-5", "Europe/Paris"),
        args=["m-report"]), create=True,
        schedule_group="djtask_app")
    runtime.backfill(store, name, datetime.now(timezone.utc) - timedelta(days=3),
                     datetime.now(timezone.utc), limit=10)
    claim = rb_runs.claim_run(store, f"shot-dead:{tag}", owner="shots",
                              lease=timedelta(seconds=30), task="dj.pay", args=["x"])
    rb_runs.record_failure(store, claim, "PermanentError: card declined",
                           dead_reason="permanent")
    user = User.objects.filter(username=f"shots-{tag}").first() or \
        User.objects.create_superuser(f"shots-{tag}", "s@example.com", "pw")
    c = Client()
    c.force_login(user)
    browser.get(live + "/admin/login/")
    browser.add_cookie({"name": "sessionid", "value": c.cookies["sessionid"].value,
                        "path": "/"})
    entry_id = rb_entries.get_entry(store, name)["id"]
    run_id = rb_runs.get_run(store, f"shot-dead:{tag}")["id"]
    pages = {
        # searched: the suite's other tests add entries (past one page of 50 in name order)
        "entries": (f"/admin/reliable_beat/entry/?q={name}", name),
        "entry": (f"/admin/reliable_beat/entry/{entry_id}/change/", "The five questions"),
        "runs": ("/admin/reliable_beat/run/", f"shot-dead:{tag}"),
        "run": (f"/admin/reliable_beat/run/{run_id}/change/", "card declined"),
        "dead_letters": ("/admin/reliable_beat/deadletter/", f"shot-dead:{tag}"),
        "outbox": ("/admin/reliable_beat/outboxmessage/", "Backlog per destination"),
    }
    for shot, (path, must_see) in pages.items():
        browser.get(live + path)
        body = browser.find_element(By.TAG_NAME, "body")
        assert must_see in body.text, f"{shot}: {must_see!r} not visible on {path}"
        # the admin's stylesheet loaded: the header is laid out, not raw HTML
        header = browser.find_element(By.ID, "header")
        assert header.is_displayed() and header.size["height"] > 20
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1400, max(1000, min(int(height) + 40, 8000)))  # whole page
        out = shots / f"{shot}.png"
        assert browser.save_screenshot(str(out)) and out.stat().st_size > 10_000, shot
    # the confirmation page of an action, reached as a person would: tick, choose, Go
    browser.get(live + "/admin/reliable_beat/entry/?q=" + name)
    browser.find_element(By.CSS_SELECTOR, "input.action-select").click()
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.NAME, "action")).select_by_value("pause_entries")
    browser.find_element(By.CSS_SELECTOR, "button[name=index], input[name=index]").click()
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    question = WebDriverWait(browser, 30).until(  # the POST's answer has loaded
        ec.presence_of_element_located((By.ID, "rb-question")))
    assert "Pause these entries?" in question.text
    browser.save_screenshot(str(shots / "confirm_pause.png"))
    assert rb_entries.get_entry(store, name)["paused"] is False
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    try:
        from selenium.common.exceptions import StaleElementReferenceException

        # back on the list, with the outcome shown (the body read while the page is being
        # replaced goes stale: look again)
        WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda d: f"paused: {name}" in d.find_element(By.TAG_NAME, "body").text.lower())
    except Exception:
        pytest.fail(f"no outcome shown at {browser.current_url}:\n"
                    f"{browser.find_element(By.TAG_NAME, 'body').text[:3000]}")
    assert rb_entries.get_entry(store, name)["paused"] is True
    browser.save_screenshot(str(shots / "after_pause.png"))


def test_bad_timestamp_and_secret_pages_in_chromium(browser: Any, live: str,
                                                    shots: Path) -> None:
    """What a person sees of a run with ``lease_expires_at = 'infinity'`` (written by hand)
    and of an entry whose kwargs hold an API key: the pages load (no server error), the
    timestamp reads ``malformed: infinity``, the key reads ``***`` and never in clear."""
    import sqlalchemy as sa
    from selenium.webdriver.common.by import By

    from reliable_beat.db.tables import runs

    store = conf.store()
    tag = os.urandom(3).hex()
    secret = f"sk_live_SHOT{tag}"
    name = f"shot-secret-{tag}"
    rb_entries.save_runtime_entry(store, EntryDefinition(
        name=name, task="dj.pay", schedule=sch.IntervalSchedule(
            timedelta(minutes=5), datetime(2026, 1, 1, tzinfo=timezone.utc)),
        kwargs={"customer": "adm", "api_key": secret}), create=True,
        schedule_group="djtask_app")
    rb_runs.claim_run(store, f"shot-inf:{tag}", owner="shots", lease=timedelta(seconds=30),
                      task="dj.pay", kwargs={"api_key": secret})
    run_id = rb_runs.get_run(store, f"shot-inf:{tag}")["id"]
    with store.begin() as conn:
        conn.execute(sa.text(f"UPDATE {runs.name} SET state = 'garbage', "
                             "lease_expires_at = 'infinity' WHERE id = :i"), {"i": run_id})
    user = User.objects.filter(username=f"shots2-{tag}").first() or \
        User.objects.create_superuser(f"shots2-{tag}", "s@example.com", "pw")
    c = Client()
    c.force_login(user)
    browser.get(live + "/admin/login/")
    browser.add_cookie({"name": "sessionid", "value": c.cookies["sessionid"].value,
                        "path": "/"})
    entry_id = rb_entries.get_entry(store, name)["id"]
    try:
        pages = {
            "runs_bad_timestamp": ("/admin/reliable_beat/run/?state__exact=garbage",
                                   f"shot-inf:{tag}"),
            "run_bad_timestamp": (f"/admin/reliable_beat/run/{run_id}/change/",
                                  "malformed: infinity"),
            "entry_secret_masked": (f"/admin/reliable_beat/entry/{entry_id}/change/",
                                    '"api_key": "***"'),
        }
        for shot, (path, must_see) in pages.items():
            browser.get(live + path)
            body = browser.find_element(By.TAG_NAME, "body").text
            assert must_see in body, f"{shot}: {must_see!r} not visible on {path}:\n{body[:2000]}"
            assert "Server Error" not in body and secret not in body, shot
            header = browser.find_element(By.ID, "header")
            assert header.is_displayed() and header.size["height"] > 20
            out = shots / f"{shot}.png"
            assert browser.save_screenshot(str(out)) and out.stat().st_size > 10_000, shot
    finally:
        with store.begin() as conn:
            conn.execute(sa.text(f"UPDATE {runs.name} SET state = 'dead', "
                                 "lease_expires_at = NULL WHERE id = :i"), {"i": run_id})
