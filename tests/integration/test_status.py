"""`reliable-beat status`, the missed-slot alarm, and the Prometheus metrics (HTTP + textfile)."""

from __future__ import annotations

import json
import urllib.request
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select, update
from sqlalchemy.engine import make_url

from reliable_beat.beat import Beat
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status, jsonable
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, entries, runs
from reliable_beat.metrics import serve

pytest.importorskip("prometheus_client")


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.output


def db_now(store: Store) -> datetime:
    with store.engine.connect() as conn:
        return store.now(conn)


def make_due(store: Store, name: str, ago: timedelta) -> datetime:
    """Put ``name``'s next slot ``ago`` in the past (whole seconds); return that slot."""
    slot = (db_now(store) - ago).replace(microsecond=0)
    with store.begin() as conn:
        conn.execute(update(entries).where(entries.c.name == name).values(next_fire_at=slot))
    return slot


def fire(store: Store) -> None:
    """One beat tick, its triggers marked sent (as if published)."""
    from reliable_beat.relay import mark_sent

    result = Beat(store, owner="test").tick()
    with store.begin() as conn:
        mark_sent(conn, [t.id for t in result.triggers], store.now(conn))


@pytest.fixture
def populated(store: Store) -> Store:
    """Three entries: 'ok' fired on time, 'stalled' overdue (no beat), 'held' paused."""
    for name in ("ok", "stalled", "held"):
        ok(cli(store, "entries", "add", name, "--task", "t", "--cron", "0 0 1 1 *"))
    ok(cli(store, "entries", "pause", "held"))
    make_due(store, "ok", timedelta(seconds=2))
    fire(store)
    make_due(store, "stalled", timedelta(hours=1))
    return store


def test_status_json_fields(populated: Store) -> None:
    store = populated
    info = json.loads(ok(cli(store, "status", "--json")))
    assert set(info) >= {"store", "now", "entries", "missed", "outbox", "dead_letters",
                         "problems", "ok"}
    by_name = {e["name"]: e for e in info["entries"]}
    assert set(by_name) == {"ok", "stalled", "held"}
    e = by_name["ok"]
    assert set(e) >= {"next_fire_at", "last_fire_at", "last_state", "lag_seconds", "failing",
                      "dead", "status", "missed", "overdue_seconds"}
    assert e["last_state"] == "dispatched" and e["status"] == "active"
    assert e["lag_seconds"] is not None and 1.5 <= e["lag_seconds"] < 30
    assert e["last_fire_at"].endswith("Z") and e["missed"] is False
    assert by_name["held"]["status"] == "paused" and by_name["held"]["missed"] is False
    assert by_name["stalled"]["missed"] is True
    assert by_name["stalled"]["overdue_seconds"] >= 3599
    assert info["missed"] == ["stalled"] and info["ok"] is False
    assert any("MISSED SLOTS" in p and "stalled" in p for p in info["problems"])
    # The outbox part: the fired trigger was marked sent, so no backlog.
    assert all(o["pending"] == 0 for o in info["outbox"])
    if store.dialect == "postgresql":  # the URL is shown with its password hidden
        secret = make_url(store.url).set(password="s3cret-pw").render_as_string(False)
        shown = collect_status(Store(engine=store.engine, url=secret))
        assert shown["store"].startswith("postgresql+psycopg://postgres:***@")
        assert "s3cret-pw" not in json.dumps(jsonable(shown))


def test_status_text_and_check_exit_codes(populated: Store) -> None:
    store = populated
    text = ok(cli(store, "status"))
    assert "MISSED SLOTS" in text and "stalled (MISSED)" in text
    assert "no beat is claiming entries" in text
    r = cli(store, "status", "--check")
    assert r.exit_code == 1
    # A beat catches up: the alarm clears.
    fire(store)
    assert cli(store, "status", "--check").exit_code == 0
    # A dead letter needs a person.
    with store.begin() as conn:
        conn.execute(dead_letters.insert().values(
            kind="run", key="ok@x", entry_name="ok", task="t", payload={}, reason="permanent",
            attempts=3, created_at=store.now(conn)))
        conn.execute(runs.insert().values(
            idempotency_key="ok@retrying", entry_name="ok", task="t", state="retrying",
            created_at=store.now(conn), updated_at=store.now(conn)))
    info = json.loads(ok(cli(store, "status", "--json")))
    row = next(e for e in info["entries"] if e["name"] == "ok")
    assert row["dead"] == 1 and row["failing"] == 1 and info["dead_letters"] == 1
    r = cli(store, "status", "--check")
    assert r.exit_code == 1 and "dead letters" in r.output


def test_status_outbox_backlog(store: Store) -> None:
    ok(cli(store, "entries", "add", "a", "--task", "t", "--cron", "0 0 1 1 *"))
    ok(cli(store, "entries", "trigger", "a"))
    ok(cli(store, "entries", "trigger", "a"))
    info = json.loads(ok(cli(store, "status", "--json")))
    (celery,) = [o for o in info["outbox"] if o["destination"] == "celery"]
    assert celery["pending"] == 2 and celery["dead"] == 0
    assert celery["oldest_pending_age_seconds"] is not None
    assert "celery: 2 pending" in ok(cli(store, "status"))


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    values: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def test_metrics_endpoint_over_http(populated: Store) -> None:
    store = populated
    ok(cli(store, "entries", "trigger", "ok"))  # one pending outbox row
    with store.begin() as conn:
        conn.execute(dead_letters.insert().values(
            kind="outbox", key="m1", destination="email", payload={}, reason="undeliverable",
            attempts=5, created_at=store.now(conn)))
        run_id = conn.execute(select(runs.c.id)).scalars().first()
        for n, outcome in enumerate(("succeeded", "deduplicated", "deduplicated", "fenced_out")):
            conn.execute(attempts.insert().values(
                run_id=run_id, attempt=n + 1, fence_token=1, worker="w", outcome=outcome,
                started_at=store.now(conn)))
    server = serve(0, store, addr="127.0.0.1")
    try:
        m = _scrape(server.port)
    finally:
        server.stop()
    assert m["reliable_beat_up"] == 1.0
    assert m['reliable_beat_entries{status="active"}'] == 2.0
    assert m['reliable_beat_entries{status="paused"}'] == 1.0
    assert m["reliable_beat_entries_late"] == 1.0  # 'stalled': the missed-slot alarm
    assert m['reliable_beat_attempts_recent{outcome="deduplicated"}'] == 2.0
    assert m['reliable_beat_attempts_recent{outcome="fenced_out"}'] == 1.0
    assert m['reliable_beat_attempts_recent{outcome="retrying"}'] == 0.0
    assert m['reliable_beat_runs{state="dispatched"}'] == 1.0
    assert m['reliable_beat_runs{state="scheduled"}'] == 1.0
    assert m['reliable_beat_dead_letters{kind="outbox"}'] == 1.0
    assert m['reliable_beat_dead_letters{kind="run"}'] == 0.0
    assert m['reliable_beat_outbox_pending{destination="celery"}'] == 1.0
    assert m['reliable_beat_outbox_oldest_pending_age_seconds{destination="celery"}'] >= 0.0
    # The on-time slot of 'ok' was dispatched ~2 s late: one sample, in the 2.5 s bucket.
    assert m["reliable_beat_fire_lateness_seconds_gcount"] == 1.0
    assert m['reliable_beat_fire_lateness_seconds_bucket{le="1.0"}'] == 0.0
    assert m['reliable_beat_fire_lateness_seconds_bucket{le="+Inf"}'] == 1.0
    assert 1.5 <= m["reliable_beat_fire_lateness_seconds_gsum"] < 30


def test_metrics_down_store_reports_up_0(tmp_path: Path) -> None:
    store = Store.from_url(f"sqlite:///{tmp_path / 'missing' / 'nope.sqlite3'}")
    server = serve(0, store, addr="127.0.0.1")
    try:
        m = _scrape(server.port)
    finally:
        server.stop()
    assert m == {"reliable_beat_up": 0.0}


def test_metrics_textfile(populated: Store, tmp_path: Path) -> None:
    path = tmp_path / "rb.prom"
    ok(cli(populated, "metrics", "textfile", str(path)))
    body = path.read_text()
    assert "reliable_beat_entries_late 1.0" in body
    assert "reliable_beat_fire_lateness_seconds_bucket{le=\"+Inf\"} 1.0" in body


def test_metrics_slots_claim_batches_and_run_durations(store: Store) -> None:
    with store.begin() as conn:
        t0 = store.now(conn) - timedelta(seconds=30)
    tick_b = t0 + timedelta(seconds=1)

    def run(key: str, created: datetime, state: str, trigger: str = "schedule",
            took: float | None = None) -> dict[str, object]:
        return dict(
            idempotency_key=key, entry_name=f"e-{key}", task="t", state=state,
            trigger=trigger, fire_at=created, created_at=created, updated_at=created,
            started_at=created if took is not None else None,
            finished_at=created + timedelta(seconds=took) if took is not None else None)

    with store.begin() as conn:
        conn.execute(runs.insert(), [
            run("a1", t0, "succeeded", took=0.3),  # one claim transaction: 3 slots
            run("a2", t0, "succeeded", took=20.0),
            run("a3", t0, "skipped"),
            run("b1", tick_b, "dispatched", trigger="catch_up"),  # another: 2 slots
            run("b2", tick_b, "dispatched", trigger="catch_up"),
            run("m1", tick_b + timedelta(seconds=1), "dispatched", trigger="manual"),
            run("old", t0 - timedelta(hours=2), "succeeded"),  # outside the 1 h window
        ])
    server = serve(0, store, addr="127.0.0.1")
    try:
        m = _scrape(server.port)
    finally:
        server.stop()
    assert m['reliable_beat_slots_recent{outcome="fired"}'] == 4.0
    assert m['reliable_beat_slots_recent{outcome="skipped"}'] == 1.0
    assert m["reliable_beat_claim_batch_slots_gcount"] == 2.0
    assert m["reliable_beat_claim_batch_slots_gsum"] == 5.0
    assert m['reliable_beat_claim_batch_slots_bucket{le="1.0"}'] == 0.0
    assert m['reliable_beat_claim_batch_slots_bucket{le="10.0"}'] == 2.0
    assert m["reliable_beat_run_duration_seconds_gcount"] == 2.0
    assert m['reliable_beat_run_duration_seconds_bucket{le="0.5"}'] == 1.0
    assert m['reliable_beat_run_duration_seconds_bucket{le="30.0"}'] == 2.0
    assert abs(m["reliable_beat_run_duration_seconds_gsum"] - 20.3) < 1e-6
