"""``status`` reports runs waiting in ``retrying`` past their retry time.

Fresh-user finding: after ``reliable-beat lease clear KEY`` on a run whose worker was paused,
the run sat in ``retrying`` for 12 minutes (the fenced-out attempt sends no retry; only the
re-dispatch sweep re-sends it, ``redispatch_seconds + retry_cap_seconds`` later) while
``status --check`` exited 0 with only a FAILING count.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from click.testing import CliRunner
from sqlalchemy import insert, select, update

from reliable_beat import runs as rb_runs
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, outbox, runs


def _run(store: Store, key: str, at: datetime, state: str) -> int:
    with store.begin() as conn:
        run_id = conn.execute(insert(runs).values(
            idempotency_key=key, entry_name=key.split("@")[0], fire_at=at,
            trigger="schedule", task="proj.pay", args=[], kwargs={}, state=state,
            fence_token=1, attempts=1, created_at=at, updated_at=at, dispatched_at=at,
            started_at=at, leased_by="w1" if state == "running" else None,
            lease_expires_at=at + timedelta(hours=1) if state == "running" else None,
        ).returning(runs.c.id)).scalar_one()
        conn.execute(insert(outbox).values(
            message_id=f"trigger:{key}", destination="celery", payload={}, headers={},
            run_id=run_id, state="sent", available_at=at, created_at=at, sent_at=at))
        return int(run_id)


def _attempt(store: Store, run_id: int, at: datetime, outcome: str,
             retry_in: float | None) -> None:
    with store.begin() as conn:
        conn.execute(insert(attempts).values(
            run_id=run_id, attempt=1, fence_token=1, worker="w1", started_at=at,
            finished_at=None if outcome == "running" else at, outcome=outcome,
            retry_in_seconds=retry_in))


def _age(store: Store, key: str, seconds: float) -> None:
    """Move the run's updated_at ``seconds`` into the past (time passes)."""
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(runs).where(runs.c.idempotency_key == key)
                     .values(updated_at=now - timedelta(seconds=seconds)))


def _seed(store: Store) -> None:
    with store.engine.connect() as conn:
        now: Any = store.now(conn)
    # a paused worker's run, its lease cleared by a person 200 s ago: no retry scheduled
    cleared = _run(store, "pay@1", now - timedelta(minutes=10), "running")
    _attempt(store, cleared, now - timedelta(minutes=10), "running", None)
    rb_runs.clear_lease(store, "pay@1")
    _age(store, "pay@1", 200)
    # a retry the worker scheduled 15 min ago for 60 s later: never taken up
    lost = _run(store, "pay@2", now - timedelta(minutes=15), "retrying")
    _attempt(store, lost, now - timedelta(minutes=15), "failed", 60.0)
    # a retry scheduled 5 min ago for 10 min later: not due yet
    later = _run(store, "pay@3", now - timedelta(minutes=5), "retrying")
    _attempt(store, later, now - timedelta(minutes=5), "failed", 600.0)


def test_retry_overdue_after_lease_clear(pg_store: Store) -> None:
    """Fails on the old status: no problem at all (ok, FAILING counts only)."""
    _seed(pg_store)
    with pg_store.engine.connect() as conn:
        assert conn.execute(select(runs.c.state).where(
            runs.c.idempotency_key == "pay@1")).scalar_one() == "retrying"
    info = collect_status(pg_store, redispatch_seconds=120)
    overdue = [p for p in info["problems"] if p.startswith("RETRY OVERDUE")]
    assert len(overdue) == 1, info["problems"]
    assert "2 runs" in overdue[0] and "pay@1" in overdue[0] and "pay@2" in overdue[0]
    assert "pay@3" not in overdue[0]
    assert "fenced out" in overdue[0] and "re-sends it at about" in overdue[0]
    # pay@2 became retrying 15 min ago: the sweep (120 + 600 s) was due already
    assert "was due to re-send it at" in overdue[0]
    assert not info["ok"]
    result = CliRunner().invoke(reliable_beat, ["--database-url", pg_store.url, "status",
                                                "--check"], catch_exceptions=False)
    assert result.exit_code == 1 and "RETRY OVERDUE" in result.output, result.output


def test_retry_overdue_details(pg_store: Store) -> None:
    _seed(pg_store)
    info = collect_status(pg_store, redispatch_seconds=120, retry_cap_seconds=600)
    waiting = info["waiting_retries"]
    assert waiting["count"] == 2
    by_key = {w["key"]: w for w in waiting["runs"]}
    assert by_key["pay@1"]["retry_scheduled"] is False
    assert by_key["pay@2"]["retry_scheduled"] is True
    # the sweep re-sends a retrying run (120 + 600) s after it became retrying
    now = info["now"]
    resend = by_key["pay@1"]["resend_at"] - now
    assert timedelta(seconds=500) <= resend <= timedelta(seconds=540), resend
