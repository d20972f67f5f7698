"""The beat process around its loop: start, stop signals, the LISTEN wait, the exit.

* :class:`BeatProcess`, the base class of :class:`~reliable_beat.loop.BeatLoop`: its start
  (check the configuration, wait for the database and its schema, sync, record the beat;
  :meth:`~BeatProcess.start`), its wait on ``LISTEN reliable_beat_entries`` and the stop
  request that ends that wait at once;
* :func:`deferred_stop_signals`: SIGTERM / SIGINT held back from a claim until its triggers
  are marked or held;
* :func:`skip_exit_gc`: a beat process's exit skips the interpreter's final collection.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import select as _select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from types import FrameType
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store, is_lock_wait
from reliable_beat.entries import NOTIFY_CHANNEL, EntryDefinition, is_task_elsewhere
from reliable_beat.errors import ConfigurationError, SchemaError, StoreUnavailableError
from reliable_beat.metrics import serve
from reliable_beat.redaction import redact_text
from reliable_beat.retention import RetentionThread, start_retention
from reliable_beat.settings import Settings

__all__ = [
    "STOP_SIGNALS",
    "BeatProcess",
    "deferred_stop_signals",
    "skip_exit_gc",
]

#: The signals a graceful stop arrives by; :func:`deferred_stop_signals` holds them back.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def deferred_stop_signals() -> Iterator[list[tuple[int, FrameType | None]]]:
    """Hold SIGTERM / SIGINT back while the block runs; deliver them right after it.

    In the main thread (the only one that runs Python signal handlers) the handlers of
    :data:`STOP_SIGNALS` are swapped for one that only records the signal; on the way out
    the previous handlers are put back and each recorded signal is handed to its previous
    handler, in arrival order (a callable is called with ``(signum, frame)`` and may raise,
    e.g. Celery's beat handler raises ``SystemExit``; ``SIG_DFL`` re-sends the signal to this
    process; ``SIG_IGN`` drops it). Nests: an inner block hands its signals to the outer one.
    A no-op outside the main thread, and for a signal whose handler was not installed from
    Python (it cannot be put back).

    Yields:
        the ``(signum, frame)`` pairs held back so far (a list that grows while the block
        runs): non-empty means a stop is pending, e.g. the loop claims nothing more.

    A Python-level deferral, not ``pthread_sigmask``: a mask is per thread, and a beat
    process has other threads (the retention thread, Celery's beat pidbox, the metrics
    server). The kernel delivers a process-directed SIGTERM to a thread that does not block
    it, and CPython then runs the handler in the main thread at its next bytecode, mask or
    no mask: in the middle of a claim or of a held slot's publish.
    """
    caught: list[tuple[int, FrameType | None]] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def record(signum: int, frame: FrameType | None) -> None:
        caught.append((signum, frame))

    previous: dict[int, Any] = {}
    try:
        for sig in STOP_SIGNALS:
            handler = signal.getsignal(sig)
            if handler is None:  # installed outside Python: leave it alone
                continue
            signal.signal(sig, record)
            previous[sig] = handler
        yield caught
    finally:
        for stop_sig, handler in previous.items():
            signal.signal(stop_sig, handler)
        for signum, frame in caught:
            handler = previous.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


_exit_gc_skipped = False


def skip_exit_gc() -> None:
    """Make this process's interpreter exit skip its final garbage collection (once per
    process; idempotent).

    Registers :func:`gc.freeze` with :mod:`atexit`: at exit, after the other exit handlers
    were registered and ran their course (logging is flushed, atexit handlers still run), the
    objects alive are moved to the permanent generation, which the interpreter's final
    collections do not walk. Measured on a beat process (reliable_beat, SQLAlchemy, Alembic,
    psycopg and the broker client imported): that final collection was 90 % of a graceful
    stop (2.7-3.5 s of 2.6-3.4 s after SIGTERM on a loaded 2-core host; 0.16-0.31 s with the
    heap frozen), while :meth:`BeatLoop.close` itself takes 25-60 ms. Nothing is lost: the
    operating system reclaims the memory, connections are closed by ``close()`` before, and
    Python never promised ``__del__`` for objects alive at exit. No effect while the
    process runs.
    """
    global _exit_gc_skipped
    if not _exit_gc_skipped:
        atexit.register(gc.freeze)
        _exit_gc_skipped = True


class BeatProcess:
    """The process side of :class:`~reliable_beat.loop.BeatLoop` (its base class): start,
    the LISTEN wait and the stop request that ends it.

    The attributes are the loop's, set by ``BeatLoop.__init__`` (declared here for the type
    checker); :meth:`_sync` is the loop's.
    """

    store: Store
    settings: Settings
    definitions: Callable[[datetime], list[EntryDefinition]] | None
    is_registered: Callable[[str], bool] | None
    log: logging.Logger
    stop_event: threading.Event | None
    _closed: bool
    _metrics: Any
    _retention: RetentionThread | None
    _listen: Any
    _wake_r: int | None
    _wake_w: int | None

    # -- start -----------------------------------------------------------------------------
    def check_definitions(self, now: datetime) -> list[EntryDefinition]:
        """The adapter's definitions at ``now``; a bad configuration is logged at CRITICAL
        (every bad entry named, with its fix) and the process exits with code 2: restarting
        cannot fix configuration, and a traceback would bury the message."""
        try:
            self._check_sqlite_directory()
            return self.definitions(now) if self.definitions is not None else []
        except ConfigurationError as exc:
            self.log.critical("reliable_beat: configuration refused; nothing was synced or "
                              "fired. Fix this and start the beat again.\n%s", exc)
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

    def start(self, *, before_wait: Callable[[], None] | None = None) -> bool:
        """Check the configuration, wait for the database and its schema, sync, record.

        Configuration first, on the local clock: a bad entry is reported at once (exit 2),
        even while the database is down. Then, until the store answers at the schema's
        head, it logs at ERROR why it waits (``database unavailable at start: ...``, or the
        schema error naming ``reliable-beat db upgrade``) and retries with backoff 1, 2, 4 ...
        30 s. An embedded SQLite store is created; a server store that is behind is upgraded
        only with ``reliable_beat_run_migrations``. Then the definitions are rebuilt on the
        database clock and synced into :attr:`schedule_group`, and the beat is recorded.

        Args:
            before_wait: called after the configuration check, before the database is
                first touched (adapter warnings, e.g. broker timeouts).

        Returns:
            True once started; False when :attr:`stop_event` was set while waiting.
        """
        self._closed = False  # a loop closed and started again closes again
        skip_exit_gc()  # a beat process's exit: no final GC walk (see the function)
        self.check_definitions(datetime.now(timezone.utc))
        if before_wait is not None:
            before_wait()
        warning = self.settings.default_store_warning("beat")
        if warning:
            self.log.warning("%s", warning)
        delay = 1.0
        while True:
            if self.stop_event is not None and self.stop_event.is_set():
                return False
            try:
                migrate.ensure_schema(self.store, run_migrations=self.settings.run_migrations)
                with self.store.begin() as conn:
                    now = self.store.now(conn)
                definitions = (self.check_definitions(now) if self.definitions is not None
                               else None)
                unregistered = self._unregistered(definitions or [])
                if definitions is not None:
                    # inside the retry: a database lost between the wait and the sync (a
                    # restart at that moment) is waited for again, never an exit
                    self._sync(definitions, unregistered)
                break
            except (StoreUnavailableError, DBAPIError) as exc:
                why = self.store.describe_failure(exc)
                if is_lock_wait(exc):
                    # Not a failure: another beat (or `schedule sync`) is syncing a schedule
                    # group and holds the sync lock or the entries' rows; a large
                    # beat_schedule takes a while. Wait for it, saying so.
                    self.log.warning("waiting at start: another beat or `reliable-beat "
                                     "schedule sync` holds the schedule's rows (a sync in "
                                     "progress): %s; retrying in %.0f s", why, delay)
                else:
                    self.log.error("database %s at start: %s; retrying in %.0f s",
                                   "unavailable" if " unavailable" in why else "error", why,
                                   delay)
                self._sleep(delay)
                delay = min(delay * 2, 30.0)
            except SchemaError as exc:
                # A deploy may start beats before its migration step: wait for the upgrade
                # rather than exit into a restart loop.
                self.log.error("%s; waiting for it (checking again in %.0f s)", exc, delay)
                self._sleep(delay)
                delay = min(delay * 2, 30.0)
        if self.settings.metrics_port is not None and self._metrics is None:
            self._metrics = serve(
                self.settings.metrics_port, self.store, addr=self.settings.metrics_host,
                pending_alarm_seconds=self.settings.workflow_pending_alarm_seconds)
            self.log.info("reliable_beat: metrics on :%d/metrics", self._metrics.port)
        if self._retention is None:  # bounded-batch purge of old history, in the background
            self._retention = start_retention(self.store, self.settings, role="beat")
        return True

    def _unregistered(self, definitions: list[EntryDefinition]) -> dict[str, str]:
        """Entry name -> task of the definitions whose task this app does not know and that
        do not say ``task_elsewhere`` (the sync parks them: :func:`park_reason`)."""
        registered = self.is_registered or (lambda _task: True)
        return {d.name: d.task for d in definitions
                if not registered(d.task) and not is_task_elsewhere(d)}

    def _sleep(self, seconds: float) -> None:
        if self.stop_event is not None:
            self.stop_event.wait(seconds)
        else:
            time.sleep(seconds)

    def schema_status(self) -> str:
        """One line for a start banner: the schema's state against the code's head."""
        try:
            if migrate.check(self.store):
                return "up to date"
            if self.store.dialect == "sqlite" or self.settings.run_migrations:
                return "behind: upgrading on start"
            return "BEHIND: run `reliable-beat db upgrade`"
        except Exception:
            return "unknown (database unavailable)"

    def _wait_for_notify(self, timeout: float) -> bool:
        """Block up to ``timeout`` s on ``LISTEN reliable_beat_entries`` (or sleep when that
        connection cannot be had). True: woken by a NOTIFY. On psycopg 3, else psycopg2 (a
        psycopg2-only install, e.g. a Django project on psycopg2, has no ``psycopg``)."""
        try:
            if self._listen is None or self._listen.closed:
                url = make_url(self.store.url).set(drivername="postgresql")
                dsn = url.render_as_string(hide_password=False)
                try:
                    import psycopg
                except ImportError:
                    import psycopg2  # type: ignore[import-untyped]

                    self._listen = psycopg2.connect(dsn, connect_timeout=5)
                    self._listen.autocommit = True
                    with self._listen.cursor() as cur:
                        cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
                else:
                    self._listen = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
                    self._listen.execute(f"LISTEN {NOTIFY_CHANNEL}")
            conn = self._listen
            if self._wake_r is None:
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
            if self.stop_event is not None and self.stop_event.is_set():
                return False  # a stop was asked: no wait (request_stop wakes one in progress)
            ready, _, _ = _select.select([conn.fileno(), self._wake_r], [], [], timeout)
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 512)
                ready = [r for r in ready if r != self._wake_r]
            notified = False
            if ready:
                if hasattr(conn, "poll"):  # psycopg2
                    conn.poll()
                    notified = bool(conn.notifies)
                    conn.notifies.clear()
                else:
                    for _ in conn.notifies(timeout=0):
                        notified = True
            return notified
        except Exception as exc:
            self.log.debug("LISTEN unavailable (%s); sleeping instead", redact_text(exc))
            with contextlib.suppress(Exception):
                if self._listen is not None:
                    self._listen.close()
            self._listen = None
            self._sleep(min(timeout, 1.0))
            return False

    def request_stop(self) -> None:
        """Ask :meth:`run_forever` to stop: set :attr:`stop_event` and end a wait on the
        LISTEN connection at once (a ``select`` on the database socket does not see an
        ``Event``: without this a stop waited up to ``max_interval`` there). Safe to call from
        a signal handler. Held triggers still go out at their slots (:meth:`close`)."""
        if self.stop_event is None:
            self.stop_event = threading.Event()
        self.stop_event.set()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")


    def _sync(self, definitions: list[EntryDefinition], unregistered: dict[str, str]) -> None:
        """Sync ``definitions`` into the schedule group and record the beat (the loop's)."""
        raise NotImplementedError
