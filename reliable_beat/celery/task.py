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

import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from kombu.utils import json as kombu_json
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
    OperationalError,
    StatementError,
)

from reliable_beat import joins, runs, slots, tracing
from reliable_beat import values as rb_values
from reliable_beat.celery.reprs import shown_reprs
from reliable_beat.db.dialects import Store
from reliable_beat.errors import (
    ConfigurationError,
    IdempotencyKeyError,
    LeaseHeldError,
    PermanentError,
    StaleFenceToken,
)
from reliable_beat.identity import STORE_HEADER, ForeignStoreError, store_id
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
#: Internal retries (busy lease, store unreachable) that led to a message; not a try.
WAITS_HEADER = "reliable_beat_waits"
# (traceparent: a retry's message stays in its slot's trace)
_HEADERS = (KEY_HEADER, ENTRY_HEADER, FIRE_AT_HEADER, TRIGGER_HEADER, tracing.TRACEPARENT)


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


# ------------------------------------------------- default store, missing schema ----

_warned_default_store: set[int] = set()


def _warn_default_store_once(settings: Settings) -> None:
    message = settings.default_store_warning("worker")
    if message and os.getpid() not in _warned_default_store:
        _warned_default_store.add(os.getpid())
        log.warning("%s", message)


def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """``celeryd_after_setup``: a worker running IdempotentTasks on the default store says so
    at start, and bad reliable_beat settings are reported before the first task. Its
    consumer writes acks at once (:mod:`reliable_beat.celery.prompt_acks`)."""
    app = getattr(instance, "app", None)
    if app is None:
        return
    try:
        tracked = any(isinstance(t, IdempotentTask) for t in list(app.tasks.values()))
        if tracked:
            # acks written at once, not at the hub's next wake-up (see prompt_acks)
            from reliable_beat.celery import prompt_acks

            prompt_acks.install(instance)
            settings = Settings.from_celery(app)
            log.info("reliable_beat: store %s", settings.database_url_text)
            _warn_default_store_once(settings)
    except ConfigurationError as exc:
        log.critical("reliable_beat: configuration refused: %s", exc)


# The framework-neutral worker protocol (schema check, per-process stores, run state, the
# lease renewer) lives in reliable_beat.execution, shared with the Dramatiq adapter.
from reliable_beat import execution  # noqa: E402
from reliable_beat.execution import (  # noqa: E402
    _current,
    _raise_if_schema_missing,
    _renewer,
    _RunState,
    _store_for,
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
    """The fire-time header: :func:`reliable_beat.slots.parse_fire_at` (no zone: UTC)."""
    return slots.parse_fire_at(value, FIRE_AT_HEADER)


# The note stored instead of a result that cannot be stored as JSON, and the conversion: one
# definition, shared with the Dramatiq adapter (reliable_beat.execution).
from reliable_beat.execution import RESULT_NOTE_KEY  # noqa: E402, F401 (re-exported)
from reliable_beat.execution import storable_result as _storable_result  # noqa: E402


def _loaded_result(stored: Any) -> Any:
    """A stored result with kombu's typed objects turned back into Python values."""
    if stored is None or isinstance(stored, (bool, int, float, str)):
        return stored
    try:
        return kombu_json.loads(json.dumps(stored))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):  # an unknown "__type__": give the stored JSON as it is
        return stored


#: Celery's retry options and what an IdempotentTask makes of them (docs/task.md).
_CELERY_RETRY_OPTIONS = (
    "max_retries", "autoretry_for", "dont_autoretry_for", "retry_kwargs", "retry_backoff",
    "retry_backoff_max", "retry_jitter", "default_retry_delay",
)


@dataclass(frozen=True)
class _RetryPlan:
    """The attempt budget and backoff of one IdempotentTask class (None: the setting)."""

    max_attempts: int | None = None
    base_seconds: float | None = None
    cap_seconds: float | None = None
    jitter: bool = True
    fixed_delay: float | None = None
    autoretry_for: tuple[type[BaseException], ...] = ()
    dont_autoretry_for: tuple[type[BaseException], ...] = ()


def _explicit(cls: type, name: str) -> tuple[bool, Any]:
    """``(True, value)`` when ``name`` is set on ``cls`` or a class between it and
    IdempotentTask (the user's own definition, e.g. ``@app.task(max_retries=3)``)."""
    for klass in cls.__mro__:
        if klass is IdempotentTask:
            break
        if name in klass.__dict__:
            return True, klass.__dict__[name]
    return False, None


def _retry_plan(cls: type) -> _RetryPlan:
    """Map Celery's retry options of ``cls`` onto the attempt budget and backoff.

    Raises:
        ConfigurationError: an option that cannot mean what it means in Celery, or that
            contradicts the reliable_beat attribute given with it; the message names both.
    """
    name = getattr(cls, "name", None) or cls.__name__
    problems: list[str] = []
    got = {opt: _explicit(cls, opt) for opt in _CELERY_RETRY_OPTIONS}
    ours = {opt: _explicit(cls, opt) for opt in (
        "max_attempts", "retry_base_seconds", "retry_cap_seconds")}
    max_attempts: int | None = None
    fixed: float | None = None
    retry_kwargs: dict[str, Any] = {}
    if got["retry_kwargs"][0]:
        retry_kwargs = dict(got["retry_kwargs"][1] or {})
        for k in sorted(set(retry_kwargs) - {"max_retries", "countdown"}):
            problems.append(
                f"retry_kwargs[{k!r}] is not supported on an IdempotentTask (only max_retries "
                "and countdown)")
    for source, given, value in (
        ("max_retries", got["max_retries"][0], got["max_retries"][1]),
        ("retry_kwargs['max_retries']", "max_retries" in retry_kwargs,
         retry_kwargs.get("max_retries")),
    ):
        if not given:
            continue
        if value is None:
            problems.append(
                f"{source}=None (retry for ever) is not supported: an IdempotentTask's "
                "tries end in a dead letter; set max_attempts (or the "
                "reliable_beat_retry_max_attempts setting) to a bound instead")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"{source}={value!r}: expected a whole number >= 0")
        elif max_attempts is not None and max_attempts != value + 1:
            problems.append(f"{source}={value!r} contradicts max_retries={max_attempts - 1}")
        else:
            max_attempts = value + 1
    if max_attempts is not None and ours["max_attempts"][0] and \
            ours["max_attempts"][1] not in (None, max_attempts):
        problems.append(
            f"max_retries={max_attempts - 1} (= {max_attempts} tries) contradicts "
            f"max_attempts={ours['max_attempts'][1]}; set one of them")
    base: float | None = None
    cap: float | None = None
    jitter = True
    backoff_given, backoff = got["retry_backoff"]
    if backoff_given and backoff:
        if isinstance(backoff, bool):
            base = 1.0
        elif isinstance(backoff, (int, float)) and backoff > 0:
            base = float(int(max(1.0, backoff)))  # Celery's factor: int(max(1.0, value))
        else:
            problems.append(f"retry_backoff={backoff!r}: expected True or seconds > 0")
        if ours["retry_base_seconds"][0] and ours["retry_base_seconds"][1] is not None:
            problems.append(
                f"retry_backoff={backoff!r} and retry_base_seconds="
                f"{ours['retry_base_seconds'][1]!r} both set the backoff base; set one")
    if got["retry_backoff_max"][0]:
        value = got["retry_backoff_max"][1]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"retry_backoff_max={value!r}: expected seconds >= 0")
        else:
            cap = float(value)
        if ours["retry_cap_seconds"][0] and ours["retry_cap_seconds"][1] is not None:
            problems.append(
                f"retry_backoff_max={value!r} and retry_cap_seconds="
                f"{ours['retry_cap_seconds'][1]!r} both cap the backoff; set one")
    elif base is not None:
        cap = 600.0  # Celery's default retry_backoff_max
    if got["retry_jitter"][0]:
        jitter = bool(got["retry_jitter"][1])
    if "countdown" in retry_kwargs:
        value = retry_kwargs["countdown"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"retry_kwargs['countdown']={value!r}: expected seconds >= 0")
        else:
            fixed = float(value)
    if fixed is None and base is None and got["default_retry_delay"][0]:
        value = got["default_retry_delay"][1]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"default_retry_delay={value!r}: expected seconds >= 0")
        else:
            fixed = float(value)
    if fixed is not None and base is not None:
        problems.append("retry_kwargs['countdown'] and retry_backoff both set the delay; "
                        "set one")
    autoretry: tuple[type[BaseException], ...] = ()
    dont: tuple[type[BaseException], ...] = ()
    for opt in ("autoretry_for", "dont_autoretry_for"):
        given, value = got[opt]
        if not given or not value:
            continue
        classes = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not all(isinstance(c, type) and issubclass(c, BaseException) for c in classes):
            problems.append(f"{opt}={value!r}: expected exception classes")
        elif opt == "autoretry_for":
            autoretry = classes
        else:
            dont = classes
    if problems:
        raise ConfigurationError(
            f"IdempotentTask {name}: " + "; ".join(problems)
            + " (see docs/task.md, 'Celery's retry options')")
    return _RetryPlan(max_attempts=max_attempts, base_seconds=base, cap_seconds=cap,
                      jitter=jitter, fixed_delay=fixed, autoretry_for=autoretry,
                      dont_autoretry_for=dont)


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
        max_retries: None (not set): :attr:`max_attempts` (counted in the database, crashes
            included) limits the tries. Set it to ``N`` (Celery's meaning): ``N + 1`` tries.
        lease_seconds / max_attempts / retry_base_seconds / retry_cap_seconds: None means
            the ``reliable_beat_*`` setting.

    Celery's own retry options keep their Celery meaning (``docs/task.md``): ``max_retries=N``
    allows ``N + 1`` tries that run the body; ``autoretry_for`` exceptions are retried
    (``dont_autoretry_for`` ones are not: dead letter); ``retry_backoff`` /
    ``retry_backoff_max`` / ``retry_jitter`` set the backoff of every retry;
    ``default_retry_delay`` / ``retry_kwargs={"countdown": s}`` a fixed delay. An option
    that cannot keep its meaning, or contradicts the reliable_beat attribute given with it,
    raises :class:`ConfigurationError` when the task class is defined. Internal retries
    (another runner holds the lease; the store was unreachable at the claim) never count
    against the budget, neither ours nor Celery's ``request.retries``.
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
    _rb_retry: ClassVar[_RetryPlan] = _RetryPlan()
    #: Celery's expected exceptions (logged at INFO, no traceback): a fenced-out run
    #: (:class:`~reliable_beat.errors.StaleFenceToken`) and an eager call that finds the
    #: lease held (:class:`~reliable_beat.errors.LeaseHeldError`) are expected outcomes.
    throws: ClassVar[tuple[type[BaseException], ...]] = (StaleFenceToken, LeaseHeldError)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Check Celery's retry options at task definition (``@app.task(base=...)``).

        Raises:
            ConfigurationError: see :func:`_retry_plan`.
        """
        super().__init_subclass__(**kwargs)
        cls._rb_retry = _retry_plan(cls)
        # A fenced-out holder's StaleFenceToken is the expected end of a run another worker
        # took over (docs/task.md), and an eager call's LeaseHeldError the expected answer
        # when another runner holds the lease (rbt.run_concurrently): Celery logs a task's
        # ``throws`` at INFO without a traceback, anything else as "raised unexpected" at
        # ERROR with one. Kept when a task gives its own ``throws``.
        for expected in (StaleFenceToken, LeaseHeldError):
            if expected not in tuple(cls.throws or ()):
                cls.throws = (*tuple(cls.throws or ()), expected)

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
        exactly the key the caller saw. The message's ``argsrepr`` / ``kwargsrepr`` (what
        Celery's logs, events and ``inspect`` show of the arguments) are redacted
        (:mod:`reliable_beat.celery.reprs`) unless given.

        Raises:
            IdempotencyKeyError: no ``reliable_beat_key`` header and
                :meth:`idempotency_key_for` returned None; or an ad-hoc key with the form
                of a scheduled slot's key (``"<entry>@<UTC instant>Z"``), which is reserved.
            reliable_beat.values.ValueLimitError: the key is over 400 characters or the
                ``task_id`` over 64 (the store's limits, the same on every database).
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
        rb_values.check_length("idempotency key", key, rb_values.MAX_IDEMPOTENCY_KEY)
        if options.get("task_id") is not None:
            rb_values.check_length("task_id", str(options["task_id"]), rb_values.MAX_TASK_ID)
        if _SLOT_KEY.search(key) and not headers.get(ENTRY_HEADER):
            raise IdempotencyKeyError(
                f"{self.name}: key {key!r} has the form of a scheduled slot's key "
                "('<entry>@<UTC instant>Z'), which is reserved: an ad-hoc run under it would "
                "take that slot's place. Use another form (e.g. 'manual:...'), or "
                "`reliable-beat entries trigger` / `backfill` to run an entry's slot"
            )
        if options.get("argsrepr") is None or options.get("kwargsrepr") is None:
            # what Celery's logs, events and `inspect` show of the arguments: redacted
            shown_args, shown_kwargs = shown_reprs(self.app, args, kwargs)
            options["argsrepr"] = options.get("argsrepr") or shown_args
            options["kwargsrepr"] = options.get("kwargsrepr") or shown_kwargs
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
        """The ``reliable_beat_*`` settings of this task's app (read once per process).

        On the embedded default store a WARNING naming the setting to set is logged once per
        process (see :meth:`Settings.default_store_warning`).
        """
        if self._rb_settings is None:
            settings = Settings.from_celery(self.app)
            _warn_default_store_once(settings)
            self._rb_settings = settings
        return self._rb_settings

    @property
    def store(self) -> Store:
        """This process's store (role ``worker``), created lazily; safe across prefork."""
        return _store_for(self.reliable_beat_settings.database_url)

    def _lease(self) -> timedelta:
        seconds = self.lease_seconds or self.reliable_beat_settings.lease_seconds
        return timedelta(seconds=seconds)

    def _max_attempts(self) -> int:
        """Tries that may run the body: ``max_attempts``, else Celery's ``max_retries + 1``,
        else the ``reliable_beat_retry_max_attempts`` setting."""
        return (self.max_attempts or self._rb_retry.max_attempts
                or self.reliable_beat_settings.retry_max_attempts)

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
    def outbox(self) -> execution.RunOutbox:
        """``self.outbox.add(tx, destination, payload, ...)``: see
        :class:`~reliable_beat.execution.RunOutbox`."""
        return execution.RunOutbox(self._state, lambda: self.reliable_beat_settings)

    # ------------------------------------------------------------ transaction ----

    @contextmanager
    def transaction(
        self, *, bind: Engine | Connection | None = None, session: Any = None,
        using: str | None = None,
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
            using: a Django database alias (``"default"``): the block is
                ``transaction.atomic(using=using)`` on Django's own connection and yields a
                ``Connection`` on it, so ORM writes in the block commit with the key (see
                :mod:`reliable_beat.contrib.django.db` and ``docs/django.md``). Without
                ``using``/``bind``/``session``, in a Django project with the app installed,
                it is the alias whose database is the store's (when one is).

        In a Django project with the app installed, a write on a Django connection other
        than the block's (another alias, or any when the block is not on Django's) raises
        ``ConfigurationError`` naming ``using=`` (:mod:`reliable_beat.contrib.django.join`).

        Raises:
            StaleFenceToken: the fence moved (another runner claimed the run after this
                one): everything written in the block was rolled back; the attempt is
                recorded ``fenced_out``.
            ConfigurationError: ``bind``/``session``/``using`` point at another database,
                ``using`` is given with ``bind``/``session``, Django is not installed, or
                (Django) an ORM write on another connection inside the block.
            RuntimeError: called outside an execution, or twice in one execution.
        """
        state = self._state()
        if state.transaction_used:
            raise RuntimeError(f"{self.name}: self.transaction() may be used once per run")
        state.transaction_used = True
        join = joins.registered()  # Django's, when the app is installed
        if using is None and bind is None and session is None and join is not None:
            using = join.default_alias(state.store)  # the store is this Django database
        if using is not None:
            if bind is not None or session is not None:
                raise ConfigurationError(
                    f"{self.name}: self.transaction(using={using!r}) runs on Django's "
                    "connection; pass bind=/session= or using=, not both"
                )
            join = joins.for_using(using, f"{self.name}: self.transaction")
            try:
                with join.atomic(using) as tx:
                    joins.check_same_database(tx.engine, state.store)
                    with self._guard(join, using, state):
                        yield tx
                    _renewer.discard(state)  # see below
                    runs.complete(tx, state.claim, state.returned)
            except BaseException as exc:
                self._after_rollback(state, exc)
                raise
            state.write_result = join.result_writer(using, state.store, state.claim)
            state.completed = True
            return
        if session is not None:
            conn = session.connection()
            self._check_same_database(conn.engine, state.store)
            try:
                with self._guard(join, None, state):
                    yield conn
                session.flush()
                _renewer.discard(state)  # see below
                runs.complete(conn, state.claim, state.returned)
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
                lent = join.alias_of(bind) if join is not None else None  # atomic_connection()'s
                with self._guard(join, lent, state):
                    yield bind
                _renewer.discard(state)  # see below
                runs.complete(bind, state.claim, state.returned)  # joins the caller's transaction
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
                with self._guard(join, None, state):
                    yield tx
                # The completion locks the run row until the commit: a renewal now would
                # wait on our own lock (and hold up the leases of other executions the
                # renewer serves). The fence is checked inside this transaction, so no
                # takeover can slip in before the commit; the lease is no longer needed.
                _renewer.discard(state)
                with tracing.completion_span(state.claim.key, state.claim.fence_token,
                                             state.claim.attempt):
                    runs.complete(tx, state.claim, state.returned)
        except BaseException as exc:
            self._after_rollback(state, exc)
            raise
        state.completed = True

    def _guard(self, join: joins.Join | None, alias: str | None,
               state: _RunState) -> AbstractContextManager[None]:
        """Writes on the framework's other connections refused inside the block."""
        return joins.guard(join, alias, where="self.transaction", task_name=self.name,
                           store=state.store)

    def returns(self, value: Any) -> None:
        """Declare the run's result inside ``self.transaction()``: it is stored by the
        completing transaction, with the effect (a workflow activity's result must be;
        the body's return value is otherwise stored after the commit, best effort).

        Raises:
            TypeError: ``value`` is not JSON-serialisable.
            RuntimeError: called outside an execution.
        """
        state = self._state()
        state.returned = _storable_result(self.name, state.claim.key, value)

    def _check_store_identity(self, store: Store, key: str) -> None:
        """Refuse a trigger written to another store (its ``reliable_beat_store`` header).

        Raises:
            ForeignStoreError: the trigger's store id is not this worker's store id (logged
                at CRITICAL; the run is not claimed; the caller records the message as a
                ``message`` dead letter in this store, so ``status --check`` here alarms).
        """
        theirs = _header(self.request, STORE_HEADER)
        if not theirs:
            return  # an ad-hoc call, or a beat of a version without store identity
        mine = store_id(store)
        if mine is None or mine == theirs:
            return
        settings = self.reliable_beat_settings
        message = (
            f"{self.name}: trigger {key} refused: it was written to store {theirs} but this "
            f"worker's store {store.safe_url} is {mine}. The beat and the workers use "
            f"different stores: set {settings.database_url_key} to the same database in every "
            "beat, worker and relay (`reliable-beat status` prints each store's id)"
        )
        log.critical("%s", message)
        raise ForeignStoreError(message)

    @staticmethod
    def _check_same_database(engine: Engine, store: Store) -> None:
        joins.check_same_database(engine, store)

    def _after_rollback(self, state: _RunState, exc: BaseException) -> None:
        if isinstance(exc, StaleFenceToken):
            log.warning("%s: %s", self.name, exc)
            tracing.annotate({tracing.OUTCOME: "fenced_out"})
            runs.record_fenced_out(state.store, state.claim)
            state.completed = True  # nothing more to record for this attempt
        else:
            # Rolled back without completing: the body may go on, so keep the lease alive.
            _renewer.add(state)

    # -------------------------------------------------------------- execution ----

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Claim -> body -> fenced completion -> failure classification (tracing on: in a
        ``process <task>`` span of the message's trace, unless Celery's instrumentation
        already made one: :func:`reliable_beat.tracing.process_span`)."""
        if tracing.tracer() is None:
            return self._call(*args, **kwargs)
        request = self.request
        with tracing.process_span(
            self.name, traceparent=_header(request, tracing.TRACEPARENT), system="celery",
            message_id=request.id, queue=(request.delivery_info or {}).get("routing_key"),
            expected=(Retry, Ignore, Reject),
        ):
            return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        self._unwrap_autoretry()
        try:
            key = self._resolve_key(args, kwargs)
        except IdempotencyKeyError:
            log.error("refusing to run %s[%s]: no idempotency key", self.name, self.request.id)
            raise
        request = self.request
        store = self.store
        lease = self._lease()
        entry = _header(request, ENTRY_HEADER)
        try:
            fire_at = _parse_fire_at(_header(request, FIRE_AT_HEADER))
            rb_values.check_length("idempotency key", key, rb_values.MAX_IDEMPOTENCY_KEY)
            if request.id is not None:
                rb_values.check_length("task_id", str(request.id), rb_values.MAX_TASK_ID)
            if entry is not None:
                rb_values.check_entry_name(entry)
            call_args = rb_values.to_json_value(list(args), "args")
            call_kwargs = rb_values.to_json_value(dict(kwargs), "kwargs")
        except ValueError as exc:
            return self._refuse(key, exc, args, kwargs)
        try:
            self._check_store_identity(store, key)
            claim = execution.claim_run(
                store,
                key,
                owner=self.reliable_beat_settings.owner,
                lease=lease,
                task=self.name,
                args=call_args,
                kwargs=call_kwargs,
                entry=entry,
                fire_at=fire_at,
                task_id=request.id,
                trigger=_header(request, TRIGGER_HEADER),
            )
        except (DataError, IntegrityError, runs.RunNotFound) as exc:
            # The database refused the values themselves, or the message names a slot whose
            # run has another key: no retry can succeed.
            return self._refuse(key, exc, args, kwargs)
        except ForeignStoreError as exc:  # a trigger written to another store
            return self._refuse(key, exc, args, kwargs)
        except StatementError as exc:
            if not isinstance(exc, DBAPIError):  # a value the driver could not bind
                return self._refuse(key, exc, args, kwargs)
            _raise_if_schema_missing(store, exc, self.name, key)
            raise self._internal_retry(key, self._store_backoff(), exc) from exc
        except self.transient_exceptions as exc:
            _raise_if_schema_missing(store, exc, self.name, key)
            # The store itself is unreachable: nothing was recorded; retry later (an internal
            # retry: it does not count against the budget).
            raise self._internal_retry(key, self._store_backoff(), exc) from exc
        if claim.malformed is None and (claim.outcome != runs.ACQUIRED or not claim.fresh):
            self._check_same_call(claim, call_args, call_kwargs)
        decision = execution.claim_decision(claim, lease, self._max_attempts())
        if decision.verb == "return_stored":
            log.info("%s: %s already succeeded; returning stored result", self.name, key)
            return _loaded_result(decision.result)
        if decision.verb == "skip":
            log.warning("%s: run %s: %s; not run", self.name, key, decision.reason)
            return None
        if decision.verb == "retry_in":
            # Someone else holds a live lease: come back when it would have expired. If the
            # holder succeeds, the retry finds 'succeeded' and deduplicates; if it died, the
            # retry takes the run over with a new fence.
            wait = decision.seconds
            if request.is_eager:  # an eager retry would run again at once, in a loop
                log.info("%s: %s is busy (leased by another runner for %.1fs more); an "
                         "eager call raises LeaseHeldError instead of retrying", self.name,
                         key, wait)
                raise LeaseHeldError(
                    f"run {key!r} is leased by another runner for {wait:.1f}s more"
                )
            log.info("%s: %s is busy (leased); retrying in %.1fs", self.name, key, wait)
            raise self._internal_retry(key, wait)
        if decision.verb == "dead":
            # Redelivered after crashes more often than the budget allows (a poison message).
            # This claim only checks the budget: it did not run the body, so it is not
            # counted (runs.attempts = the tries that ran the body).
            runs.record_failure(store, claim, decision.reason, dead_reason="exhausted",
                                payload=self._payload(claim), ran_body=False)
            return None
        return self._execute(claim, store, lease, args, kwargs)

    def _unwrap_autoretry(self) -> None:
        """Undo Celery's ``autoretry_for`` wrapper of ``run`` (see :func:`_retry_plan`).

        ``@app.task(autoretry_for=...)`` wraps ``run`` in a second retry loop with its own
        counter; an IdempotentTask retries those exceptions itself, within one budget. The
        ``_orig_run`` attribute stays, so Celery does not wrap again.
        """
        orig = self.__dict__.get("_orig_run")
        if orig is not None and self.__dict__.get("run") is not orig:
            self.run = orig

    def _internal_retry(
        self, key: str, countdown: float, exc: BaseException | None = None
    ) -> Retry:
        """Send this message again in ``countdown`` s without spending the attempt budget.

        Unlike ``self.retry``, Celery's ``request.retries`` is not increased and
        ``max_retries`` is not checked: waiting for another runner's lease, or for the store
        to come back, is not a try of the body. If the message cannot be sent again (the
        broker is down too), it is handed back to the broker (``Reject(requeue=True)``:
        with ``acks_late`` the original message is redelivered), never dropped.

        Returns:
            The ``Retry`` to raise (it tells the worker the task was re-sent).
        """
        request = self.request
        if request.is_eager and exc is not None:
            raise exc  # eager apply(): no broker to wait on; the caller sees the error
        headers = self._key_headers(key)
        headers[WAITS_HEADER] = self._waits() + 1
        sig = self.signature_from_request(
            request, None, None, countdown=countdown, retries=request.retries or 0,
            headers=headers,
        )
        try:
            sig.apply_async()
        except Exception as publish_exc:
            log.error("%s: could not re-send %s (%r); handing the message back to the broker",
                      self.name, key, publish_exc)
            raise Reject(publish_exc, requeue=True) from publish_exc
        return Retry(exc=exc, when=countdown, sig=sig)

    def _waits(self) -> int:
        """How many internal retries led to this message (0 for a first delivery)."""
        try:
            return max(int(_header(self.request, WAITS_HEADER) or 0), 0)
        except (TypeError, ValueError):
            return 0

    def _store_backoff(self) -> float:
        """Full-jitter delay before trying an unreachable store again: the settings' base
        and cap, growing with the internal retries of this message (not the task's retry
        options: waiting for the store is not a try)."""
        s = self.reliable_beat_settings
        return backoff_delay(min(self._waits(), 30), base=s.retry_base_seconds,
                             cap=s.retry_cap_seconds)

    def _refuse(
        self, key: str, exc: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Refuse a message whose values the store can never take (permanent, visible).

        Records a dead letter of kind ``message`` (there is no run row: the key, the entry
        name or the arguments could not be stored, or the slot's run has another key) with
        the full key, task id and error, logs it at ERROR and raises ``exc`` (the task
        fails; nothing is retried).
        """
        error = f"{type(exc).__name__}: {exc}"
        log.error("%s[%s]: refusing the message for key %.80r: %s",
                  self.name, self.request.id, key, error)
        payload = {
            "task": self.name, "key": key, "task_id": self.request.id,
            "entry": _header(self.request, ENTRY_HEADER),
            "args": [repr(a)[:2000] for a in args],
            "kwargs": {str(k): repr(v)[:2000] for k, v in kwargs.items()},
        }
        try:
            runs.record_refused_message(self.store, key=key, task=self.name,
                                        payload=payload, error=error)
        except Exception as record_exc:
            log.exception("%s: could not record the refused message; retrying", self.name)
            raise self._internal_retry(key, self._backoff(0), record_exc) from exc
        raise exc

    def _check_same_call(self, claim: runs.Claim, args: Any, kwargs: Any) -> None:
        """Compare this call with the one stored on the key's run (key reuse).

        The same key with other arguments is another piece of work under a reused key: it
        would silently get the earlier run's result. Logged at WARNING, or refused with
        :class:`IdempotencyKeyError` when ``reliable_beat_key_reuse = "refuse"``.
        """
        if list(claim.args) == args and dict(claim.kwargs or {}) == kwargs:
            return
        message = (
            f"{self.name}: idempotency key {claim.key!r} was used for another call: stored "
            f"call digest {rb_values.call_digest(claim.args, claim.kwargs)[:16]}, this call "
            f"{rb_values.call_digest(args, kwargs)[:16]} (args={args!r:.200} "
            f"kwargs={kwargs!r:.200}); a key must name one piece of work"
        )
        if self.reliable_beat_settings.key_reuse != "refuse":
            log.warning("%s; the stored run is used", message)
            return
        log.error("%s; refused (reliable_beat_key_reuse='refuse')", message)
        if claim.outcome == runs.ACQUIRED:
            runs.record_failure(self.store, claim, message, ran_body=False)
        raise IdempotencyKeyError(message)

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
        body = super().__call__
        try:
            return execution.run_and_complete(state, lambda: body(*args, **kwargs), logger=log)
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
        """Map the shared failure decision (:func:`reliable_beat.execution.failure_decision`)
        onto Celery's verbs: ``self.retry(countdown=)``, or re-raise (the task fails)."""
        decision = execution.failure_decision(
            store, claim, exc, self.classify(exc), max_attempts=self._max_attempts(),
            delay=self._backoff(claim.attempt - 1), payload=self._payload(claim),
            task_name=self.name, logger=log,
        )
        if decision.verb == "fenced_out":
            raise StaleFenceToken(claim.key, claim.fence_token) from exc
        if decision.verb == "retry_unrecorded":
            raise self.retry(
                exc=decision.unrecorded, countdown=decision.seconds,
                headers=self._key_headers(claim.key),
            ) from exc
        if decision.verb == "retry_in":
            log.warning(
                "%s: %s attempt %d failed (%s); retry in %.2fs",
                self.name, claim.key, claim.attempt, type(exc).__name__, decision.seconds,
            )
            try:
                raise self.retry(exc=exc, countdown=decision.seconds,
                                 headers=self._key_headers(claim.key))
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
        log.error("%s: %s dead-lettered (%s): %s", self.name, claim.key, decision.reason, exc)
        raise exc

    def classify(self, exc: BaseException) -> str:
        """``permanent`` or ``transient`` for an exception raised by the body (overridable)."""
        if isinstance(exc, PermanentError):
            return "permanent"
        plan = self._rb_retry
        if plan.dont_autoretry_for and isinstance(exc, plan.dont_autoretry_for):
            return "permanent"  # Celery: not retried
        if plan.autoretry_for and isinstance(exc, plan.autoretry_for):
            return "transient"  # Celery: retried (within the budget)
        if isinstance(exc, self.permanent_exceptions):
            return "permanent"
        if isinstance(exc, self.transient_exceptions):
            return "transient"
        if plan.autoretry_for:
            return "permanent"  # Celery retries only what autoretry_for lists
        return "transient" if self.retry_unknown_exceptions else "permanent"

    def _backoff(self, retry_number: int) -> float:
        """Delay in seconds before retry ``retry_number`` (0 = first retry).

        Full jitter by default: ``uniform(0, min(cap, base * 2**k))``; without jitter
        (Celery's ``retry_jitter=False``) ``min(cap, base * 2**k)``; a fixed delay when
        Celery's ``default_retry_delay`` or ``retry_kwargs["countdown"]`` sets one.
        """
        plan = self._rb_retry
        if plan.fixed_delay is not None:
            return plan.fixed_delay
        s = self.reliable_beat_settings
        base = plan.base_seconds or self.retry_base_seconds or s.retry_base_seconds
        cap = (plan.cap_seconds if plan.cap_seconds is not None
               else self.retry_cap_seconds if self.retry_cap_seconds is not None
               else s.retry_cap_seconds)
        if not plan.jitter:
            return cap if retry_number >= 1023 else min(cap, base * 2.0**retry_number)
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


# A worker that runs IdempotentTasks also records the starts of plain tasks' triggers.
from reliable_beat.celery import acks as _acks  # noqa: E402, F401

# ... and warns at start when the broker's timeouts are shorter than its retries.
from reliable_beat.celery import brokers as _brokers  # noqa: E402

_brokers.connect_worker_check()


def _connect_signals() -> None:
    from celery import signals

    signals.celeryd_after_setup.connect(_on_worker_setup, weak=False,
                                        dispatch_uid="reliable_beat.default_store")


_connect_signals()
