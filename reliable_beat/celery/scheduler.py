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
import select as _select
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from celery.beat import Scheduler
from reliable_beat.beat import (
    Beat,
    TickResult,
    Trigger,
    mark_triggers_sent,
    sweep_unsent_triggers,
)
from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store
from reliable_beat.entries import (
    NOTIFY_CHANNEL,
    definitions_from_beat_schedule,
    sync_config_entries,
)
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.settings import Settings

__all__ = ["ReliableScheduler", "publish_triggers"]

log = logging.getLogger("reliable_beat.scheduler")

#: Publish retry policy of the fast path: fail fast, the outbox keeps what was not sent.
FAST_PATH_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}
#: Default wait bound on SQLite, which has no NOTIFY: entries added at runtime are seen
#: within this many seconds.
SQLITE_MAX_WAIT_SECONDS = 1.0
#: How often a beat looks for triggers a crashed beat committed but never published.
SWEEP_EVERY_SECONDS = 5.0


def publish_triggers(
    app: Any, triggers: list[Trigger], now: datetime
) -> tuple[list[Trigger], list[Trigger]]:
    """Publish trigger messages over one producer connection.

    A trigger whose ``expires_at`` has passed is not published (it counts as sent; the
    worker would discard it anyway).

    Returns:
        ``(sent, failed)``: failed ones stay pending in the outbox for the relay.
    """
    sent: list[Trigger] = []
    failed: list[Trigger] = []
    if not triggers:
        return sent, failed
    try:
        with app.producer_or_acquire() as producer:
            for t in triggers:
                p = t.payload
                expires = (
                    datetime.fromisoformat(p["expires_at"].replace("Z", "+00:00"))
                    if p.get("expires_at")
                    else None
                )
                if expires is not None and expires <= now:
                    log.warning("trigger %s expired before publish (expires_at %s)", t.key,
                                p["expires_at"])
                    sent.append(t)
                    continue
                try:
                    app.send_task(
                        p["task"], args=p["args"], kwargs=p["kwargs"], task_id=p["task_id"],
                        headers=p["headers"], producer=producer, expires=expires,
                        retry=True, retry_policy=FAST_PATH_RETRY, **p["options"],
                    )
                    sent.append(t)
                except Exception as exc:
                    log.warning("trigger %s not published (%s); the relay will retry", t.key, exc)
                    failed.append(t)
    except Exception as exc:  # no broker connection at all
        log.warning("broker unavailable (%s): %d triggers stay in the outbox", exc,
                    len(triggers) - len(sent))
        failed.extend(t for t in triggers if t not in sent)
    return sent, failed


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

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.settings = Settings.from_celery(app)
        self.store: Store = Store.from_url(self.settings.database_url, role="beat")
        self._listen: Any = None
        self._failures = 0
        self._next_sweep = 0.0
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
        definitions = definitions_from_beat_schedule(
            self.app.conf.beat_schedule or {},
            default_timezone=str(self.app.conf.timezone or "UTC"),
            settings=self.settings,
            now=now,
            is_idempotent=self._task_kind,
        )
        for d in definitions:
            if d.task not in self.app.tasks:
                log.warning("entry %r: task %r is not registered in this beat's app; workers "
                            "must know it or the trigger is rejected", d.name, d.task)
        counts = sync_config_entries(self.store, definitions)
        log.info("reliable_beat: synced beat_schedule into %s: %s", self.store.safe_url, counts)

    def _sleep(self, seconds: float) -> None:
        import time

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
        """One claim transaction, then publish; returns seconds until the next tick."""
        try:
            result = self._beat.tick()
        except (StoreUnavailableError, DBAPIError) as exc:
            self._failures += 1
            wait = min(30.0, 0.5 * 2 ** min(self._failures, 6))
            log.error("tick failed: database %s unavailable (%s); retrying in %.1f s. "
                      "Slots due meanwhile are decided by the misfire policy when it returns.",
                      self.store.safe_url, exc, wait)
            return wait
        self._failures = 0
        if result.triggers:
            self._publish(result)
        self._sweep(result)
        return self._wait(result)

    def _sweep(self, result: TickResult) -> None:
        """Publish triggers a crashed beat left unsent (until the outbox relay exists)."""
        import time

        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + SWEEP_EVERY_SECONDS
        try:
            stale = sweep_unsent_triggers(self.store, self.settings.owner,
                                          sweep_delay=self._beat.sweep_delay)
        except (StoreUnavailableError, DBAPIError) as exc:
            log.error("sweep of unsent triggers failed (%s)", exc)
            return
        if stale:
            log.warning("publishing %d triggers another beat committed but did not send",
                        len(stale))
            self._publish(TickResult(triggers=stale, now=result.now))

    def _publish(self, result: TickResult) -> None:
        assert result.now is not None
        sent, failed = publish_triggers(self.app, result.triggers, result.now)
        try:
            mark_triggers_sent(self.store, sent, failed)
        except (StoreUnavailableError, DBAPIError) as exc:
            # Published but not marked: the relay re-sends them later (at least once).
            log.error("could not mark %d triggers sent (%s)", len(sent), exc)
        for t in sent:
            log.debug("fired %s (fire_at %s)", t.key, t.fire_at.isoformat())

    def _wait(self, result: TickResult) -> float:
        assert result.now is not None
        if result.claimed >= self.settings.batch_size:
            return 0.0  # more due entries are waiting
        bound = float(self.max_interval)
        if self.store.dialect != "postgresql":
            bound = min(bound, SQLITE_MAX_WAIT_SECONDS)
        if result.next_fire_at is None:
            wait = bound
        else:
            wait = (result.next_fire_at - result.now).total_seconds()
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
