"""``ReliableScheduler``: a ``celery.beat.Scheduler`` backed by the SQL store.

Set ``beat_scheduler = "reliable_beat.celery:ReliableScheduler"`` (or ``celery beat -S
reliable_beat.celery:ReliableScheduler``) and run as many ``celery beat`` processes as you
like: each tick claims due entries with ``FOR UPDATE SKIP LOCKED``, so every slot fires once,
and when a beat dies the others carry on. There is no leader and no lock to wait for.

The scheduler holds no entries in memory; the database is the state. It sleeps until the
next claim moment (measured on the database clock, bounded by ``beat_max_loop_interval``)
and wakes early on PostgreSQL ``NOTIFY reliable_beat_entries``. With
``reliable_beat_claim_ahead_seconds`` > 0 (default 0.5) it claims slots that short a time
before they are due, commits their runs and triggers, and holds the triggers in memory until
the slot's instant, when it publishes each slot's messages at once (one Redis pipeline).

The loop itself is the framework-neutral :class:`reliable_beat.loop.BeatLoop` (shared with
the Dramatiq beat); this module adds what is Celery's: the :class:`CeleryPublisher`
(``send_task`` over one producer, a Redis pipeline flushed at the slot's instant), the
``beat_schedule`` / timezone / ``app.tasks`` reading, the broker-timeout warning, and the
mapping of Celery's ``Scheduler`` hooks onto the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar

from celery.beat import Scheduler

from reliable_beat import loop as core
from reliable_beat.adapters import task_function_checker
from reliable_beat.celery import backlog
from reliable_beat.celery.brokers import warn_broker_timeouts
from reliable_beat.celery.publishing import bound_broker_wait, publish_celery_batch
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store
from reliable_beat.entries import EntryDefinition, definitions_from_beat_schedule
from reliable_beat.errors import ConfigurationError
from reliable_beat.groups import schedule_group_of
from reliable_beat.logs import RepeatedLog
from reliable_beat.loop import SWEEP_SECONDS, BeatLoop, deferred_stop_signals
from reliable_beat.outbox import OutboxMessage
from reliable_beat.publish import beat_publish_timeout
from reliable_beat.redaction import get_logger
from reliable_beat.redispatch import tracked_tasks
from reliable_beat.schedules import validate_timezone
from reliable_beat.settings import Settings, celery_timezone
from reliable_beat.triggers import TRIGGER_DESTINATION, Trigger

__all__ = ["SWEEP_SECONDS", "CeleryPublisher", "ReliableScheduler", "publish_messages",
           "publish_triggers"]

#: The Celery beat logs under this name (docs/reference.md), the loop included.
log = get_logger("reliable_beat.scheduler")


@dataclass
class CeleryPublisher:
    """The core loop's :class:`~reliable_beat.loop.HoldingPublisher` for a Celery app:
    :func:`~reliable_beat.celery.publishing.publish_celery_batch` (one producer; on Redis one
    pipeline, built ahead and flushed at the slot's instant; on RabbitMQ publisher confirms).

    Attributes:
        app: the Celery app (its ``send_task``, routes and registered tasks).
        destination: ``celery``.
    """

    app: Any
    destination: str = TRIGGER_DESTINATION

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        return publish_celery_batch(self.app, messages, now=now)

    def publish_at(self, messages: Sequence[OutboxMessage], now: datetime,
                   wait: Callable[[], None]) -> list[tuple[int, BaseException | None]]:
        return publish_celery_batch(self.app, messages, now=now, wait=wait)

    def tracked_tasks(self) -> Collection[str]:
        """The ``IdempotentTask`` tasks registered in the app."""
        return tracked_tasks(self.app)

    def queue_depths(self, messages: Sequence[OutboxMessage]) -> list[tuple[str, int | None]]:
        """Ready messages in each trigger's queue, for the re-dispatch sweep's backlog check
        (:func:`reliable_beat.celery.backlog.queue_depths`)."""
        return backlog.queue_depths(self.app, messages)


def publish_triggers(
    store: Store, app: Any, triggers: list[Trigger], now: datetime, *,
    wait: Callable[[], None] | None = None,
    unmarked: list[tuple[list[int], list[int]]] | None = None,
) -> int:
    """The fast path: publish committed triggers over one producer, then mark them
    (:func:`reliable_beat.loop.publish_and_mark` with a :class:`CeleryPublisher`).

    Sent rows become ``sent`` (their runs ``dispatched``); expired ones are retired
    (:func:`~reliable_beat.relay.mark_expired`); rows that could not be published are handed
    to the relay at once (``available_at = now``). Nothing is lost if this process dies at
    any point: a row not marked sent is swept by a relay after ``available_at``.

    Args:
        now: the store's clock at the publish (UTC), for the ``expires_at`` check.
        wait: called right before the first message can reach the broker (see
            :func:`~reliable_beat.celery.publishing.publish_celery_batch`): the beat sleeps
            there until the slot of triggers it claimed ahead.
        unmarked: when the marks cannot be written (database gone), ``(sent ids, expired
            ids)`` is appended here; None: they are only logged.

    Returns:
        How many triggers were published.
    """
    return publish_messages(store, app, core.trigger_messages(triggers, TRIGGER_DESTINATION),
                            now, wait=wait, unmarked=unmarked)


def publish_messages(
    store: Store, app: Any, messages: list[OutboxMessage], now: datetime, *,
    wait: Callable[[], None] | None = None,
    unmarked: list[tuple[list[int], list[int]]] | None = None,
) -> int:
    """Publish ``celery`` outbox rows over one producer and mark the outcome (see
    :func:`publish_triggers`). Returns how many were published."""
    return core.publish_and_mark(store, CeleryPublisher(app), messages, now, wait=wait,
                                 unmarked=unmarked, logger=log)


#: "still cannot record ..." is retried every tick during an outage: first, then every 30 s
_STILL_UNMARKED = RepeatedLog(log)


def record_unmarked(store: Store, unmarked: list[tuple[list[int], list[int]]]) -> bool:
    """Write the marks a publish could not write (:func:`reliable_beat.loop.record_unmarked`).

    Returns:
        True when nothing is left to record; False: the database is still unavailable.
    """
    return core.record_unmarked(store, unmarked, repeated=_STILL_UNMARKED, logger=log)


class ReliableScheduler(Scheduler):  # type: ignore[misc]
    """Celery beat scheduler storing entries, runs and triggers in SQL.

    Reads ``reliable_beat_*`` settings (:class:`~reliable_beat.settings.Settings`) from the
    app. On start it verifies the schema (an embedded SQLite store is created; a server
    database that is behind is waited for, or upgraded with
    ``reliable_beat_run_migrations``) and syncs ``beat_schedule`` into the store.

    A thin wrapper: Celery's hooks (``setup_schedule``, ``tick``, ``info``, ``sync``,
    ``close``) delegate to one core :class:`~reliable_beat.loop.BeatLoop` (:attr:`loop`)
    with a :class:`CeleryPublisher`.

    Raises (at start):
        SystemExit(2): any ``beat_schedule`` entry is invalid (all problems logged).
    """

    #: Instances of this class in this process still inside :meth:`setup_schedule`.
    _in_setup: ClassVar[int] = 0

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        if ReliableScheduler._in_setup:
            # Celery's SIGTERM / SIGINT handler calls service.sync(), which builds the
            # scheduler when the first one is still starting (e.g. waiting for the database):
            # stop here instead of starting a second wait inside the signal handler. Nothing
            # has been claimed yet.
            raise SystemExit(0)
        self.settings = Settings.from_celery(app)
        self.store: Store = Store.from_url(self.settings.database_url, role="beat")
        self.app = app
        self.group = schedule_group_of(app, self.settings.schedule_group)
        self.loop = BeatLoop(
            self.store, self.settings, CeleryPublisher(app), self.settings.owner,
            is_tracked=self._is_tracked, schedule_group=self.group,
            definitions=self._definitions, is_registered=lambda task: task in app.tasks,
            logger=log,
        )
        # before any broker connection: a hung or slow broker fails a publish within this
        # bound instead of freezing the loop (claims, heartbeat) for as long as it hangs, and
        # before another process's sweep may publish the same slots (half the sweep delay)
        configured = self.settings.publish_timeout_seconds
        bound_broker_wait(app, beat_publish_timeout(
            configured, self.loop.beat.sweep_delay, log,
            default=configured == Settings.publish_timeout_seconds))
        super().__init__(app, *args, **kwargs)
        self.loop.max_interval = float(self.max_interval)

    # -- start -----------------------------------------------------------------------------
    def _is_tracked(self, task: str) -> bool:
        return isinstance(self.app.tasks.get(task), IdempotentTask)

    def _task_kind(self, task: str) -> bool | None:
        if task not in self.app.tasks:
            return None
        return self._is_tracked(task)

    def _definitions(self, now: datetime) -> list[EntryDefinition]:
        """``beat_schedule`` as entry definitions at ``now``, in Celery's timezone."""
        try:
            zone = validate_timezone(celery_timezone(self.app))  # Celery's own resolution
        except ConfigurationError as exc:
            raise ConfigurationError(f"Celery's timezone setting: {exc}") from None
        return definitions_from_beat_schedule(
            self.app.conf.beat_schedule or {},
            default_timezone=zone,
            settings=self.settings,
            now=now,
            is_idempotent=self._task_kind,
            task_function=task_function_checker(self.app),
        )

    def _warn_broker_timeouts(self) -> None:
        warn_broker_timeouts(self.app, self.settings)

    def setup_schedule(self) -> None:
        """Check ``beat_schedule``, wait for the database and its schema, sync
        (:meth:`reliable_beat.loop.BeatLoop.start`)."""
        ReliableScheduler._in_setup += 1
        try:
            self.loop.start(before_wait=self._warn_broker_timeouts)
        finally:
            ReliableScheduler._in_setup -= 1

    @property
    def info(self) -> str:
        warning = self.settings.default_store_warning("beat")
        return (
            (f"    . WARNING -> {warning}\n" if warning else "")
            + f"    . store -> {self.store.safe_url} (from {self.settings.database_url_origin})\n"
            f"    . owner -> {self.settings.owner}\n"
            f"    . schedule group -> {self.group}\n"
            f"    . schema -> {self.loop.schema_status()} (head {migrate.head()})"
        )

    # -- the loop: see reliable_beat.loop ----------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One round of the core loop (:meth:`reliable_beat.loop.BeatLoop.tick`): publish
        held triggers that are due, claim if it is time, sweep; then wait.

        Returns seconds for Celery to sleep (0 when this call already waited).
        """
        return self.loop.tick()

    # -- Celery hooks we neutralise: the database is the state ------------------------------
    def sync(self) -> None:
        """Nothing to write back: every decision was committed when it was made."""

    def close(self) -> None:
        """Publish any triggers still held (each at its slot, at most the claim-ahead away),
        then release the LISTEN connection and the pool.

        Celery's beat SIGTERM / SIGINT handler calls ``Service.sync()``, i.e. this method,
        then raises ``SystemExit``; the loop holds that handler back while it claims and
        publishes (:func:`reliable_beat.loop.deferred_stop_signals`), so it runs between two
        rounds, when every committed trigger is either sent or held, and held ones go out
        here at their slots (docs/operations.md, "Stopping a beat")."""
        self.loop.close()

    @property
    def schedule(self) -> dict[str, Any]:
        """Empty: entries are never loaded into memory (see ``reliable-beat entries list``)."""
        return {}

    def install_default_entries(self, data: Any) -> None:
        """Celery's built-in ``celery.backend_cleanup`` is not added implicitly."""

    def reserve(self, entry: Any) -> Any:  # pragma: no cover - stock path unused
        return entry

    @staticmethod
    def seconds_until(at: datetime, now: datetime) -> float:
        return max(0.0, (at - now) / timedelta(seconds=1))


# Names of the loop helpers that lived here before the loop moved to reliable_beat.loop.
_deferred_stop_signals = deferred_stop_signals
_sleep_until = core.sleep_until
