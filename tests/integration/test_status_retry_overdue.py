"""``status`` reports runs waiting in ``retrying`` that re-sending did not move on.

Fresh-user finding: after ``reliable-beat lease clear KEY`` on a run whose worker was paused,
the run sat in ``retrying`` for 12 minutes (the fenced-out attempt sends no retry; only the
re-dispatch sweep re-sends it) while ``status --check`` exited 0. Since ``runs.retry_at``
the sweep re-sends a ``retrying`` run ``redispatch_seconds`` after its retry was due (an
ad-hoc call's too), so RETRY OVERDUE names only what re-sending did not help: a run re-sent
that no worker took up, or one whose re-send did not happen (no beat or relay sweeps it).
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


def _run(store: Store, key: str, at: datetime, state: str, *, trigger_row: bool = True) -> int:
    with store.begin() as conn:
        run_id = conn.execute(insert(runs).values(
            idempotency_key=key, entry_name=key.split("@")[0] if trigger_row else None,
            fire_at=at if trigger_row else None, trigger="schedule" if trigger_row else "adhoc",
            task="proj.pay", args=[], kwargs={}, state=state,
            fence_token=1, attempts=1, created_at=at, updated_at=at, dispatched_at=at,
            started_at=at, leased_by="w1" if state == "running" else None,
            lease_expires_at=at + timedelta(hours=1) if state == "running" else None,
        ).returning(runs.c.id)).scalar_one()
        if trigger_row:
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


def _set(store: Store, key: str, **values: Any) -> None:
    with store.begin() as conn:
        conn.execute(update(runs).where(runs.c.idempotency_key == key).values(**values))


def _seed(store: Store) -> datetime:
    with store.engine.connect() as conn:
        now: Any = store.now(conn)
    ago = lambda s: now - timedelta(seconds=s)  # noqa: E731
    # a paused worker's run, its lease cleared 300 s ago and never re-sent (no sweep runs)
    cleared = _run(store, "pay@1", ago(601), "running")
    _attempt(store, cleared, ago(600), "running", None)
    rb_runs.clear_lease(store, "pay@1")
    _set(store, "pay@1", updated_at=ago(300), retry_at=ago(300))
    # re-sent once by the sweep 200 s ago, and no worker took it up
    resent = _run(store, "pay@2", ago(900), "retrying")
    _attempt(store, resent, ago(900), "failed", 60.0)
    _set(store, "pay@2", updated_at=ago(200), retry_at=ago(200), redispatches=1)
    # a retry scheduled for 300 s from now: not due
    later = _run(store, "pay@3", ago(60), "retrying")
    _attempt(store, later, ago(60), "failed", 360.0)
    _set(store, "pay@3", retry_at=now + timedelta(seconds=300))
    # due 150 s ago: the sweep re-sends it at 120 s, within the grace: no alarm yet
    fresh = _run(store, "pay@4", ago(160), "retrying")
    _attempt(store, fresh, ago(160), "failed", 10.0)
    _set(store, "pay@4", updated_at=ago(160), retry_at=ago(150))
    # an ad-hoc call's run (no trigger row), due 300 s ago, not re-sent
    adhoc = _run(store, "manual:5", ago(310), "retrying", trigger_row=False)
    _attempt(store, adhoc, ago(310), "failed", 10.0)
    _set(store, "manual:5", updated_at=ago(310), retry_at=ago(300))
    # a row from before retry_at: the sweep counts from updated_at + the retry cap
    legacy = _run(store, "pay@6", ago(902), "retrying")
    _attempt(store, legacy, ago(900), "failed", 60.0)
    _set(store, "pay@6", updated_at=ago(900))
    return now  # type: ignore[no-any-return]


def test_retry_overdue_names_what_re_sending_did_not_help(pg_store: Store) -> None:
    """Fails on the old status: it alarmed on pay@4 (the sweep is about to re-send it) and
    said an ad-hoc run has no trigger row so nothing re-sends it."""
    _seed(pg_store)
    info = collect_status(pg_store, redispatch_seconds=120, retry_cap_seconds=600)
    overdue = [p for p in info["problems"] if p.startswith("RETRY OVERDUE")]
    assert len(overdue) == 1, info["problems"]
    text = overdue[0]
    assert "4 runs" in text, text
    for key in ("pay@1", "pay@2", "manual:5", "pay@6"):
        assert key in text, (key, text)
    assert "pay@3" not in text and "pay@4" not in text, text
    assert "re-sent 1 times by the re-dispatch sweep" in text and "no worker took it up" in text
    assert "fenced out" in text and "was due to re-send it at" in text
    assert "no trigger row" not in text and "nothing re-sends it" not in text
    assert not info["ok"]
    result = CliRunner().invoke(reliable_beat, ["--database-url", pg_store.url, "status",
                                                "--check"], catch_exceptions=False)
    assert result.exit_code == 1 and "RETRY OVERDUE" in result.output, result.output


def test_retry_overdue_details(pg_store: Store) -> None:
    now = _seed(pg_store)
    info = collect_status(pg_store, redispatch_seconds=120, retry_cap_seconds=600)
    waiting = info["waiting_retries"]
    assert waiting["count"] == 4
    by_key = {w["key"]: w for w in waiting["runs"]}
    assert by_key["pay@1"]["retry_scheduled"] is False
    assert by_key["pay@1"]["why"] == "not_swept"
    assert by_key["pay@2"]["why"] == "resent" and by_key["pay@2"]["resends"] == 1
    assert by_key["manual:5"]["why"] == "not_swept"
    # the sweep re-sends a retrying run redispatch_seconds after its retry_at
    assert by_key["manual:5"]["resend_at"] == by_key["manual:5"]["retry_due_at"] + timedelta(
        seconds=120)
    # a row without retry_at: (120 + 600) s after it became retrying
    resend = by_key["pay@6"]["resend_at"] - now
    assert timedelta(seconds=-200) <= resend <= timedelta(seconds=-160), resend


def test_lease_clear_and_failure_set_retry_at(pg_store: Store) -> None:
    """What the sweep counts from: a cleared lease is due at once; a failure at its retry."""
    with pg_store.engine.connect() as conn:
        now: Any = pg_store.now(conn)
    run_id = _run(pg_store, "pay@7", now - timedelta(seconds=30), "running")
    _attempt(pg_store, run_id, now - timedelta(seconds=30), "running", None)
    _set(pg_store, "pay@7", redispatches=3)
    rb_runs.clear_lease(pg_store, "pay@7")
    with pg_store.engine.connect() as conn:
        row = conn.execute(select(runs.c.retry_at, runs.c.updated_at, runs.c.redispatches)
                           .where(runs.c.id == run_id)).one()
    assert row.retry_at == row.updated_at and row.redispatches == 0
