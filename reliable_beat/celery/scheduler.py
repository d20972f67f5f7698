"""``ReliableScheduler``: a ``celery.beat.Scheduler`` backed by the SQL store.

Set ``beat_scheduler = "reliable_beat.celery:ReliableScheduler"`` (or ``celery beat -S
reliable_beat.celery:ReliableScheduler``) and run as many ``celery beat`` processes as you
like: each tick claims due entries with ``FOR UPDATE SKIP LOCKED``, so every slot fires once,
and when a beat dies the others carry on. There is no leader and no lock to wait for.

The scheduler holds no entries in memory; the database is the state. It sleeps until the
earliest ``next_fire_at`` (measured on the database clock, bounded by
``beat_max_loop_interval``) and wakes early on PostgreSQL ``NOTIFY reliable_beat_entries``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select as _select
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

from celery.beat import Scheduler
from sqlalchemy import update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from reliable_beat.beat import TRIGGER_DESTINATION, Beat, TickResult, Trigger, trigger_message_id
from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.entries import (
    NOTIFY_CHANNEL,
    EntryDefinition,
    definitions_from_beat_schedule,
    sync_config_entries,
)
from reliable_beat.errors import ConfigurationError, SchemaError, StoreUnavailableError
from reliable_beat.handlers import MessageExpiredError, publish_celery_batch
from reliable_beat.logs import event
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redispatch import redispatch_stuck_runs
from reliable_beat.relay import claim_outbox_batch, mark_expired, mark_sent
from reliable_beat.schedules import validate_timezone
from reliable_beat.settings import Settings

__all__ = ["ReliableScheduler", "publish_triggers"]

log = logging.getLogger("reliable_beat.scheduler")

#: How often a beat sweeps trigger rows the fast path left unsent (seconds).
SWEEP_SECONDS = 5.0
#: Default wait bound on SQLite, which has no NOTIFY: entries added at runtime are seen
#: within this many seconds.
SQLITE_MAX_WAIT_SECONDS = 1.0


def publish_triggers(store: Store, app: Any, triggers: list[Trigger], now: datetime) -> int:
    """The fast path: publish committed triggers over one producer, then mark them.

    Sent rows become ``sent`` (their runs ``dispatched``); expired ones are retired
    (:func:`~reliable_beat.relay.mark_expired`); rows that could not be published are handed
    to the relay at once (``available_at = now``). Nothing is lost if this process dies at
    any point: a row not marked sent is swept by a relay after ``available_at``.

    Returns:
        How many triggers were published.
    """
    messages = [
        OutboxMessage(
            id=t.outbox_id, message_id=trigger_message_id(t.key), destination="celery",
            payload=t.payload, run_id=t.run_id,
        )
        for t in triggers
    ]
    return publish_messages(store, app, messages, now)


def publish_messages(store: Store, app: Any, messages: list[OutboxMessage], now: datetime) -> int:
    """Publish ``celery`` outbox rows over one producer and mark the outcome (see
    :func:`publish_triggers`). Returns how many were published."""
    outcomes = publish_celery_batch(app, messages, now=now)
    sent = [i for i, err in outcomes if err is None]
    expired = [i for i, err in outcomes if isinstance(err, MessageExpiredError)]
    failed = [i for i, err in outcomes if err is not None and i not in expired]
    if failed:
        log.warning("%d triggers not published (%s); they stay in the outbox for the relay",
                    len(failed), next(err for _, err in outcomes if err is not None))
    try:
        with store.begin() as conn:
            at = store.now(conn)
            mark_sent(conn, sent, at)
            mark_expired(conn, expired, at)
            if failed:
                conn.execute(
                    update(outbox).where(outbox.c.id.in_(failed), outbox.c.state == "pending")
                    .values(available_at=at, claimed_by=None)
                )
    except (StoreUnavailableError, DBAPIError) as exc:
        # Published but not marked: a relay re-sends them later (at least once, same task id).
        log.error("could not mark %d triggers sent (%s)", len(sent), exc)
    return len(sent)


@contextlib.contextmanager
def _deferred_stop_signals() -> Iterator[None]:
    """Hold SIGTERM/SIGINT back while the block runs (main thread, POSIX); no-op elsewhere."""
    stop = {signal.SIGTERM, signal.SIGINT}
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ReliableScheduler(Scheduler):  # type: ignore[misc]
    """Celery beat scheduler storing entries, runs and triggers in SQL.

    Reads ``reliable_beat_*`` settings (:class:`~reliable_beat.settings.Settings`) from the
    app. On start it verifies the schema (an embedded SQLite store is created; a server
    database that is behind is an error naming ``reliable-beat db upgrade`` unless
    ``reliable_beat_run_migrations`` is true) and syncs ``beat_schedule`` into the store.

    Raises (at start):
        EntryValidationError: any ``beat_schedule`` entry is invalid (all problems listed).
        SchemaError: the schema is behind.
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
        self._listen: Any = None
        self._failures = 0
        self._last_sweep = 0.0
        self._metrics: Any = None
        self._tick_started = time.monotonic()
        self.app = app
        self._beat = Beat(
            self.store, owner=self.settings.owner, batch_size=self.settings.batch_size,
            is_tracked=self._is_tracked,
        )
        super().__init__(app, *args, **kwargs)

    # -- start -----------------------------------------------------------------------------
    def _is_tracked(self, task: str) -> bool:
        try:
            from reliable_beat.celery.task import IdempotentTask
        except ImportError:  # pragma: no cover - task module always ships
            return False
        return isinstance(self.app.tasks.get(task), IdempotentTask)

    def _task_kind(self, task: str) -> bool | None:
        if task not in self.app.tasks:
            return None
        return self._is_tracked(task)

    def setup_schedule(self) -> None:
        ReliableScheduler._in_setup += 1
        try:
            self._setup_schedule()
        finally:
            ReliableScheduler._in_setup -= 1

    def _definitions(self, now: datetime) -> list[EntryDefinition]:
        zone = str(self.app.conf.timezone or "UTC")
        try:
            try:
                validate_timezone(zone)
            except ConfigurationError as exc:
                raise ConfigurationError(f"Celery's timezone setting: {exc}") from None
            self._check_sqlite_directory()
            return definitions_from_beat_schedule(
                self.app.conf.beat_schedule or {},
                default_timezone=zone,
                settings=self.settings,
                now=now,
                is_idempotent=self._task_kind,
            )
        except ConfigurationError as exc:
            # One message naming every bad entry and its fix, then exit 2: a traceback through
            # Celery's stderr redirect is hundreds of lines, and restarting cannot fix config.
            log.critical("reliable_beat: configuration refused; nothing was synced or fired. "
                         "Fix this and start the beat again.\n%s", exc)
            raise SystemExit(2) from None

    def _check_sqlite_directory(self) -> None:
        if self.store.dialect != "sqlite":
            return
        path = make_url(self.settings.database_url).database
        if path and path != ":memory:" and not os.path.isdir(os.path.dirname(path) or "."):
            raise ConfigurationError(
                f"reliable_beat_database_url {self.store.safe_url}: the directory "
                f"{os.path.dirname(path)!r} does not exist; create it or point the URL at an "
                "existing one"
            )

    def _setup_schedule(self) -> None:
        # Configuration first, on the local clock: a bad entry is reported at once, even while
        # the database is down. The definitions are rebuilt on the database clock below.
        self._definitions(datetime.now(timezone.utc))
        delay = 1.0
        while True:
            try:
                migrate.ensure_schema(self.store, run_migrations=self.settings.run_migrations)
                with self.store.begin() as conn:
                    now = self.store.now(conn)
                break
            except (StoreUnavailableError, DBAPIError) as exc:
                log.error("database %s unavailable at start (%s); retrying in %.0f s",
                          self.store.safe_url, exc, delay)
                self._sleep(delay)
                delay = min(delay * 2, 30.0)
            except SchemaError as exc:
                # A deploy may start beats before its migration step: wait for the upgrade
                # rather than exit into a restart loop.
                log.error("%s; waiting for it (checking again in %.0f s)", exc, delay)
                self._sleep(delay)
                delay = min(delay * 2, 30.0)
        definitions = self._definitions(now)
        for d in definitions:
            if d.task not in self.app.tasks:
                log.warning("entry %r: task %r is not registered in this beat's app; workers "
                            "must know it or the trigger is rejected", d.name, d.task)
        if self.settings.metrics_port is not None and self._metrics is None:
            from reliable_beat.metrics import serve

            self._metrics = serve(self.settings.metrics_port, self.store)
            log.info("reliable_beat: metrics on :%d/metrics", self._metrics.port)
        counts = sync_config_entries(self.store, definitions)
        log.info("reliable_beat: synced beat_schedule into %s: %s", self.store.safe_url, counts)

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @property
    def info(self) -> str:
        try:
            if migrate.check(self.store):
                schema = "up to date"
            elif self.store.dialect == "sqlite" or self.settings.run_migrations:
                schema = "behind: upgrading on start"
            else:
                schema = "BEHIND: run `reliable-beat db upgrade`"
        except Exception:
            schema = "unknown (database unavailable)"
        return (
            f"    . store -> {self.store.safe_url}\n"
            f"    . owner -> {self.settings.owner}\n"
            f"    . schema -> {schema} (head {migrate.head()})"
        )

    # -- the loop --------------------------------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One claim transaction, then publish; returns seconds until the next tick.

        SIGTERM / SIGINT are held back (``pthread_sigmask``) from the claim until the
        triggers are marked sent, so a graceful stop never splits a commit from its publish;
        the signal is delivered right after. Only SIGKILL can, and then the sweep (or a relay)
        publishes the committed triggers later, under the same task ids.
        """
        with _deferred_stop_signals():
            wait = self._tick()
        return self._wait_after(wait)

    def _tick(self) -> TickResult | float:
        self._tick_started = time.monotonic()
        try:
            result = self._beat.tick()
        except (StoreUnavailableError, DBAPIError) as exc:
            self._failures += 1
            wait: float = min(30.0, 0.5 * 2.0 ** min(self._failures, 6))
            log.error("tick failed: database %s unavailable (%s); retrying in %.1f s. "
                      "Slots due meanwhile are decided by the misfire policy when it returns.",
                      self.store.safe_url, exc, wait)
            return wait
        self._failures = 0
        if result.triggers:
            self._publish(result)
        try:
            self._sweep()
        except (StoreUnavailableError, DBAPIError) as exc:
            log.error("trigger sweep failed (%s); retrying on a later tick", exc)
        return result

    def _wait_after(self, outcome: TickResult | float) -> float:
        if isinstance(outcome, TickResult):
            return self._wait(outcome)
        return outcome

    def _publish(self, result: TickResult) -> None:
        assert result.now is not None
        publish_triggers(self.store, self.app, result.triggers, result.now)
        for t in result.triggers:
            event(log, logging.INFO, "slot.fired", entry=t.payload["headers"].get(
                "reliable_beat_entry"), fire_at=t.payload["headers"].get("reliable_beat_fire_at"),
                key=t.key, task=t.payload["task"],
                claim_lateness_ms=round((result.now - t.fire_at).total_seconds() * 1000, 1))
        if result.skipped:
            event(log, logging.INFO, "slots.skipped", count=result.skipped)
        if result.duplicates:
            event(log, logging.INFO, "slots.already_fired", count=result.duplicates)

    def _sweep(self) -> None:
        """Publish trigger rows whose fast path never happened (a beat died between commit
        and publish, or the broker was down). A relay does the same; the beat does it too so
        plain-task users without a relay lose nothing. At most every ``SWEEP_SECONDS``."""
        now_mono = time.monotonic()
        if now_mono - self._last_sweep < SWEEP_SECONDS:
            return
        self._last_sweep = now_mono
        with self.store.begin() as conn:
            now = self.store.now(conn)
            messages = claim_outbox_batch(
                self.store, conn, owner=self.settings.owner, now=now,
                lease=timedelta(seconds=60), limit=self.settings.batch_size,
                destinations=[TRIGGER_DESTINATION],
            )
        if messages:
            log.warning("sweeping %d unsent triggers", len(messages))
            publish_messages(self.store, self.app, messages, now)
        redispatch_stuck_runs(self.store, self.app, self.settings)

    def _wait(self, result: TickResult) -> float:
        assert result.now is not None
        if result.claimed >= self.settings.batch_size:
            return 0.0  # more due entries are waiting
        # Wake at least every SWEEP_SECONDS so the sweep of unsent triggers and the
        # re-dispatch of lost ones run even when no entry is due for a long time.
        bound = min(float(self.max_interval), SWEEP_SECONDS)
        if self.store.dialect != "postgresql":
            bound = min(bound, SQLITE_MAX_WAIT_SECONDS)
        if result.next_fire_at is None:
            wait = bound
        else:
            # result.now was read at the start of the tick: take off the time the tick, the
            # publish and the sweep took since, or every slot fires that much late.
            elapsed = time.monotonic() - self._tick_started
            wait = (result.next_fire_at - result.now).total_seconds() - elapsed
            wait = max(0.0, min(bound, wait))
        if wait <= 0.0005:
            return 0.0
        if self.store.dialect == "postgresql" and self._wait_for_notify(wait):
            return 0.0
        return wait if self.store.dialect != "postgresql" else 0.0

    def _wait_for_notify(self, timeout: float) -> bool:
        """Block up to ``timeout`` s on ``LISTEN reliable_beat_entries``. True: it waited
        (woken by a NOTIFY or the timeout); False: no LISTEN connection (caller sleeps)."""
        import psycopg

        try:
            if self._listen is None or self._listen.closed:
                url = make_url(self.store.url).set(drivername="postgresql")
                self._listen = psycopg.connect(
                    url.render_as_string(hide_password=False), autocommit=True,
                    connect_timeout=5,
                )
                self._listen.execute(f"LISTEN {NOTIFY_CHANNEL}")
            conn = self._listen
            ready, _, _ = _select.select([conn.fileno()], [], [], timeout)
            if ready:
                for _ in conn.notifies(timeout=0):
                    pass
            return True
        except Exception as exc:
            log.debug("LISTEN unavailable (%s); sleeping instead", exc)
            with contextlib.suppress(Exception):
                if self._listen is not None:
                    self._listen.close()
            self._listen = None
            self._sleep(min(timeout, 1.0))
            return True

    # -- Celery hooks we neutralise: the database is the state ------------------------------
    def sync(self) -> None:
        """Nothing to write back: every decision was committed when it was made."""

    def close(self) -> None:
        if self._listen is not None:
            with contextlib.suppress(Exception):
                self._listen.close()
        self.store.dispose()

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
