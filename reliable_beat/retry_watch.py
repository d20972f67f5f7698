"""Runs waiting in ``retrying`` that re-sending did not move on (the RETRY OVERDUE alarm).

A ``retrying`` run waits for its retry message (design invariant 9: every state that waits
has something that moves it on, or an alarm names it). The run sweep
(:mod:`reliable_beat.redispatch`) re-sends a run ``redispatch_seconds`` after its retry was
due (``runs.retry_at``), then again after ``redispatch_seconds * 2**k`` (k its re-sends in this
wait), from any beat or relay of the run's app. So a run only keeps waiting when re-sending
does not help, and that is what this module finds, for ``reliable-beat status`` (RETRY
OVERDUE, ``--check``) and the ``reliable_beat_runs_retry_overdue`` metric:

* ``resent``: the sweep re-sent it (``k >= 1``; the last re-send is its ``retry_at``) and no
  worker took it up within ``redispatch_seconds``: the workers of its queue are down or
  behind, or none consumes it;
* ``not_swept``: its re-send was due more than ``redispatch_seconds`` ago and did not
  happen: no beat or relay of its app (schedule group) runs, or its queue holds a backlog
  the sweep waits behind.

Workflow activities (keys ``wf:...``) are the workflow sweep's and left out.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from reliable_beat.db.tables import attempts, runs
from reliable_beat.redispatch import WORKFLOW_KEY_PREFIX, backoff_wait
from reliable_beat.slots import parse_fire_at

__all__ = ["overdue_retries"]


def _utc(value: Any) -> datetime | None:
    """A store instant as an aware UTC datetime (SQLite aggregates come back as text; the
    store keeps UTC, so no zone is UTC: :func:`reliable_beat.slots.parse_fire_at`)."""
    return parse_fire_at(value, "instant")


def overdue_retries(conn: Connection, now: datetime, *, redispatch_seconds: float,
                    retry_cap_seconds: float, limit: int = 10
                    ) -> tuple[int, list[dict[str, Any]]]:
    """``retrying`` runs that re-sending did not move on (see the module).

    A run's retry was due at ``retry_at`` (its retry's countdown end, or the sweep's last
    re-send). A row written before ``retry_at`` existed counts from its latest attempt's
    ``finished_at + retry_in_seconds`` (or ``updated_at``), and the sweep re-sends it
    ``(redispatch_seconds + retry_cap_seconds) * 2**k`` after ``updated_at``.

    Args:
        conn: a connection to the store.
        now: the store's clock (UTC).
        redispatch_seconds: ``reliable_beat_redispatch_seconds``.
        retry_cap_seconds: ``reliable_beat_retry_cap_seconds``.
        limit: most runs returned (the longest overdue first).

    Returns:
        ``(count, runs)``: how many, and up to ``limit`` as ``{"key", "entry",
        "retry_due_at", "retry_scheduled" (False: no retry was scheduled, e.g. a
        fenced-out attempt after ``lease clear``), "resends" (k), "resend_at" (when the
        sweep re-sends it next), "why" (``resent`` or ``not_swept``)}``.
    """
    grace = timedelta(seconds=redispatch_seconds)
    latest = (select(func.max(attempts.c.id)).where(attempts.c.run_id == runs.c.id)
              .correlate(runs).scalar_subquery())
    rows = conn.execute(
        select(runs.c.idempotency_key, runs.c.entry_name, runs.c.updated_at, runs.c.retry_at,
               runs.c.redispatches, attempts.c.finished_at, attempts.c.retry_in_seconds)
        .select_from(runs.outerjoin(attempts, attempts.c.id == latest))
        .where(runs.c.state == "retrying",
               func.coalesce(runs.c.retry_at, runs.c.updated_at) <= now - grace,
               ~runs.c.idempotency_key.startswith(WORKFLOW_KEY_PREFIX))
    ).all()
    overdue: list[dict[str, Any]] = []
    for key, entry, updated_at, retry_at, resends, finished_at, retry_in in rows:
        updated = _utc(updated_at)
        if updated is None:
            continue
        k = int(resends or 0)
        finished = _utc(finished_at)
        scheduled = retry_in is not None and finished is not None
        due = _utc(retry_at)
        if due is not None:
            resend_at = due + backoff_wait(grace, k)
        else:  # a row from before 0015_retrysweep
            due = updated
            if scheduled and finished is not None:
                due = max(due, finished + timedelta(seconds=float(retry_in)))
            resend_at = updated + backoff_wait(
                timedelta(seconds=redispatch_seconds + retry_cap_seconds), k)
        if k >= 1 and now >= (due if retry_at is not None else updated) + grace:
            why = "resent"
        elif now >= resend_at + grace:
            why = "not_swept"
        else:
            continue
        overdue.append({"key": key, "entry": entry, "retry_due_at": due,
                        "retry_scheduled": scheduled, "resends": k, "resend_at": resend_at,
                        "why": why})
    overdue.sort(key=lambda w: (w["retry_due_at"], w["key"]))
    return len(overdue), overdue[:limit]
