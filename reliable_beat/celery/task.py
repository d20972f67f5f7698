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

Two base classes hold parts of the class: :class:`~reliable_beat.celery.retry_options._Retries`
(Celery's retry options, ``classify``, the backoff, internal retries) and
:class:`~reliable_beat.celery.transaction._BodyTransaction` (``self.transaction()``,
``self.returns()``); the trigger's headers are read with :mod:`reliable_beat.celery.headers`.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, ClassVar

from celery.exceptions import Ignore, Reject, Retry
from kombu.utils import json as kombu_json
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
    StatementError,
)

from reliable_beat import execution, handoff, runs, slots, tracing
from reliable_beat import values as rb_values
from reliable_beat.celery import acks as _acks
from reliable_beat.celery import broker_loss, prompt_acks
from reliable_beat.celery import brokers as _brokers
from reliable_beat.celery.headers import (
    _HEADERS,
    _SLOT_KEY,
    ENTRY_HEADER,
    FIRE_AT_HEADER,
    KEY_HEADER,
    OUTBOX_MESSAGE_HEADER,
    TRIGGER_HEADER,
    WAITS_HEADER,  # noqa: F401 (re-exported)
    _header,
    _parse_fire_at,
)
from reliable_beat.celery.reprs import shown_reprs
from reliable_beat.celery.retry_options import (  # noqa: F401 (re-exported)
    _CELERY_RETRY_OPTIONS,
    _explicit,
    _redacted_retry,
    _Retries,
    _retry_plan,
    _RetryPlan,
    _transient_defaults,
)
from reliable_beat.celery.transaction import _BodyTransaction
from reliable_beat.db.dialects import Store
from reliable_beat.errors import (
    ConfigurationError,
    IdempotencyKeyError,
    LeaseHeldError,
    StaleFenceToken,
)

# The framework-neutral worker protocol (schema check, per-process stores, run state, the
# lease renewer; the note stored instead of a result that cannot be stored as JSON) lives
# in reliable_beat.execution, shared with the Dramatiq adapter.
from reliable_beat.execution import (
    RESULT_NOTE_KEY,  # noqa: F401 (re-exported)
    _current,
    _raise_if_schema_missing,
    _RunState,
    _store_for,
)
from reliable_beat.identity import STORE_HEADER, ForeignStoreError, store_id
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
    consumer writes acks at once (:mod:`reliable_beat.celery.prompt_acks`) and says why
    when Celery stops it after a broker restart (:mod:`reliable_beat.celery.broker_loss`)."""
    app = getattr(instance, "app", None)
    if app is None:
        return
    try:
        tracked = any(isinstance(t, IdempotentTask) for t in list(app.tasks.values()))
        if tracked:
            # acks written at once, not at the hub's next wake-up (see prompt_acks)
            prompt_acks.install(instance)
            # a worker Celery stops after a broker restart says why, and the fix
            broker_loss.install(instance)
            settings = Settings.from_celery(app)
            log.info("reliable_beat: store %s", settings.database_url_text)
            _warn_default_store_once(settings)
    except ConfigurationError as exc:
        log.critical("reliable_beat: configuration refused: %s", exc)


def _loaded_result(stored: Any) -> Any:
    """A stored result with kombu's typed objects turned back into Python values."""
    if stored is None or isinstance(stored, (bool, int, float, str)):
        return stored
    try:
        return kombu_json.loads(json.dumps(stored))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):  # an unknown "__type__": give the stored JSON as it is
        return stored


class IdempotentTask(_Retries, _BodyTransaction):
    """Base class for tasks whose effect must happen once per key.

    Use ``@app.task(base=IdempotentTask, bind=True)``. See the module docstring and
    ``docs/task.md``.

    Key, in order: the ``reliable_beat_key`` message header (put there by the scheduler,
    by :meth:`delay_with_key`, or ``apply_async(..., headers={"reliable_beat_key": k})``),
    else :meth:`idempotency_key_for` of the arguments, else (a message the relay published
    for an outbox row) the row's stable message id, its ``reliable_beat_message_id``
    header. None -> :class:`IdempotencyKeyError` at the call site (``apply_async``) and,
    for messages sent by name, in the worker, where the message is refused (logged, task
    FAILURE, a ``message`` dead letter ``no_key``, nothing run, no retry).

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
        cls._rb_retry = _retry_plan(cls, IdempotentTask)
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
            reliable_beat.values.ValueLimitError: the key is over 400 characters, the
                ``task_id`` over 64 (the store's limits, the same on every database), or an
                argument cannot be stored as JSON (NaN, infinity, ``\\x00``, a type
                Celery's JSON serializer does not carry).
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
        try:  # the run stores its arguments as JSON: refuse here what the worker would
            rb_values.to_json_value(list(args or ()), f"{self.name}: args")
            rb_values.to_json_value(dict(kwargs or {}), f"{self.name}: kwargs")
        except ValueError as exc:
            raise rb_values.ValueLimitError(
                f"{exc}; the call is refused (a run's arguments are stored as JSON)") from exc
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
        if not key:  # an outbox row's message: the relay's stable id, derived from the row
            key = _header(self.request, OUTBOX_MESSAGE_HEADER)
            if key and slots.has_slot_key_form(str(key)):
                raise IdempotencyKeyError(
                    f"{self.name}[{self.request.id}]: no idempotency key, and the outbox "
                    f"row's message id {str(key)!r} has the form of a scheduled slot's key "
                    "('<entry>@<UTC instant>Z'), which is reserved (a run under it would take "
                    f"that slot's place); refusing to run. Give the row a key: headers "
                    f"{{{KEY_HEADER!r}: ...}} in its payload, or another key= form")
        if not key:
            raise IdempotencyKeyError(
                f"{self.name}[{self.request.id}]: no idempotency key (no {KEY_HEADER!r} "
                "header, idempotency_key_for() returned None, not an outbox row's message); "
                "refusing to run"
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

    # -------------------------------------------------------------- execution ----

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Claim -> body -> fenced completion -> failure classification (tracing on: in a
        ``process <task>`` span of the message's trace, unless Celery's instrumentation
        already made one: :func:`reliable_beat.tracing.process_span`). A retry leaves with its
        text redacted (:func:`~reliable_beat.celery.retry_options._redacted_retry`)."""
        try:
            if tracing.tracer() is None:
                return self._call(*args, **kwargs)
            request = self.request
            with tracing.process_span(
                self.name, traceparent=_header(request, tracing.TRACEPARENT), system="celery",
                message_id=request.id, queue=(request.delivery_info or {}).get("routing_key"),
                expected=(Retry, Ignore, Reject),
            ):
                return self._call(*args, **kwargs)
        except Retry as signal:
            _redacted_retry(signal)
            raise

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
            # a worker of a workflow's app publishes the wake of a completed activity itself
            # (celery.workflows); an eager call (apply) leaves it to the relay
            with (nullcontext() if self.request.is_eager
                  else handoff.publishing_for(self.app)):
                return execution.run_and_complete(state, lambda: body(*args, **kwargs),
                                                  logger=log)
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


# A worker that runs IdempotentTasks also records the starts of plain tasks' triggers
# (importing acks connects it); an IdempotentTask's claim records its own.
_acks._records_own_start(IdempotentTask)

# ... and warns at start when the broker's timeouts are shorter than its retries.
_brokers.connect_worker_check()


def _connect_signals() -> None:
    from celery import signals

    signals.celeryd_after_setup.connect(_on_worker_setup, weak=False,
                                        dispatch_uid="reliable_beat.default_store")


_connect_signals()
