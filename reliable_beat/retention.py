"""Retention: delete finished history in bounded batches, never work or dead letters.

What grows, one row each (sizes in docs/configuration.md, "Retention"):

* ``reliable_beat_runs``: one row per slot fired or skipped, per manual trigger, per ad-hoc
  idempotency key, with the task's args/kwargs and result. A 1 s entry writes 86,400 a day.
* ``reliable_beat_attempts``: one row per try of a tracked run.
* ``reliable_beat_outbox``: one row per outbox message and per trigger written there (a slot
  claimed ahead, a manual trigger; a due slot's trigger only when its publish failed).
* ``reliable_beat_dead_letters``: one row per dead run / outbox row.

What is purged, each table by its own setting (None: keep forever):

* runs whose state is final for the beat (``succeeded``, ``skipped``, and ``dispatched``:
  the final state of a plain task's run, which no worker reports on) and whose
  ``created_at`` and ``updated_at`` are both older than ``reliable_beat_runs_retention_seconds``
  (default 30 days). Their attempts go with them (``ON DELETE CASCADE``). Never ``dead``
  runs (a dead letter points at them), never active ones (``scheduled``, ``running``,
  ``retrying``, ``buffered``). Deleting a run deletes its idempotency key: a duplicate
  delivery of that slot arriving *later than the retention period* would run again, so keep
  it well above any redelivery delay (broker visibility timeout, retry backoff cap, outage).
* attempts older than ``reliable_beat_attempts_retention_seconds`` (default 7 days) whose run
  is finished and not dead (the run row keeps its summary: state, attempts, error).
* ``sent`` outbox rows whose ``sent_at`` is older than ``reliable_beat_outbox_retention_seconds``
  (default 7 days). Never ``pending`` or ``dead`` rows.
* workflows (:mod:`reliable_beat.workflows.retention`): ended ones finished more than
  ``reliable_beat_workflow_retention_seconds`` (default 30 days) ago, with their events and
  signals, and continued runs' histories; never pending, running, waiting or blocked ones;
  at most 1,000 workflows per transaction.
* dead letters: never automatically (design.md invariant 8); ``reliable-beat purge
  --dead-letters-before`` deletes them when a person decides.

Each batch is one short transaction of at most ``reliable_beat_purge_batch_size`` rows,
chosen with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so several beats and relays purging at
once neither block each other nor delete twice. :class:`RetentionThread` runs passes in the
background of a beat or relay: a pass deletes batch after batch until a batch comes back short
(it is caught up), then waits ``reliable_beat_purge_interval_seconds``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, select
from sqlalchemy.engine import Connection

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, outbox, runs
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings
from reliable_beat.workflows.retention import purge_workflows

__all__ = [
    "PURGED_RUN_STATES",
    "PurgeResult",
    "RetentionThread",
    "purge",
    "purge_dead_letters",
    "start_retention",
]

log = get_logger("reliable_beat.retention")

#: Run states a purge may delete (see the module docstring).
PURGED_RUN_STATES = ("succeeded", "skipped", "dispatched")
_FINISHED_NOT_DEAD = ("succeeded", "skipped")
TABLES = ("runs", "attempts", "outbox")
#: Most workflows deleted per transaction (each takes its events and signals with it).
WORKFLOW_BATCH = 1000


@dataclass
class PurgeResult:
    """What one purge pass deleted (or, with ``dry_run``, would delete).

    Attributes:
        runs / attempts / outbox: rows deleted (attempts deleted by the runs' cascade are not
            counted in ``attempts``).
        workflows / workflow_events / workflow_signals: ended workflows deleted, and the
            events and signals deleted with them or with continued runs.
        cutoffs: table -> ISO 8601 UTC instant (``Z``) before which rows are purged; a table
            whose retention is None (keep forever) is absent.
        batches: transactions used.
        seconds: wall time of the pass.
        dry_run: nothing was deleted; the counts are what a pass would delete now.
    """

    runs: int = 0
    attempts: int = 0
    outbox: int = 0
    workflows: int = 0
    workflow_events: int = 0
    workflow_signals: int = 0
    cutoffs: dict[str, str] = field(default_factory=dict)
    batches: int = 0
    seconds: float = 0.0
    dry_run: bool = False

    @property
    def total(self) -> int:
        """Rows deleted over all tables."""
        return (self.runs + self.attempts + self.outbox + self.workflows
                + self.workflow_events + self.workflow_signals)

    def as_dict(self) -> dict[str, Any]:
        """The result as a JSON-serialisable dict."""
        return {"runs": self.runs, "attempts": self.attempts, "outbox": self.outbox,
                "workflows": self.workflows, "workflow_events": self.workflow_events,
                "workflow_signals": self.workflow_signals,
                "total": self.total, "cutoffs": dict(self.cutoffs), "batches": self.batches,
                "seconds": round(self.seconds, 3), "dry_run": self.dry_run}


def _iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _retention(settings: Settings) -> dict[str, float | None]:
    return {
        "runs": settings.runs_retention_seconds,
        "attempts": settings.attempts_retention_seconds,
        "outbox": settings.outbox_retention_seconds,
    }


def _victims(store: Store, table: str, cutoff: datetime) -> Any:
    """The select of ids one batch of ``table`` may delete (unlimited, unlocked)."""
    if table == "runs":
        return select(runs.c.id).where(
            runs.c.created_at < cutoff, runs.c.updated_at < cutoff,
            runs.c.state.in_(PURGED_RUN_STATES),
        ).order_by(runs.c.id)
    if table == "attempts":
        finished_run = select(runs.c.id).where(
            runs.c.id == attempts.c.run_id, runs.c.state.in_(_FINISHED_NOT_DEAD)
        ).exists()
        return select(attempts.c.id).where(
            attempts.c.started_at < cutoff, finished_run
        ).order_by(attempts.c.id)
    return select(outbox.c.id).where(
        outbox.c.state == "sent", outbox.c.sent_at < cutoff
    ).order_by(outbox.c.id)


_TABLE = {"runs": runs, "attempts": attempts, "outbox": outbox}


def _delete_batch(store: Store, conn: Connection, table: str, cutoff: datetime,
                  limit: int) -> int:
    stmt = _victims(store, table, cutoff).limit(limit)
    if store.has_skip_locked:
        stmt = stmt.with_for_update(skip_locked=True)
    ids = list(conn.execute(stmt).scalars())
    if not ids:
        return 0
    t = _TABLE[table]
    return int(conn.execute(delete(t).where(t.c.id.in_(ids))).rowcount or 0)


def purge(
    store: Store,
    settings: Settings,
    *,
    dry_run: bool = False,
    batch_size: int | None = None,
    max_seconds: float | None = None,
    stop: threading.Event | None = None,
) -> PurgeResult:
    """One retention pass over runs, attempts and sent outbox rows.

    Cutoffs are taken from the database clock once, at the start (design.md invariant 4).
    Each batch deletes at most ``batch_size`` rows of one table in its own transaction; the
    pass goes on with a table until a batch comes back short. Safe from several processes at
    once (``SKIP LOCKED`` on PostgreSQL; SQLite serialises writers).

    Args:
        store: the store.
        settings: supplies the per-table retention (``*_retention_seconds``; None keeps a
            table forever) and ``purge_batch_size``.
        dry_run: count what would be deleted now; delete nothing.
        batch_size: rows per transaction (default ``settings.purge_batch_size``).
        max_seconds: stop starting new batches after this long (None: until caught up).
        stop: stop starting new batches once this event is set.

    Returns:
        Counts per table; see :class:`PurgeResult`.

    Raises:
        StoreUnavailableError: the database went away (batches already committed stay
            deleted; a later pass carries on).
    """
    started = time.monotonic()
    limit = batch_size or settings.purge_batch_size
    result = PurgeResult(dry_run=dry_run)
    with store.connect() as conn:
        now = store.now(conn)
    cutoffs = {
        table: now - timedelta(seconds=seconds)
        for table, seconds in _retention(settings).items() if seconds is not None
    }
    result.cutoffs = {t: _iso(c) for t, c in cutoffs.items()}
    for table, cutoff in cutoffs.items():
        if dry_run:
            with store.connect() as conn:
                sub = _victims(store, table, cutoff).order_by(None).subquery()
                n = int(conn.execute(select(func.count()).select_from(sub)).scalar_one())
            setattr(result, table, n)
            continue
        while True:
            if stop is not None and stop.is_set():
                break
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                break
            with store.begin() as conn:
                deleted = _delete_batch(store, conn, table, cutoff, limit)
            result.batches += 1
            setattr(result, table, getattr(result, table) + deleted)
            if deleted < limit:
                break
    if settings.workflow_retention_seconds is not None:
        cutoff = now - timedelta(seconds=settings.workflow_retention_seconds)
        result.cutoffs["workflows"] = _iso(cutoff)
        remaining = None if max_seconds is None else max(
            0.0, max_seconds - (time.monotonic() - started))
        wf = purge_workflows(store, before=cutoff, batch_size=min(limit, WORKFLOW_BATCH),
                             dry_run=dry_run, max_seconds=remaining, stop=stop)
        result.workflows, result.workflow_events = wf.workflows, wf.events
        result.workflow_signals, result.batches = wf.signals, result.batches + wf.batches
    result.seconds = time.monotonic() - started
    return result


def purge_dead_letters(store: Store, *, before: datetime, dry_run: bool = False) -> int:
    """Delete the dead letters created before ``before``: a person's decision, never automatic.

    Args:
        store: the store.
        before: tz-aware instant; dead letters with ``created_at`` before it go.
        dry_run: count only.

    Returns:
        How many dead letters were (or would be) deleted.

    Raises:
        ValueError: ``before`` is naive.
    """
    if before.tzinfo is None or before.utcoffset() is None:
        raise ValueError("purge_dead_letters needs a tz-aware instant")
    cond = and_(dead_letters.c.created_at < before)
    with store.begin() as conn:
        if dry_run:
            return int(conn.execute(
                select(func.count()).select_from(dead_letters).where(cond)).scalar_one())
        return int(conn.execute(delete(dead_letters).where(cond)).rowcount or 0)


class RetentionThread(threading.Thread):
    """Background retention for a beat or relay process: a :func:`purge` pass every
    ``settings.purge_interval_seconds`` (0 turns it off), until :meth:`stop`.

    A pass runs until caught up, so the purge rate is the database's delete rate (see
    docs/configuration.md for the figures), not one batch per interval. Errors are logged
    and the next pass tries again; the thread never dies on a database outage.
    """

    def __init__(self, store: Store, settings: Settings, *, role: str) -> None:
        super().__init__(name=f"reliable_beat-retention-{role}", daemon=True)
        self.store = store
        self.settings = settings
        self.role = role
        self._stop_event = threading.Event()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the thread to stop after its current batch and wait up to ``timeout`` s."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        interval = self.settings.purge_interval_seconds
        # The first pass a little after start, so start-up work goes first.
        if self._stop_event.wait(min(interval, 5.0)):
            return
        while True:
            try:
                result = purge(self.store, self.settings, stop=self._stop_event)
                if result.total:
                    log.info("retention (%s): purged %d runs, %d attempts, %d sent outbox "
                             "rows in %.2f s", self.role, result.runs, result.attempts,
                             result.outbox, result.seconds)
            except StoreUnavailableError as exc:
                log.warning("retention (%s): database unavailable (%s); next pass in %.0f s",
                            self.role, exc, interval)
            except Exception:
                log.exception("retention (%s): pass failed; next pass in %.0f s",
                              self.role, interval)
            if self._stop_event.wait(interval):
                return


def start_retention(store: Store, settings: Settings, *, role: str) -> RetentionThread | None:
    """Start a :class:`RetentionThread` unless ``purge_interval_seconds`` is 0."""
    if not settings.purge_interval_seconds:
        return None
    thread = RetentionThread(store, settings, role=role)
    thread.start()
    return thread
