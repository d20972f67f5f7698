"""The dashboard in headless Chromium over the store of a real run: a real ``celery beat``,
two ``celery worker`` processes (solo pools) and a ``reliable-beat relay`` on PostgreSQL and
Redis (tests/apps/dash_app.py: wf_app's workflows plus ``dash-pay``, every second, misfire
policy ``skip``).

The run (once per module, about 30 s): the beat fires ``dash-pay`` on time; the beat is frozen
(SIGSTOP) across four slots and thawed, so it records them **missed** (``misfire:skip``);
worker A freezes itself inside a ``dash.pay`` body, its 2 s lease runs out, worker B takes the
message over (Redis restores it) and commits under the next fence token, then A is thawed and
its commit is **fenced out**; a saga workflow's third step fails permanently (a dead letter)
and its compensations undo the first two. Then every page renders in the browser with that
data, the strip shows the missed slots and the fenced-out attempt at their slots, and a click
on the fenced-out cell opens its run. One screenshot per page goes to ``$RB_SCREENSHOTS``
(the images docs/dashboard.md shows).

Skipped when Chromium or Selenium is missing, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import pytest
import redis
import sqlalchemy as sa
import uvicorn

from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import attempts
from reliable_beat.db.tables import runs as runs_t
from reliable_beat.runs import list_dead_letters
from reliable_beat.web import AuthConfig, create_app
from reliable_beat.workflows import engine
from tests.integration.test_dashboard_browser import _free_port, browser, shots  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "apps"))
sys.path.insert(0, str(ROOT / "tests" / "acceptance"))
from test_workflow_crashes import Rig  # noqa: E402
from wf_app import meta  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(300)]

ENTRY = "dash-pay"


@dataclass
class RealRun:
    base: str  # the dashboard's URL
    store: Store
    missed: list[str]  # keys of the slots the frozen beat missed
    frozen_beat: tuple[datetime, datetime]  # the store's clock at SIGSTOP / SIGCONT
    fenced_key: str  # the run whose first attempt was fenced out
    workflow: str
    dead_letter_id: int
    workers: tuple[int, int]  # the pids of worker A (fenced out) and worker B


def _wait(what: str, cond: Any, rig: Rig, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{rig.logs()}")


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _slot_runs(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            sa.select(runs_t.c.idempotency_key, runs_t.c.fire_at, runs_t.c.state,
                      runs_t.c.reason, runs_t.c.id)
            .where(runs_t.c.entry_name == ENTRY).order_by(runs_t.c.fire_at)).mappings()]


def _attempts(store: Store, key: str) -> list[tuple[int, str | None]]:
    with store.engine.connect() as conn:
        return [(int(t), o) for t, o in conn.execute(
            sa.select(attempts.c.fence_token, attempts.c.outcome)
            .join(runs_t, runs_t.c.id == attempts.c.run_id)
            .where(runs_t.c.idempotency_key == key).order_by(attempts.c.fence_token))]


@pytest.fixture(scope="module")
def real_run(postgres_server: str, redis_server: tuple[str, int],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRun]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    db_url = sa.engine.make_url(postgres_server).set(database=name).render_as_string(False)
    base, databases = redis_server
    redis_url = urlunsplit(urlsplit(base)._replace(path=f"/{max(databases - 1, 1)}"))
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    store = Store.from_url(db_url, role="cli")
    upgrade(store)
    meta.create_all(store.engine)
    tmp = tmp_path_factory.mktemp("dash-real-run")
    rig = Rig(db_url, redis_url, store, tmp)
    flag = tmp / "freeze-next-pay"
    common = ["--pool", "solo", "-c", "1", "-Q", rig.queue, "--without-gossip",
              "--without-mingle", "--without-heartbeat", "-l", "INFO"]
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    try:
        worker_a = rig.start("worker-a", [sys.executable, "-m", "celery", "-A", "dash_app",
                                          "worker", "-n", "worker-a@%h", *common],
                             RB_DASH_FREEZE_FLAG=str(flag))
        rig.start("relay", [sys.executable, "-m", "reliable_beat.cli", "-A", "dash_app",
                            "relay", "--claim-lease-seconds", "3"])
        beat = rig.start("beat", [sys.executable, "-m", "celery", "-A", "dash_app", "beat",
                                  "-l", "INFO", "--pidfile=", "-s", str(tmp / "beat-schedule")])
        workflow = f"refund-{rig.tag}"
        engine.start(store, "wfa.saga", workflow, [workflow], queue=rig.queue)
        _wait("three slots run on time",
              lambda: sum(r["state"] == "succeeded" for r in _slot_runs(store)) >= 3, rig, 90)

        # the beat is down across slots: a skip policy records them missed
        os.kill(beat.pid, signal.SIGSTOP)
        with store.engine.connect() as conn:
            frozen_at = store.now(conn)
        time.sleep(4.5)  # the outage itself: four slots pass with no beat
        os.kill(beat.pid, signal.SIGCONT)
        with store.engine.connect() as conn:
            thawed_at = store.now(conn)
        missed = _wait("the missed slots recorded", lambda: [
            r["idempotency_key"] for r in _slot_runs(store)
            if r["state"] == "skipped" and r["reason"] == "misfire:skip"], rig)

        # worker A freezes inside a run's body past its lease; B takes it over
        flag.touch()
        _wait("worker A frozen inside dash.pay",
              lambda: "dash: FROZEN" in (tmp / "worker-a.log").read_text()
              and _stopped(worker_a.pid), rig)
        log = (tmp / "worker-a.log").read_text()
        fenced_key = log.split("dash: FROZEN ", 1)[1].split()[0]
        worker_b = rig.start("worker-b", [sys.executable, "-m", "celery", "-A", "dash_app",
                                          "worker", "-n", "worker-b@%h", *common])
        _wait("worker B committed the run A holds",
              lambda: (2, "succeeded") in _attempts(store, fenced_key), rig, 90)
        os.kill(worker_a.pid, signal.SIGCONT)
        _wait("A's commit fenced out",
              lambda: (1, "fenced_out") in _attempts(store, fenced_key), rig)
        _wait("the saga compensated",
              lambda: engine.get_workflow(store, workflow)["state"] == "failed", rig, 120)
        dead = [d for d in list_dead_letters(store) if d["kind"] == "run"]
        assert dead, rig.logs()

        web = create_app(store, auth=AuthConfig(), refresh_seconds=2.0, slots=60)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(web, host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        _wait("uvicorn", lambda: server is not None and server.started, rig, 10)
        yield RealRun(base=f"http://127.0.0.1:{port}", store=store, missed=missed,
                      frozen_beat=(frozen_at, thawed_at), fenced_key=fenced_key,
                      workflow=workflow, dead_letter_id=int(dead[0]["id"]),
                      workers=(worker_a.pid, worker_b.pid))
    finally:
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(10)
        rig.kill_all()
        store.dispose()
        client.flushdb()
        client.close()
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :n"), {"n": name})
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


def test_the_missed_slots_are_those_of_the_outage(real_run: RealRun) -> None:
    """What the strip will show is what happened: every missed slot lies in the outage."""
    start, end = real_run.frozen_beat
    slots = {r["idempotency_key"]: r["fire_at"] for r in _slot_runs(real_run.store)}
    assert real_run.missed
    assert all(start <= slots[k] <= end for k in real_run.missed), (real_run.missed, start, end)
    assert _attempts(real_run.store, real_run.fenced_key) == [(1, "fenced_out"),
                                                              (2, "succeeded")]


def test_every_page_renders_the_real_run_in_chromium(
        browser: Any, real_run: RealRun, shots: Path) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    r = real_run
    pages = {
        "overview": ("/", "Beats and relays"),
        "entries": (f"/entries?q={ENTRY}", ENTRY),
        "entry": (f"/entries/{ENTRY}", "Next fires"),
        "runs": (f"/runs?entry={ENTRY}", r.fenced_key),
        "run": (f"/runs/{quote(r.fenced_key, safe='')}", "fenced_out"),
        "dead_letters": ("/dead-letters", "permanent"),
        # the saga's refused step: its history recorded the failure, so no requeue (a
        # re-run's effect would land after the compensations)
        "dead_letter": (f"/dead-letters/{r.dead_letter_id}", "outside its history"),
        "workflows": ("/workflows", r.workflow),
        "workflow": (f"/workflows/{r.workflow}", "compensation wfa.undo"),
        "outbox": ("/outbox?state=sent", "Outbox"),
        "audit": ("/audit", "Operator actions"),
    }
    for shot, (path, must_see) in pages.items():
        browser.get(r.base + path)
        body = browser.find_element(By.TAG_NAME, "body").text
        assert must_see in body, (shot, body[-1500:])
        if shot == "dead_letter":  # the picture is of the refusal, with why
            assert "Yes, requeue it" not in body
            browser.execute_script(
                "document.getElementById('requeue-refused').scrollIntoView()")
        browser.save_screenshot(str(shots / f"dashboard-{shot}.png"))
    browser.get(r.base + "/")
    beats = browser.find_element(By.ID, "heartbeats").text
    assert "beat" in beats and "relay" in beats, beats
    workers = browser.find_element(By.ID, "workers").text
    assert all(f":{pid} " in workers for pid in r.workers), workers  # host:pid
    assert "failed 1" in browser.find_element(By.ID, "workflow-counts").text
    browser.get(r.base + f"/workflows/{r.workflow}")
    kinds = [(g.get_attribute("data-kind"), g.get_attribute("data-state"))
             for g in browser.find_elements(By.CSS_SELECTOR, "svg.history g[data-kind]")]
    assert kinds.count(("compensation", "completed")) == 3, kinds

    # the strip: the missed slots and the fenced-out attempt at their slots
    browser.get(r.base + f"/entries?q={ENTRY}")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-entry="{ENTRY}"]')
    cells = {unquote(str(a.get_dom_attribute("href")).rsplit("/runs/", 1)[1]):
             a.get_attribute("data-outcome")
             for a in row.find_elements(By.CSS_SELECTOR, "a[data-outcome]")}
    assert cells[r.fenced_key] == "fenced_out", cells
    assert all(cells[k] == "missed" for k in r.missed if k in cells), cells
    assert any(k in cells for k in r.missed), cells
    assert {o for k, o in cells.items() if k not in r.missed and k != r.fenced_key} <= {
        "on_time", "late", "running", "retried"}, cells
    fenced = row.find_element(By.CSS_SELECTOR,
                              f'a[href$="/runs/{quote(r.fenced_key, safe="")}"]')
    browser.execute_script(
        "arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", fenced)
    WebDriverWait(browser, 5).until(lambda d: "/runs/" in d.current_url)
    text = browser.find_element(By.ID, "attempts").text
    assert "fenced_out" in text and all(f":{pid}" in text for pid in r.workers), text
