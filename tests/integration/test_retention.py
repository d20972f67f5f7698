"""Retention: finished history is purged in bounded batches; work and dead letters are not.

On SQLite and PostgreSQL: exactly the rows past their table's retention go (runs with their
attempts, old attempts of finished runs, sent outbox rows); active and dead runs, pending
and dead outbox rows and dead letters stay; ``--dry-run`` counts the same rows.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select, text

from reliable_beat.celery.commands import reliable_beat as cli
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, outbox, runs
from reliable_beat.retention import RetentionThread, purge
from reliable_beat.settings import Settings

DAY = 86400.0
SETTINGS = Settings(database_url="unused://", runs_retention_seconds=30 * DAY,
                    attempts_retention_seconds=7 * DAY, outbox_retention_seconds=7 * DAY,
                    purge_batch_size=3)


def _seed(store: Store) -> datetime:
    """Runs / attempts / outbox rows / dead letters, old and new, in every state."""
    with store.begin() as conn:
        now = store.now(conn)
        old, mid, new = now - timedelta(days=40), now - timedelta(days=10), now
        rows: list[dict[str, Any]] = []
        for age_name, at in (("old", old), ("mid", mid), ("new", new)):
            for state in ("succeeded", "skipped", "dispatched", "dead", "running", "retrying",
                          "scheduled", "buffered"):
                for i in range(2):
                    rows.append({"idempotency_key": f"{age_name}-{state}-{i}", "task": "t",
                                 "args": [], "kwargs": {}, "state": state,
                                 "created_at": at, "updated_at": at})
        conn.execute(runs.insert(), rows)
        # A run created long ago that finished recently: kept (its key is still fresh).
        conn.execute(runs.insert(), [{"idempotency_key": "old-created-new-update",
                                      "task": "t", "args": [], "kwargs": {},
                                      "state": "succeeded", "created_at": old,
                                      "updated_at": new}])
        ids = dict(conn.execute(select(runs.c.idempotency_key, runs.c.id)).all())
        att = []
        for key, run_id in ids.items():
            started = old if key.startswith("old") else mid if key.startswith("mid") else new
            att.append({"run_id": run_id, "attempt": 1, "fence_token": 1,
                        "started_at": started, "outcome": "succeeded"})
        conn.execute(attempts.insert(), att)
        ob = []
        for age_name, at in (("old", mid), ("new", new)):
            for state in ("sent", "pending", "dead"):
                for i in range(4):
                    ob.append({"message_id": f"{age_name}-{state}-{i}", "destination": "x",
                               "payload": {}, "headers": {}, "state": state,
                               "available_at": at, "created_at": at,
                               "sent_at": at if state == "sent" else None})
        conn.execute(outbox.insert(), ob)
        conn.execute(dead_letters.insert(), [{"kind": "run", "key": f"dl-{i}", "payload": {},
                                              "reason": "permanent", "created_at": old}
                                             for i in range(3)])
    return now


def _count(store: Store, table: Any, *where: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table).where(*where))
                   .scalar_one())


def test_purge_deletes_exactly_what_is_past_retention(store: Store) -> None:
    _seed(store)
    runs_before, attempts_before = _count(store, runs), _count(store, attempts)
    dry = purge(store, SETTINGS, dry_run=True)
    assert _count(store, runs) == runs_before  # a dry run deletes nothing
    result = purge(store, SETTINGS)
    # runs: old succeeded/skipped/dispatched (3 states x 2); attempts: the mid runs'
    # attempts of succeeded/skipped (2 x 2) and the 40-day-old attempt of the run updated
    # now (the old runs' attempts went by cascade); outbox: the 4 sent rows 10 days old.
    assert (result.runs, result.attempts, result.outbox) == (6, 5, 4)
    assert (dry.runs, dry.outbox) == (6, 4)
    assert dry.attempts >= 5  # counted before the runs' cascade removed the old ones
    assert result.batches >= 6  # batch size 3: bounded transactions
    remaining = {k for (k,) in _rows(store, runs.c.idempotency_key)}
    for state in ("dead", "running", "retrying", "scheduled", "buffered"):
        assert f"old-{state}-0" in remaining  # never work in progress, never dead runs
    for state in ("succeeded", "skipped", "dispatched"):
        assert f"old-{state}-0" not in remaining and f"mid-{state}-0" in remaining
    assert "old-created-new-update" in remaining
    assert _count(store, attempts) == attempts_before - 6 - 5
    assert _count(store, outbox, outbox.c.state == "sent") == 4  # the new ones
    assert _count(store, outbox, outbox.c.state != "sent") == 16
    assert _count(store, dead_letters) == 3  # dead letters: only by a person
    again = purge(store, SETTINGS)
    assert again.total == 0


def _rows(store: Store, *cols: Any) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(select(*cols)).all())


def test_none_keeps_a_table_forever(store: Store) -> None:
    _seed(store)
    keep = Settings(database_url="unused://", runs_retention_seconds=None,
                    attempts_retention_seconds=None, outbox_retention_seconds=None)
    assert purge(store, keep).total == 0


def test_cli_purge_dry_run_json_and_dead_letters_by_a_person(store: Store) -> None:
    _seed(store)
    url = store.engine.url.render_as_string(False)
    runner = CliRunner()
    out = runner.invoke(cli, ["--database-url", url, "purge", "--dry-run", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["dry_run"] is True and data["runs"] == 6 and data["outbox"] == 4
    assert data["cutoffs"]["runs"].endswith("Z")
    out = runner.invoke(cli, ["--database-url", url, "purge"])
    assert out.exit_code == 0, out.output
    assert "deleted: 6 runs" in out.output and "rows/s" in out.output
    assert _count(store, dead_letters) == 3
    out = runner.invoke(cli, ["--database-url", url, "purge", "--dead-letters-before",
                              "2999-01-01T00:00:00"])
    assert out.exit_code != 0 and "UTC offset" in out.output
    out = runner.invoke(cli, ["--database-url", url, "purge", "--json",
                              "--dead-letters-before", "2999-01-01T00:00:00Z"])
    assert out.exit_code == 0 and json.loads(out.output)["dead_letters"] == 3
    assert _count(store, dead_letters) == 0


def test_retention_thread_purges_in_the_background(store: Store) -> None:
    _seed(store)
    settings = Settings(database_url="unused://", purge_interval_seconds=0.1,
                        purge_batch_size=2)
    thread = RetentionThread(store, settings, role="test")
    thread.start()
    try:
        deadline = threading.Event()
        for _ in range(100):
            if _count(store, outbox, outbox.c.state == "sent") == 4 and \
                    _count(store, runs, runs.c.idempotency_key == "old-succeeded-0") == 0:
                break
            deadline.wait(0.1)
    finally:
        thread.stop()
    assert not thread.is_alive()
    assert _count(store, runs, runs.c.idempotency_key == "old-succeeded-0") == 0


@pytest.mark.slow
@pytest.mark.postgres
def test_purge_rate_on_postgres(pg_store: Store) -> None:
    """Rows purged per second on PostgreSQL (printed; the figure in docs/configuration.md).

    100,000 finished runs (each with one attempt) and 100,000 sent outbox rows, all past
    retention, purged with the default batch size.
    """
    n = 100_000
    with pg_store.begin() as conn:
        conn.execute(text(
            "INSERT INTO reliable_beat_runs (idempotency_key, entry_name, fire_at, task, args,"
            " kwargs, state, fence_token, attempts, result, created_at, updated_at)"
            " SELECT 'e' || (g % 100) || '@' || g, 'e' || (g % 100),"
            " now() - interval '60 days' + g * interval '1 second', 'proj.tasks.job',"
            " '[1, \"two\"]'::jsonb, '{\"k\": \"v\"}'::jsonb, 'succeeded', 1, 1,"
            " '{\"ok\": true}'::jsonb, now() - interval '40 days', now() - interval '40 days'"
            " FROM generate_series(1, :n) g"), {"n": n})
        conn.execute(text(
            "INSERT INTO reliable_beat_attempts (run_id, attempt, fence_token, worker,"
            " started_at, finished_at, outcome) SELECT id, 1, 1, 'w', created_at, created_at,"
            " 'succeeded' FROM reliable_beat_runs"))
        conn.execute(text(
            "INSERT INTO reliable_beat_outbox (message_id, destination, payload, headers,"
            " state, attempts, available_at, created_at, sent_at)"
            " SELECT 'm' || g, 'celery', '{\"task\": \"proj.tasks.job\", \"args\": [1]}'::jsonb,"
            " '{}'::jsonb, 'sent', 1, now() - interval '10 days', now() - interval '10 days',"
            " now() - interval '10 days' FROM generate_series(1, :n) g"), {"n": n})
        conn.execute(text("ANALYZE"))
    with pg_store.engine.connect() as conn:
        sizes = {t: conn.execute(text(f"SELECT pg_total_relation_size('reliable_beat_{t}')"))
                 .scalar_one() for t in ("runs", "attempts", "outbox")}
    print("\n" + ", ".join(f"{t}: {b / n:.0f} bytes/row with indexes" for t, b in sizes.items()))
    result = purge(pg_store, Settings(database_url="unused://"))
    assert (result.runs, result.outbox) == (n, n)
    assert _count(pg_store, attempts) == 0  # went with their runs
    rows = result.runs + n + result.outbox  # runs + cascaded attempts + outbox rows
    print(f"\npurged {result.runs} runs (+{n} attempts by cascade) and {result.outbox} sent "
          f"outbox rows in {result.seconds:.2f} s, {result.batches} batches: "
          f"{(result.runs + result.outbox) / result.seconds:,.0f} runs+outbox rows/s, "
          f"{rows / result.seconds:,.0f} rows/s with attempts")
