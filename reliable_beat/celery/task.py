"""``IdempotentTask``: the worker side of effectively-once (design.md invariants 1, 5, 6, 8).

::

    @app.task(base=IdempotentTask, bind=True)
    def pay_merchants(self, period):
        with self.transaction() as tx:              # one transaction on the store's database
            tx.execute(insert(payouts).values(period=period, run_id=self.run_id))
            self.outbox.add(tx, "email", {"period": period})
        # leaving the block committed: effect + outbox rows + run 'succeeded' (fenced)

Each execution: derive the key -> claim the run (short transaction: lease + fence) -> run
the body while the process's lease renewer (one thread per process, serving every
execution in flight) renews the lease every ``lease/3`` -> commit the
completion fenced in the body's transaction (or, when the body never opened one, in a
transaction of our own right after it) -> classify failures (retry with full jitter, or
dead letter). See ``docs/task.md``.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.errors import (
    ConfigurationError,
    IdempotencyKeyError,
    LeaseHeldError,
    PermanentError,
    StaleFenceToken,
)
from reliable_beat.policies import backoff_delay
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings

__all__ = [
    "ENTRY_HEADER",
    "FIRE_AT_HEADER",
    "KEY_HEADER",
    "TRIGGER_HEADER",
    "IdempotentTask",
]

log = get_logger(__name__)

KEY_HEADER = "reliable_beat_key"
#: The form of a scheduled slot's key (:func:`reliable_beat.slots.idempotency_key`).
_SLOT_KEY = re.compile(r"@\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")
ENTRY_HEADER = "reliable_beat_entry"
FIRE_AT_HEADER = "reliable_beat_fire_at"
TRIGGER_HEADER = "reliable_beat_trigger"
_HEADERS = (KEY_HEADER, ENTRY_HEADER, FIRE_AT_HEADER, TRIGGER_HEADER)


def _transient_defaults() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [
        ConnectionError,  # includes StoreUnavailableError
        TimeoutError,
        OSError,
        OperationalError,
        DBAPIError,
    ]
    try:
        from kombu.exceptions import OperationalError as KombuOperationalError

        found.append(KombuOperationalError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import redis.exceptions

        found += [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


# ------------------------------------------------------------ per-process stores ----

_stores: dict[str, Store] = {}
_stores_pid = os.getpid()
_stores_lock = threading.Lock()


def _forget_stores_after_fork() -> None:
    """In a forked child: drop the parent's pooled connections without closing them."""
    global _stores_pid
    for store in _stores.values():
        store.engine.dispose(close=False)
    _stores.clear()
    _stores_pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_stores_after_fork)


def _store_for(url: str) -> Store:
    """The process's :class:`Store` for ``url`` (role ``worker``), created on first use.

    Survives prefork: the fork hook, and a pid check as a second line, give each child
    process its own engine (SQLAlchemy engines must not be shared across ``fork``).
    """
    with _stores_lock:
        if _stores_pid != os.getpid():
            _forget_stores_after_fork()
        store = _stores.get(url)
        if store is None:
            store = _stores[url] = Store.from_url(url, role="worker")
        return store


# ------------------------------------------------------------ per-execution state ----

#: ``_current.states``: id(task) -> the _RunState of the execution running in this thread.
_current = threading.local()


@dataclass(eq=False)  # hashed by identity: a member of the renewer's set
class _RunState:
    claim: runs.Claim
    store: Store
    lease: timedelta
    task_name: str = ""
    lease_lost: bool = False
    completed: bool = False
    transaction_used: bool = False
    outbox_count: int = 0
    #: time.monotonic() of the next lease renewal (set by _LeaseRenewer.add).
    renew_at: float = 0.0


def _renew_interval(state: _RunState) -> float:
    """Seconds between renewals of ``state``'s lease: a third of the lease (>= 0.05 s)."""
    return max(state.lease.total_seconds() / 3.0, 0.05)


class _LeaseRenewer:
    """One daemon thread per process renewing the lease of every execution in flight.

    An execution is added when its body starts and discarded when its completion begins or
    the body ends; both are a set operation under a lock. The thread sleeps until the
    earliest ``renew_at`` and renews each due lease (:func:`runs.renew_lease`, one short
    fenced transaction each, oldest due first), then schedules the next one a third of the
    lease later. Adding an execution wakes the thread only when it would otherwise sleep
    past that execution's first renewal (an idle renewer, or a shorter lease), so a busy
    worker pays no thread start and no context switch per task. A renewal that finds the
    fence moved sets the execution's ``lease_lost`` and drops it; one that fails (store
    unreachable) is tried again an interval later, as the lease is not lost yet.

    Threads do not survive ``fork``: a prefork child gets a fresh renewer on first use.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._states: set[_RunState] = set()
        #: When the thread will next look (monotonic); None while it waits for work.
        self._wake_at: float | None = None
        self._thread: threading.Thread | None = None

    def add(self, state: _RunState) -> None:
        """Start renewing ``state``'s lease, first after one interval."""
        state.renew_at = time.monotonic() + _renew_interval(state)
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="rb-lease-renewer", daemon=True
                )
                self._thread.start()
            self._states.add(state)
            if self._wake_at is None or state.renew_at < self._wake_at:
                self._cond.notify()

    def discard(self, state: _RunState) -> None:
        """Stop renewing ``state``'s lease (no-op when it is not renewed)."""
        with self._cond:
            self._states.discard(state)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    due = sorted(
                        (s for s in self._states if s.renew_at <= now),
                        key=lambda s: s.renew_at,
                    )
                    if due:
                        self._wake_at = now  # awake: add() need not notify
                        break
                    self._wake_at = min((s.renew_at for s in self._states), default=None)
                    self._cond.wait(None if self._wake_at is None else self._wake_at - now)
            for state in due:
                self._renew(state)

    def _renew(self, state: _RunState) -> None:
        try:
            ok = runs.renew_lease(state.store, state.claim, state.lease)
        except Exception:  # store briefly unreachable: the lease is not lost yet
            log.warning("%s: lease renewal failed", state.task_name, exc_info=True)
            ok = True
        with self._cond:
            if state not in self._states:
                return  # completion began or the body ended meanwhile
            if ok:
                state.renew_at = time.monotonic() + _renew_interval(state)
                return
            self._states.discard(state)
        if not state.completed:
            state.lease_lost = True
            log.warning(
                "%s: lease on %s lost (fence %d moved)",
                state.task_name, state.claim.key, state.claim.fence_token,
            )


_renewer = _LeaseRenewer()


def _new_renewer_after_fork() -> None:
    """In a forked child: the parent's renewer thread does not exist here; start afresh."""
    global _renewer
    _renewer = _LeaseRenewer()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_renewer_after_fork)


class _Outbox:
    """``self.outbox``: adds outbox rows stamped with the run, keyed by the run's key."""

    def __init__(self, task: IdempotentTask) -> None:
        self._task = task

    def add(
        self,
        tx: Connection,
        destination: str,
        payload: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, Any] | None = None,
        delay: timedelta | float | None = None,
        ordering_key: str | None = None,
    ) -> str:
        """Add an outbox row in ``tx`` (the body's transaction): :func:`reliable_beat.outbox.add`.

        ``key`` defaults to ``f"{idempotency_key}#{n}"``, ``n`` = 1, 2, ... counting the adds
        of this attempt, so a retried attempt that adds "the same" messages in the same
        order produces the same message ids, and the far end can deduplicate.

        Returns:
            The outbox message id.
        """
        # reliable_beat.outbox is imported when used (it is optional for tasks without it).
        outbox = importlib.import_module("reliable_beat.outbox")
        state = self._task._state()
        state.outbox_count += 1
        message_key = key or f"{state.claim.key}#{state.outbox_count}"
        add: Callable[..., str] = outbox.add
        return add(
            tx,
            destination,
            payload,
            key=message_key,
            headers=headers,
            delay=timedelta(seconds=delay) if isinstance(delay, (int, float)) else delay,
            ordering_key=ordering_key,
            run_id=state.claim.run_id,
        )


def _header(request: Any, name: str) -> Any:
    """A custom message header, wherever this Celery version put it.

    Celery 5.3+ copies custom headers both onto ``request.headers`` (a dict of the
    non-Celery keys) and, through the request dict, as attributes (``request.<name>``);
    eager ``apply(headers=...)`` sets ``request.headers`` only. Both are read.
    """
    headers = getattr(request, "headers", None)
    if isinstance(headers, Mapping) and headers.get(name) is not None:
        return headers[name]
    return getattr(request, name, None)


def _parse_fire_at(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, datetime):
        parsed = value
    else:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise ValueError(f"{FIRE_AT_HEADER}={value!r} has no time zone")
    return parsed.astimezone(timezone.utc)


class IdempotentTask(Task):  # type: ignore[misc]
    """Base class for tasks whose effect must happen once per key.

    Use ``@app.task(base=IdempotentTask, bind=True)``. See the module docstring and
    ``docs/task.md``.

    Key, in order: the ``reliable_beat_key`` message header (put there by the scheduler,
    by :meth:`delay_with_key`, or ``apply_async(..., headers={"reliable_beat_key": k})``),
    else :meth:`idempotency_key_for` of the arguments. Neither -> :class:`IdempotencyKeyError`
    at the call site (``apply_async``) and, for messages sent by name, in the worker, where
    the message is refused (logged, task FAILURE, nothing run, no retry).

    Failure classification, first match wins:

    1. :class:`PermanentError` -> dead letter at once.
    2. :attr:`permanent_exceptions` (default ``ValueError``, ``TypeError``: validation
       errors and wrong arguments, which a retry cannot fix) -> dead letter at once.
    3. :attr:`transient_exceptions` (default connection errors, timeouts, ``OSError``,
       SQLAlchemy ``OperationalError``/``DBAPIError``, kombu and redis connection errors)
       -> retry through Celery's ``self.retry`` with ``countdown = uniform(0, min(cap,
       base * 2**k))``, ``k`` = 0 for the first retry; after :attr:`max_attempts` tries in
       all -> dead letter.
    4. Anything else: treated as transient when :attr:`retry_unknown_exceptions` is True
       (the default: an unlisted transient error would otherwise be lost, and
       ``max_attempts`` bounds the cost of retrying a bug), else permanent.

    Attributes:
        acks_late / reject_on_worker_lost: True, so a message whose worker died is
            redelivered (see ``docs/task.md`` on the Redis ``visibility_timeout``).
        max_retries: None: Celery's own counter does not limit retries; :attr:`max_attempts`
            (counted in the database, crashes included) does.
        lease_seconds / max_attempts / retry_base_seconds / retry_cap_seconds: None means
            the ``reliable_beat_*`` setting.
    """

    acks_late = True
    reject_on_worker_lost = True
    max_retries = None
    permanent_exceptions: ClassVar[tuple[type[BaseException], ...]] = (ValueError, TypeError)
    transient_exceptions: ClassVar[tuple[type[BaseException], ...]] = _transient_defaults()
    retry_unknown_exceptions: ClassVar[bool] = True
    lease_seconds: ClassVar[float | None] = None
    max_attempts: ClassVar[int | None] = None
    retry_base_seconds: ClassVar[float | None] = None
    retry_cap_seconds: ClassVar[float | None] = None

    _rb_settings: Settings | None = None

    # ------------------------------------------------------------------ keys ----

    def idempotency_key_for(self, *args: Any, **kwargs: Any) -> str | None:
        """The key of an ad-hoc call, derived from the work. Override it.

        Derive it from what the work *is* (entity, period, operation), never from the task
        id, the attempt or the clock, e.g. ``f"invoice:{customer_id}:{month}:send"``.

        Returns:
            The key, or None (the default) when it cannot be derived; then the call must
            carry a ``reliable_beat_key`` header, or it is refused.
        """
        return None

    def apply_async(
        self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any
    ) -> Any:
        """Celery's ``apply_async``, refusing calls that have no derivable key.

        The derived key is put into the ``reliable_beat_key`` header, so the worker uses
        exactly the key the caller saw.

        Raises:
            IdempotencyKeyError: no ``reliable_beat_key`` header and
                :meth:`idempotency_key_for` returned None; or an ad-hoc key with the form
                of a scheduled slot's key (``"<entry>@<UTC instant>Z"``), which is reserved.
        """
        headers = dict(options.get("headers") or {})
        if not headers.get(KEY_HEADER):
            key = self.idempotency_key_for(*(args or ()), **(kwargs or {}))
            if not key:
                raise IdempotencyKeyError(
                    f"{self.name}: no idempotency key for args={args!r} kwargs={kwargs!r}; "
                    "use delay_with_key(key, ...), pass headers={'reliable_beat_key': key}, "
                    "or override idempotency_key_for()"
                )
            headers[KEY_HEADER] = key
            options["headers"] = headers
        key = str(headers[KEY_HEADER])
        if _SLOT_KEY.search(key) and not headers.get(ENTRY_HEADER):
            raise IdempotencyKeyError(
                f"{self.name}: key {key!r} has the form of a scheduled slot's key "
                "('<entry>@<UTC instant>Z'), which is reserved: an ad-hoc run under it would "
                "take that slot's place. Use another form (e.g. 'manual:...'), or "
                "`reliable-beat entries trigger` / `backfill` to run an entry's slot"
            )
        return super().apply_async(args, kwargs, *a, **options)

    def delay_with_key(self, key: str, *args: Any, **kwargs: Any) -> Any:
        """``delay(*args, **kwargs)`` under the explicit idempotency ``key``."""
        return self.apply_async(args, kwargs, headers={KEY_HEADER: key})

    def _resolve_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        key = _header(self.request, KEY_HEADER)
        if not key:
            key = self.idempotency_key_for(*args, **kwargs)
        if not key:
            raise IdempotencyKeyError(
                f"{self.name}[{self.request.id}]: no idempotency key (no {KEY_HEADER!r} "
                "header and idempotency_key_for() returned None); refusing to run"
            )
        return str(key)

    # ------------------------------------------------------ settings and store ----

    @property
    def reliable_beat_settings(self) -> Settings:
        """The ``reliable_beat_*`` settings of this task's app (read once per process)."""
        if self._rb_settings is None:
            self._rb_settings = Settings.from_celery(self.app)
        return self._rb_settings

    @property
    def store(self) -> Store:
        """This process's store (role ``worker``), created lazily; safe across prefork."""
        return _store_for(self.reliable_beat_settings.database_url)

    def _lease(self) -> timedelta:
        seconds = self.lease_seconds or self.reliable_beat_settings.lease_seconds
        return timedelta(seconds=seconds)

    def _max_attempts(self) -> int:
        return self.max_attempts or self.reliable_beat_settings.retry_max_attempts

    # ------------------------------------------------------- run-time accessors ----

    def _state(self) -> _RunState:
        # Kept per thread, not on self.request: Celery < 5.7 pushes a fresh request context
        # (without our attributes) when Task.__call__ runs outside a worker (eager apply).
        state = getattr(_current, "states", {}).get(id(self))
        if not isinstance(state, _RunState):
            raise RuntimeError(
                f"{self.name}: not inside an IdempotentTask execution (no claimed run)"
            )
        return state

    @property
    def fence_token(self) -> int:
        """This runner's fence token; stamp it on writes to other stores to fence them."""
        return self._state().claim.fence_token

    @property
    def idempotency_key(self) -> str:
        """The run's idempotency key."""
        return self._state().claim.key

    @property
    def run_id(self) -> int:
        """``reliable_beat_runs.id``; stamp it on every row the body writes."""
        return self._state().claim.run_id

    @property
    def attempt(self) -> int:
        """This try's number (1 = first), counted in the database, crashes included."""
        return self._state().claim.attempt

    @property
    def lease_lost(self) -> bool:
        """True once a renewal found the fence moved: the commit will be rejected."""
        return self._state().lease_lost

    @property
    def outbox(self) -> _Outbox:
        """``self.outbox.add(tx, destination, payload, ...)``: see :class:`_Outbox`."""
        return _Outbox(self)

    # ------------------------------------------------------------ transaction ----

    @contextmanager
    def transaction(
        self, *, bind: Engine | Connection | None = None, session: Any = None
    ) -> Iterator[Connection]:
        """One transaction for the body's effect; leaving the block completes the run.

        Yields a SQLAlchemy ``Connection`` inside a transaction. On normal exit, the run is
        marked ``succeeded`` (fenced: ``WHERE fence_token = mine``) in this same
        transaction, which then commits: effect, outbox rows, key and state commit
        together or not at all. On an exception, everything rolls back. Use it once per
        execution.

        Args:
            bind: your own ``Engine`` (a connection + transaction is opened on it) or
                ``Connection`` (joined if already in a transaction, which you then commit
                before the body returns; else a transaction is begun and committed here).
                Must point at the store's database.
            session: your own SQLAlchemy ``Session`` on the store's database: its
                connection is yielded, the ORM can be used alongside, and the session is
                flushed and committed at the end of the block (rolled back on error).

        Raises:
            StaleFenceToken: the fence moved (another runner claimed the run after this
                one): everything written in the block was rolled back; the attempt is
                recorded ``fenced_out``.
            ConfigurationError: ``bind``/``session`` point at another database.
            RuntimeError: called outside an execution, or twice in one execution.
        """
        state = self._state()
        if state.transaction_used:
            raise RuntimeError(f"{self.name}: self.transaction() may be used once per run")
        state.transaction_used = True
        if session is not None:
            conn = session.connection()
            self._check_same_database(conn.engine, state.store)
            try:
                yield conn
                session.flush()
                _renewer.discard(state)  # see below
                runs.complete(conn, state.claim, None)
                session.commit()
            except BaseException as exc:
                session.rollback()
                self._after_rollback(state, exc)
                raise
            state.completed = True
            return
        if isinstance(bind, Connection):
            self._check_same_database(bind.engine, state.store)
            if bind.in_transaction():
                yield bind
                _renewer.discard(state)  # see below
                runs.complete(bind, state.claim, None)  # joins the caller's transaction
                state.completed = True
                return
            cm: Any = bind.begin()
            conn = bind
        else:
            engine = bind if bind is not None else state.store.engine
            if bind is not None:
                self._check_same_database(engine, state.store)
            cm = state.store.begin() if bind is None else engine.begin()
            conn = None
        try:
            with cm as entered:
                tx = conn if conn is not None else entered
                yield tx
                # The completion locks the run row until the commit: a renewal now would
                # wait on our own lock (and hold up the leases of other executions the
                # renewer serves). The fence is checked inside this transaction, so no
                # takeover can slip in before the commit; the lease is no longer needed.
                _renewer.discard(state)
                runs.complete(tx, state.claim, None)
        except BaseException as exc:
            self._after_rollback(state, exc)
            raise
        state.completed = True

    @staticmethod
    def _check_same_database(engine: Engine, store: Store) -> None:
        a, b = engine.url, store.engine.url
        if (a.host, a.port, a.database) != (b.host, b.port, b.database):
            raise ConfigurationError(
                f"the transaction's database {a.render_as_string(hide_password=True)} is "
                f"not the reliable_beat store {store.safe_url}; effect and key cannot commit "
                "together"
            )

    def _after_rollback(self, state: _RunState, exc: BaseException) -> None:
        if isinstance(exc, StaleFenceToken):
            log.warning("%s: %s", self.name, exc)
            runs.record_fenced_out(state.store, state.claim)
            state.completed = True  # nothing more to record for this attempt
        else:
            # Rolled back without completing: the body may go on, so keep the lease alive.
            _renewer.add(state)

    # -------------------------------------------------------------- execution ----

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Claim -> body -> fenced completion -> failure classification."""
        try:
            key = self._resolve_key(args, kwargs)
        except IdempotencyKeyError:
            log.error("refusing to run %s[%s]: no idempotency key", self.name, self.request.id)
            raise
        request = self.request
        store = self.store
        lease = self._lease()
        fire_at = _parse_fire_at(_header(request, FIRE_AT_HEADER))
        try:
            claim = runs.claim_run(
                store,
                key,
                owner=self.reliable_beat_settings.owner,
                lease=lease,
                task=self.name,
                args=list(args),
                kwargs=dict(kwargs),
                entry=_header(request, ENTRY_HEADER),
                fire_at=fire_at,
                task_id=request.id,
                trigger=_header(request, TRIGGER_HEADER),
            )
        except self.transient_exceptions as exc:
            # The store itself is unreachable: nothing was recorded; retry later.
            delay = self._backoff(request.retries or 0)
            raise self.retry(exc=exc, countdown=delay, headers=self._key_headers(key)) from exc
        if claim.outcome == runs.ALREADY_SUCCEEDED:
            log.info("%s: %s already succeeded; returning stored result", self.name, key)
            return claim.result
        if claim.outcome == runs.DEAD:
            log.warning("%s: run %s is dead; not run (requeue it to run again)", self.name, key)
            return None
        if claim.outcome == runs.BUSY:
            # Someone else holds a live lease: come back when it would have expired. If the
            # holder succeeds, the retry finds 'succeeded' and deduplicates; if it died, the
            # retry takes the run over with a new fence.
            wait = (claim.retry_after or lease).total_seconds() + 0.5
            if request.is_eager:  # an eager retry would run again at once, in a loop
                raise LeaseHeldError(
                    f"run {key!r} is leased by another runner for {wait:.1f}s more"
                )
            log.info("%s: %s is busy (leased); retrying in %.1fs", self.name, key, wait)
            raise self.retry(countdown=wait, headers=self._key_headers(key))
        if claim.attempt > self._max_attempts():
            # Redelivered after crashes more often than the budget allows (a poison message).
            runs.record_failure(
                store, claim, "attempt budget exhausted (the worker died during earlier tries)",
                dead_reason="exhausted", payload=self._payload(claim),
            )
            return None
        return self._execute(claim, store, lease, args, kwargs)

    def _execute(
        self,
        claim: runs.Claim,
        store: Store,
        lease: timedelta,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        state = _RunState(claim=claim, store=store, lease=lease, task_name=self.name)
        states: dict[int, _RunState] = _current.__dict__.setdefault("states", {})
        previous = states.get(id(self))
        states[id(self)] = state
        _renewer.add(state)
        try:
            try:
                result = super().__call__(*args, **kwargs)
            finally:
                _renewer.discard(state)
            if state.completed:
                if state.transaction_used and result is not None:
                    runs.set_result(store, claim, result)
                return result
            try:
                with store.begin() as conn:
                    runs.complete(conn, claim, result)
            except StaleFenceToken:
                runs.record_fenced_out(store, claim)
                raise
            state.completed = True
            return result
        except StaleFenceToken:
            raise
        except (Retry, Ignore, Reject) as exc:
            if not state.completed:
                when = exc.when if isinstance(exc, Retry) else None
                seconds = when if isinstance(when, (int, float)) else None
                runs.record_failure(
                    store, claim, f"{type(exc).__name__}: {exc}", retry_in_seconds=seconds
                )
            raise
        except Exception as exc:
            if state.completed:
                raise  # the effect committed; an error after it is not retried
            return self._on_body_error(exc, claim, store)
        finally:
            if previous is None:
                states.pop(id(self), None)
            else:
                states[id(self)] = previous

    def _on_body_error(self, exc: Exception, claim: runs.Claim, store: Store) -> Any:
        error = runs.format_error(exc)
        kind = self.classify(exc)
        if kind == "transient" and claim.attempt < self._max_attempts():
            delay = self._backoff(claim.attempt - 1)
            try:
                outcome = runs.record_failure(store, claim, error, retry_in_seconds=delay)
            except Exception:
                log.exception("%s: could not record the failure of %s", self.name, claim.key)
                outcome = "unrecorded"
            if outcome == "fenced_out":
                raise StaleFenceToken(claim.key, claim.fence_token) from exc
            log.warning(
                "%s: %s attempt %d failed (%s); retry in %.2fs",
                self.name, claim.key, claim.attempt, type(exc).__name__, delay,
            )
            try:
                raise self.retry(exc=exc, countdown=delay, headers=self._key_headers(claim.key))
            except Retry:
                raise
            except Exception as publish_exc:
                # The retry message could not be published (broker down after kombu's own
                # retries). The run stays `retrying`: a beat's or relay's re-dispatch sweep
                # sends its trigger again once it is untouched for redispatch_seconds +
                # retry_cap_seconds (reliable_beat.redispatch), so a broker blip neither
                # drops the slot nor needs a person.
                log.error("%s: could not send the retry of %s (%r); the re-dispatch sweep "
                          "will send it again", self.name, claim.key, publish_exc)
                raise exc from publish_exc
        reason = "permanent" if kind == "permanent" else "exhausted"
        try:
            outcome = runs.record_failure(
                store, claim, error, dead_reason=reason, payload=self._payload(claim)
            )
        except Exception as record_exc:
            # The store is unreachable, so the dead letter cannot be written. Never drop the
            # work silently (invariant 8): send it again; the next try records it.
            log.exception("%s: could not dead-letter %s; retrying", self.name, claim.key)
            delay = self._backoff(claim.attempt - 1)
            raise self.retry(
                exc=record_exc, countdown=delay, headers=self._key_headers(claim.key)
            ) from exc
        if outcome == "fenced_out":
            raise StaleFenceToken(claim.key, claim.fence_token) from exc
        log.error("%s: %s dead-lettered (%s): %s", self.name, claim.key, reason, exc)
        raise exc

    def classify(self, exc: BaseException) -> str:
        """``permanent`` or ``transient`` for an exception raised by the body (overridable)."""
        if isinstance(exc, PermanentError):
            return "permanent"
        if isinstance(exc, self.permanent_exceptions):
            return "permanent"
        if isinstance(exc, self.transient_exceptions):
            return "transient"
        return "transient" if self.retry_unknown_exceptions else "permanent"

    def _backoff(self, retry_number: int) -> float:
        """Full-jitter delay in seconds before retry ``retry_number`` (0 = first retry)."""
        s = self.reliable_beat_settings
        base = self.retry_base_seconds or s.retry_base_seconds
        cap = self.retry_cap_seconds if self.retry_cap_seconds is not None else s.retry_cap_seconds
        return backoff_delay(retry_number, base=base, cap=cap)

    def _key_headers(self, key: str) -> dict[str, Any]:
        headers = {name: _header(self.request, name) for name in _HEADERS}
        headers[KEY_HEADER] = key
        return {k: v for k, v in headers.items() if v is not None}

    def _payload(self, claim: runs.Claim) -> dict[str, Any]:
        return {
            "task": self.name,
            "args": list(claim.args),
            "kwargs": dict(claim.kwargs or {}),
            "key": claim.key,
            "headers": self._key_headers(claim.key),
            # Where the message came from, so a requeue goes back to the same queue.
            "queue": (self.request.delivery_info or {}).get("routing_key"),
        }
