"""Workflow retention: delete ended workflows and finished runs' histories in bounded batches
(docs/workflows.md, "Retention").

What goes, once older than the cutoff (``reliable_beat_workflow_retention_seconds``, 30 days,
or ``reliable-beat workflows purge --older-than``):

* ended workflows (``completed``, ``failed``, ``cancelled``) whose ``finished_at`` is before
  the cutoff, with their events and signals;
* the events of runs a workflow has continued from (``run_no`` below the workflow's current
  one, written before the cutoff) and the signals those runs consumed, for any workflow that
  is not ``blocked``: the current run's history is never touched.

Never: ``pending``, ``running``, ``waiting``, ``blocked`` workflows, any event of a current
run, any unconsumed signal. Each batch is one short transaction of at most ``batch_size``
workflows (or old events), chosen with ``FOR UPDATE SKIP LOCKED`` where the store has it, so
several relays and beats purging at once neither wait on each other nor delete twice.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, func, select, tuple_
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflow_events, workflow_signals, workflows
from reliable_beat.redaction import get_logger

__all__ = ["ENDED_STATES", "WorkflowPurge", "purge_workflows"]

#: Workflow states a purge may delete (``cancelled`` comes with cancellation).
ENDED_STATES = ("completed", "failed", "cancelled")

log = get_logger("reliable_beat.workflows.retention")


@dataclass
class WorkflowPurge:
    """What one workflow purge deleted (or, with ``dry_run``, would delete).

    Attributes:
        workflows: ended workflows deleted (their events and signals with them).
        events: events deleted (those of the deleted workflows and of continued runs).
        signals: consumed signals deleted.
        batches: transactions used.
    """

    workflows: int = 0
    events: int = 0
    signals: int = 0
    batches: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The counts as a JSON-serialisable dict."""
        return {"workflows": self.workflows, "events": self.events, "signals": self.signals,
                "batches": self.batches}


def _ended(cutoff: datetime) -> Any:
    return select(workflows.c.id).where(
        workflows.c.state.in_(ENDED_STATES), workflows.c.finished_at.is_not(None),
        workflows.c.finished_at < cutoff,
    ).order_by(workflows.c.id)


def _old_run_events(cutoff: datetime) -> Any:
    j = workflow_events.join(workflows, workflows.c.id == workflow_events.c.workflow_pk)
    return select(workflow_events.c.workflow_pk, workflow_events.c.run_no,
                  workflow_events.c.seq).select_from(j).where(
        workflow_events.c.run_no < workflows.c.run_no,
        workflow_events.c.created_at < cutoff,
        workflows.c.state != "blocked",
    )


def _old_run_signals(cutoff: datetime) -> Any:
    j = workflow_signals.join(workflows, workflows.c.id == workflow_signals.c.workflow_pk)
    return select(workflow_signals.c.id).select_from(j).where(
        workflow_signals.c.consumed_run_no.is_not(None),
        workflow_signals.c.consumed_run_no < workflows.c.run_no,
        workflow_signals.c.created_at < cutoff,
        workflows.c.state != "blocked",
    )


def _count(conn: Connection, q: Any) -> int:
    return int(conn.execute(select(func.count()).select_from(
        q.order_by(None).subquery())).scalar_one())


def _delete_ended(store: Store, conn: Connection, cutoff: datetime, limit: int,
                  out: WorkflowPurge) -> int:
    stmt = _ended(cutoff).limit(limit)
    if store.has_skip_locked:
        stmt = stmt.with_for_update(skip_locked=True)
    ids = list(conn.execute(stmt).scalars())
    if not ids:
        return 0
    # children first (no reliance on ON DELETE CASCADE: SQLite enforces it per connection)
    out.events += int(conn.execute(
        delete(workflow_events).where(workflow_events.c.workflow_pk.in_(ids))).rowcount or 0)
    out.signals += int(conn.execute(
        delete(workflow_signals).where(workflow_signals.c.workflow_pk.in_(ids))).rowcount or 0)
    done = int(conn.execute(delete(workflows).where(
        workflows.c.id.in_(ids), workflows.c.state.in_(ENDED_STATES))).rowcount or 0)
    out.workflows += done
    return len(ids)


def _delete_old_runs(conn: Connection, cutoff: datetime, limit: int,
                     out: WorkflowPurge) -> int:
    keys = [tuple(r) for r in conn.execute(_old_run_events(cutoff).limit(limit)).all()]
    if keys:
        out.events += int(conn.execute(delete(workflow_events).where(
            tuple_(workflow_events.c.workflow_pk, workflow_events.c.run_no,
                   workflow_events.c.seq).in_(keys))).rowcount or 0)
    sig_ids = list(conn.execute(_old_run_signals(cutoff).limit(limit)).scalars())
    if sig_ids:
        out.signals += int(conn.execute(
            delete(workflow_signals).where(workflow_signals.c.id.in_(sig_ids))).rowcount or 0)
    return max(len(keys), len(sig_ids))


def purge_workflows(
    store: Store,
    *,
    before: datetime,
    batch_size: int = 1000,
    dry_run: bool = False,
    max_seconds: float | None = None,
    stop: threading.Event | None = None,
) -> WorkflowPurge:
    """Delete ended workflows and continued runs' histories from before ``before``.

    Args:
        store: the store.
        before: tz-aware cutoff, on the database clock (take it from ``store.now``).
        batch_size: workflows (or old-run events) per transaction.
        dry_run: count what would be deleted now; delete nothing.
        max_seconds: stop starting new batches after this long (None: until caught up).
        stop: stop starting new batches once this event is set.

    Returns:
        The counts (see :class:`WorkflowPurge`).

    Raises:
        ValueError: ``before`` is naive or ``batch_size`` < 1.
    """
    if before.tzinfo is None or before.utcoffset() is None:
        raise ValueError("purge_workflows needs a tz-aware cutoff (the database clock's)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = WorkflowPurge()
    if dry_run:
        with store.connect() as conn:
            out.workflows = _count(conn, _ended(before))
            ended_ids = _ended(before).order_by(None)
            out.events = _count(conn, _old_run_events(before)) + _count(
                conn, select(workflow_events.c.seq).where(
                    workflow_events.c.workflow_pk.in_(ended_ids)))
            out.signals = _count(conn, _old_run_signals(before)) + _count(
                conn, select(workflow_signals.c.id).where(and_(
                    workflow_signals.c.workflow_pk.in_(ended_ids))))
        return out
    started = time.monotonic()
    for step in ("ended", "old_runs"):
        while True:
            if stop is not None and stop.is_set():
                return out
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                return out
            n = _one_batch(store, step, before, batch_size, out)
            out.batches += 1
            if n < batch_size:
                break
    return out


#: How many times a purge batch the database chose as a deadlock victim (rolled back whole:
#: nothing deleted) is tried again. Two purgers (two relays' retention, or a relay and
#: ``workflows purge``) deleting neighbouring rows can deadlock on MariaDB, whose InnoDB
#: locks every row a ``DELETE`` scans, and in principle on PostgreSQL.
DEADLOCK_RETRIES = 5


def _is_deadlock(exc: OperationalError) -> bool:
    orig = exc.orig
    if getattr(orig, "sqlstate", None) == "40P01" or getattr(orig, "pgcode", None) == "40P01":
        return True  # PostgreSQL deadlock_detected (psycopg 3 / psycopg2)
    args: tuple[Any, ...] = tuple(getattr(orig, "args", None) or ())
    return bool(args) and args[0] == 1213  # MySQL / MariaDB ER_LOCK_DEADLOCK


def _one_batch(store: Store, step: str, before: datetime, batch_size: int,
               out: WorkflowPurge) -> int:
    """One purge transaction; a deadlock victim is retried (its deletes were rolled back,
    so the batch is selected again); the counts join ``out`` only once committed."""
    retries = 0
    while True:
        counts = WorkflowPurge()
        try:
            with store.begin() as conn:
                if step == "ended":
                    n = _delete_ended(store, conn, before, batch_size, counts)
                else:
                    n = _delete_old_runs(conn, before, batch_size, counts)
        except OperationalError as exc:
            if not _is_deadlock(exc) or retries >= DEADLOCK_RETRIES:
                raise
            retries += 1
            log.info("workflow purge batch chosen as deadlock victim; trying again (%d)",
                     retries)
            time.sleep(0.05 * retries)
            continue
        out.workflows += counts.workflows
        out.events += counts.events
        out.signals += counts.signals
        return n
