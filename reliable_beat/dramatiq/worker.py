"""The worker side: the :class:`ReliableBeat` middleware and :class:`IdempotentActor`.

The two are one mechanism and name each other, so they share this module: Dramatiq has no
"around" hook, so the actor class runs the core's worker protocol
(:mod:`reliable_beat.execution`: key -> claim (lease + fence) -> body under the process's
lease renewer -> fenced completion -> classification) and reads its settings from the
broker's middleware; the middleware declares the actor options, sets an
``IdempotentActor``'s retry options at declaration, binds each message for the actor and
records the messages a middleware skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NoReturn

import dramatiq
from dramatiq.middleware import Middleware
from sqlalchemy import update
from sqlalchemy.exc import DataError, IntegrityError

from reliable_beat import execution, runs, slots, tracing
from reliable_beat import values as rb_values
from reliable_beat.db.tables import runs as runs_table
from reliable_beat.dramatiq.base import (
    OPTION,
    OUTBOX_MESSAGE_OPTION,
    DeadLettered,
    _broker_errors,
    _parse_instant,
)
from reliable_beat.dramatiq.context import RunContext, _message, _run
from reliable_beat.dramatiq.retry_options import (
    drop_message_options,
    neutralize_broker_retry_when,
    retry_plan,
    retry_request,
)
from reliable_beat.errors import (
    ConfigurationError,
    IdempotencyKeyError,
    SchemaError,
    StaleFenceToken,
)
from reliable_beat.policies import backoff_delay
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings

__all__ = ["IdempotentActor", "ReliableBeat", "record_skipped_message"]

log = get_logger("reliable_beat.dramatiq")

#: Actor options our middleware declares (Dramatiq refuses undeclared ones at decoration).
ACTOR_OPTIONS = frozenset({
    "periodic", "periodic_name", "reliable_beat", "idempotency_key", "lease_seconds",
    "max_attempts",
})

_THROWS = (DeadLettered, StaleFenceToken, IdempotencyKeyError, SchemaError)


# ---------------------------------------------------------------------- middleware ----

class ReliableBeat(Middleware):  # type: ignore[misc]
    """The reliable_beat middleware; add it to the broker before importing actor modules.

    Args:
        settings: a :class:`Settings`, or a mapping read by :meth:`Settings.from_mapping`
            (``{"database_url": ...}``, names with or without the ``reliable_beat_``
            prefix; an unknown name raises ``ConfigurationError``); None: ``Settings()``
            (the environment's ``RELIABLE_BEAT_DATABASE_URL`` or the embedded default).
        schedule: a ``BEAT_SCHEDULE`` mapping ``{name: {"actor", "schedule", "args"?,
            "kwargs"?, "options"?, "reliable_beat"?}}``, read by the beat.

    Declares the actor options ``periodic``, ``periodic_name``, ``reliable_beat``,
    ``idempotency_key``, ``lease_seconds``, ``max_attempts``; on an :class:`IdempotentActor`
    it sets ``max_retries=None`` (our budget counts tries in the database; a ``max_retries``
    the user gave is the actor's ``max_attempts - 1``) and ``retry_when=None`` (a broker's
    ``Retries(retry_when=...)`` is not applied to it, :mod:`.retry_options`), and adds
    :class:`DeadLettered`, ``StaleFenceToken``, ``IdempotencyKeyError``, ``SchemaError`` to
    ``throws``. Its hooks never raise (Dramatiq swallows hook exceptions): control flow goes
    through the actor class.
    """

    def __init__(self, settings: Settings | Mapping[str, Any] | None = None,
                 schedule: Mapping[str, Any] | None = None) -> None:
        if settings is None:
            self.settings = Settings()
        elif isinstance(settings, Settings):
            self.settings = settings
        else:
            # Both ``database_url`` and ``reliable_beat_database_url`` forms; an unknown
            # name is refused by from_mapping (it names the key and lists the valid ones).
            self.settings = Settings.from_mapping({
                k if k.lower().startswith("reliable_beat_") else f"reliable_beat_{k}": v
                for k, v in settings.items()})
        self.schedule = dict(schedule or {})

    @property
    def actor_options(self) -> set[str]:
        return set(ACTOR_OPTIONS)

    def after_declare_actor(self, broker: Any, actor: Any) -> None:
        if isinstance(actor, IdempotentActor):
            actor.options["max_retries"] = None  # a given one is max_attempts (retry_options)
            neutralize_broker_retry_when(broker, actor)
            throws = actor.options.get("throws") or ()
            throws = throws if isinstance(throws, tuple) else (throws,)
            actor.options["throws"] = tuple(dict.fromkeys((*throws, *_THROWS)))

    def before_process_message(self, broker: Any, message: Any) -> None:
        _message.set(message)

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        _message.set(None)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        _message.set(None)
        record_skipped_message(self.settings, message)


def record_skipped_message(settings: Settings, message: Any) -> str | None:
    """Record a message a middleware skipped (``SkipMessage``: Dramatiq's ``AgeLimit`` for
    a delivery older than ``max_age``, i.e. a trigger later than its entry's ``expires``):
    its run, still ``scheduled`` / ``dispatched``, becomes ``skipped`` with reason
    ``expired`` (as the relay and the re-dispatch sweep record an expired trigger), and the
    skip is logged at WARNING with the message's ``max_age``. Never raises (Dramatiq
    swallows hook exceptions; a store that cannot be reached is logged and the re-dispatch
    sweep retires the run later).

    Returns:
        The new state (``skipped``) when a run was updated, else None (no key in the
        message options, no such run, or it already started / finished).
    """
    opts = (getattr(message, "options", None) or {}).get(OPTION) or {}
    key = opts.get("key")
    name = getattr(message, "actor_name", "?")
    mid = getattr(message, "message_id", None)
    if not key:
        log.warning("%s[%s]: message skipped by a Dramatiq middleware (max_age?); it has no "
                    "reliable_beat key, so no run records it (Dramatiq failed it to its dead "
                    "letters)", name, mid)
        return None
    why = (f"skipped by a Dramatiq middleware (AgeLimit: older than max_age="
           f"{(getattr(message, 'options', None) or {}).get('max_age')} ms, i.e. delivered "
           "after its entry's expires)")
    try:
        store = execution.store_for(settings.database_url)
        with store.begin() as conn:
            now = store.now(conn)
            done = conn.execute(
                update(runs_table)
                .where(runs_table.c.idempotency_key == str(key),
                       runs_table.c.state.in_(("scheduled", "dispatched")))
                .values(state="skipped", reason="expired", updated_at=now)
            ).rowcount
    except Exception:
        log.exception("%s[%s]: run %s: recording the skipped message failed; the re-dispatch "
                      "sweep will retire it", name, mid, key)
        return None
    log.warning("%s[%s]: run %s %s: %s", name, mid, key,
                "recorded skipped (expired)" if done else "not updated (started or finished)",
                why)
    return "skipped" if done else None


def _middleware(broker: Any) -> ReliableBeat:
    for m in broker.middleware:
        if isinstance(m, ReliableBeat):
            return m
    raise ConfigurationError(
        "reliable_beat: the broker has no ReliableBeat middleware: "
        "broker.add_middleware(ReliableBeat(settings=...)) before importing actors")


# ------------------------------------------------------------------- the actor class ----

class IdempotentActor(dramatiq.Actor):  # type: ignore[misc,type-arg]
    """``@dramatiq.actor(actor_class=IdempotentActor, ...)``: the twin of ``IdempotentTask``.

    Key, in order: the message option ``reliable_beat["key"]`` (the beat, a requeue,
    :meth:`send_with_key`), else the actor option ``idempotency_key`` (a string, or a callable
    of the call's arguments returning one), else (a message the relay published for an
    outbox row) the row's stable message id, the ``reliable_beat_message_id`` option. None
    -> :class:`IdempotencyKeyError` at the call site (``send``, :meth:`message_with_options`)
    and, for a message put on the queue without one, in the worker: a ``message`` dead letter
    ``no_key``, nothing runs, the message is failed. Never a random key.

    Actor options: ``lease_seconds`` / ``max_attempts`` (None: the settings). Classification
    (first match): ``dramatiq.Retry`` raised by the body -> a retry request with its delay,
    counted against ``max_attempts`` (not an error); ``PermanentError``, an exception listed
    in the actor's ``throws``, ``ValueError``, ``TypeError`` -> dead letter; connection
    errors, timeouts, ``OSError``, SQLAlchemy/redis errors, Dramatiq's ``TimeLimitExceeded``
    -> retry; others -> retry (the attempt budget bounds them).

    Dramatiq's retry options (:mod:`reliable_beat.dramatiq.retry_options`): ``retry_when``
    and a ``throws`` matching ``dramatiq.Retry`` are refused at decoration
    (:class:`~reliable_beat.errors.ConfigurationError`: they would drop the retries we ask
    for); ``max_retries=N`` means ``N + 1`` tries; the message options ``max_retries`` /
    ``throws`` are dropped with a WARNING.
    """

    def __init__(self, fn: Any, *, broker: Any, actor_name: str, queue_name: str,
                 priority: int, options: dict[str, Any]) -> None:
        # refused here, at decoration: Dramatiq's hooks swallow what they raise
        self._rb_retry = retry_plan(actor_name, options)
        super().__init__(fn, broker=broker, actor_name=actor_name, queue_name=queue_name,
                         priority=priority, options=options)

    def message_with_options(self, *, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None, **options: Any) -> Any:
        """Dramatiq's (``send``, ``send_with_options``, ``message``), refusing a call that
        has no idempotency key, and without the message options that would drop our retries
        (``max_retries``, ``throws``: a WARNING names them).

        The key the worker will use (the ``reliable_beat["key"]`` option, else the actor's
        ``idempotency_key`` of these arguments) is put into the message's
        ``reliable_beat`` option, so the worker uses exactly the key the caller saw.

        Raises:
            IdempotencyKeyError: neither gives a key; nothing is sent.
        """
        drop_message_options(self.actor_name, options, where="when the message was built")
        rb = dict(options.get(OPTION) or {})
        if not rb.get("key"):
            key = self._derived_key(args, kwargs or {})
            if not key:
                raise IdempotencyKeyError(
                    f"{self.actor_name}: no idempotency key for args={args!r} "
                    f"kwargs={kwargs!r}; refusing to send: use "
                    f"{self.actor_name}.send_with_key(key, ...), or declare the actor with "
                    "idempotency_key=callable (a key derived from the work)")
            rb["key"] = key
            options[OPTION] = rb
        return super().message_with_options(args=args, kwargs=kwargs, **options)

    def _derived_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The actor option ``idempotency_key`` (a string, or a callable of the call's
        arguments returning one) for these arguments, or None."""
        derive = self.options.get("idempotency_key")
        key = derive(*args, **kwargs) if callable(derive) else derive
        return str(key) if key else None

    def send_with_key(self, key: str, *args: Any, **kwargs: Any) -> Any:
        """``send(*args, **kwargs)`` under the explicit idempotency ``key``."""
        options: dict[str, Any] = {OPTION: {"key": key}}
        return self.send_with_options(args=args, kwargs=kwargs, **options)

    def _resolve_key(self, message: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        options = message.options if message is not None else {}
        key = (options.get(OPTION) or {}).get("key") or self._derived_key(args, kwargs)
        if not key:  # an outbox row's message: the relay's stable id, derived from the row
            key = options.get(OUTBOX_MESSAGE_OPTION)
            if key and slots.has_slot_key_form(str(key)):
                raise IdempotencyKeyError(
                    f"{self.actor_name}[{getattr(message, 'message_id', None)}]: no "
                    f"idempotency key, and the outbox row's message id {str(key)!r} has the "
                    "form of a scheduled slot's key ('<entry>@<UTC instant>Z'), which is "
                    "reserved (a run under it would take that slot's place); refusing to "
                    f"run. Give the row a key: options {{{OPTION!r}: {{'key': ...}}}} in its "
                    "payload, or another key= form")
        if not key:
            raise IdempotencyKeyError(
                f"{self.actor_name}[{getattr(message, 'message_id', None)}]: no idempotency key "
                f"(no {OPTION}['key'] message option, no idempotency_key actor option, not "
                "an outbox row's message); refusing to run")
        return str(key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Claim -> body -> fenced completion -> failure classification (tracing on: in a
        ``process <actor>`` span of the message's ``traceparent`` option)."""
        if tracing.tracer() is None:
            return self._call(*args, **kwargs)
        message = _message.get()
        options = message.options if message is not None else {}
        with tracing.process_span(
            self.actor_name, traceparent=options.get(tracing.TRACEPARENT), system="dramatiq",
            message_id=getattr(message, "message_id", None), queue=self.queue_name,
            expected=(dramatiq.Retry,),
        ):
            return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        message = _message.get()
        rb = _middleware(self.broker)
        settings = rb.settings
        if message is not None:  # a message built elsewhere: Retries reads these after us
            drop_message_options(self.actor_name, message.options, where="in the worker",
                                 message_id=message.message_id)
        store = execution.store_for(settings.database_url)
        try:
            key = self._resolve_key(message, args, kwargs)
        except IdempotencyKeyError as exc:
            self._refuse_keyless(store, exc, message, args, kwargs)
        opts = (message.options.get(OPTION) or {}) if message is not None else {}
        lease = timedelta(seconds=self.options.get("lease_seconds") or settings.lease_seconds)
        max_attempts = int(self.options.get("max_attempts") or self._rb_retry.max_attempts
                           or settings.retry_max_attempts)
        entry = opts.get("entry")
        message_id = getattr(message, "message_id", None)
        try:  # values the store can never take: refused (permanent, visible), never retried
            fire_at = _parse_instant(opts.get("fire_at"))
            rb_values.check_length("idempotency key", key, rb_values.MAX_IDEMPOTENCY_KEY)
            if message_id is not None:
                rb_values.check_length("task_id", str(message_id), rb_values.MAX_TASK_ID)
            if entry is not None:
                rb_values.check_entry_name(entry)
            call_args = rb_values.to_json_value(list(args), "args")
            call_kwargs = rb_values.to_json_value(dict(kwargs), "kwargs")
        except ValueError as exc:
            self._refuse(store, key, exc, message, args, kwargs)
        try:
            claim = execution.claim_run(
                store, key, owner=settings.owner, lease=lease, task=self.actor_name,
                args=call_args, kwargs=call_kwargs, entry=entry, fire_at=fire_at,
                task_id=message_id, trigger=opts.get("trigger"),
            )
        except (DataError, IntegrityError, runs.RunNotFound) as exc:
            self._refuse(store, key, exc, message, args, kwargs)
        except Exception as exc:
            execution.raise_if_schema_missing(store, exc, self.actor_name, key)
            delay = backoff_delay(0, base=settings.retry_base_seconds,
                                  cap=settings.retry_cap_seconds)
            log.warning("%s: claim of %s failed (%r); retry in %.1fs", self.actor_name, key,
                        exc, delay)
            raise dramatiq.Retry(delay=int(delay * 1000)) from exc
        decision = execution.claim_decision(claim, lease, max_attempts)
        if decision.verb == "return_stored":
            log.info("%s: %s already succeeded; not run again", self.actor_name, key)
            return decision.result
        if decision.verb == "skip":
            log.warning("%s: %s: %s", self.actor_name, key, decision.reason)
            return None
        if decision.verb == "retry_in":
            log.info("%s: %s %s; retry in %.1fs", self.actor_name, key, decision.reason,
                     decision.seconds)
            raise dramatiq.Retry(delay=int(decision.seconds * 1000))
        if decision.verb == "dead":
            runs.record_failure(store, claim, decision.reason, dead_reason="exhausted",
                                payload=self._payload(claim, message), ran_body=False)
            raise DeadLettered(f"{self.actor_name}: {key}: {decision.reason}")
        return self._execute(claim, store, lease, settings, max_attempts, message, args, kwargs)

    def _execute(self, claim: runs.Claim, store: Any, lease: timedelta, settings: Settings,
                 max_attempts: int, message: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        state = execution.RunState(claim=claim, store=store, lease=lease,
                                   task_name=self.actor_name)
        token = _run.set(RunContext(state=state, settings=settings))
        body = super().__call__
        try:
            return execution.run_and_complete(state, lambda: body(*args, **kwargs), logger=log)
        except StaleFenceToken:
            raise
        except BaseException as exc:
            # TimeLimitExceeded / Shutdown are BaseExceptions injected asynchronously: only
            # the fenced database state is truth, so a failure after completion is ignored.
            if state.completed or not isinstance(exc, (Exception, _interrupts())):
                raise
            return self._on_body_error(exc, claim, store, settings, max_attempts, message)
        finally:
            _run.reset(token)

    def _on_body_error(self, exc: BaseException, claim: runs.Claim, store: Any,
                       settings: Settings, max_attempts: int, message: Any) -> Any:
        asked: float | None = None
        error: str | None = None
        if isinstance(exc, dramatiq.Retry):  # the body asks for a retry: Dramatiq's meaning
            kind = "transient"
            asked, error = retry_request(exc)
        elif self._rb_retry.throws and isinstance(exc, self._rb_retry.throws):
            kind = "permanent"  # Dramatiq's meaning of throws: never retried
        else:
            kind = execution.classify(exc, transient=execution.transient_defaults(
                *_interrupts(), *_broker_errors()))
        decision = execution.failure_decision(
            store, claim, exc, kind, max_attempts=max_attempts, delay=asked,
            base_seconds=settings.retry_base_seconds, cap_seconds=settings.retry_cap_seconds,
            payload=self._payload(claim, message), task_name=self.actor_name, logger=log,
            error=error)
        if decision.verb == "fenced_out":
            raise StaleFenceToken(claim.key, claim.fence_token) from exc
        if decision.verb == "retry_unrecorded":  # the dead letter could not be written
            raise dramatiq.Retry(delay=max(1, int(decision.seconds * 1000))
                                 ) from decision.unrecorded
        if decision.verb == "retry_in":
            if error is not None:
                log.info("%s: %s attempt %d asked for a retry; retry in %.2fs",
                         self.actor_name, claim.key, claim.attempt, decision.seconds)
            else:
                log.warning("%s: %s attempt %d failed (%s); retry in %.2fs", self.actor_name,
                            claim.key, claim.attempt, type(exc).__name__, decision.seconds)
            raise dramatiq.Retry(delay=max(1, int(decision.seconds * 1000))) from exc
        why = error or exc
        log.error("%s: %s dead-lettered (%s): %s", self.actor_name, claim.key, decision.reason,
                  why)
        raise DeadLettered(f"{self.actor_name}: {claim.key}: {decision.reason}: {why}") from exc

    def _refuse(self, store: Any, key: str, exc: BaseException, message: Any,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
        """Refuse a message whose values the store can never take: a dead letter of kind
        ``message`` (there is no run row), logged at ERROR, then :class:`DeadLettered`
        (Dramatiq fails the message). Store unreachable while recording: retried."""
        error = f"{type(exc).__name__}: {exc}"
        log.error("%s[%s]: refusing the message for key %.80r: %s", self.actor_name,
                  getattr(message, "message_id", None), key, error)
        payload = {"actor": self.actor_name, "task": self.actor_name, "key": key,
                   "task_id": getattr(message, "message_id", None),
                   "args": [repr(a)[:2000] for a in args],
                   "kwargs": {str(k): repr(v)[:2000] for k, v in kwargs.items()}}
        try:
            runs.record_refused_message(store, key=key, task=self.actor_name, payload=payload,
                                        error=error)
        except Exception as record_exc:
            raise dramatiq.Retry(delay=1000) from record_exc
        raise DeadLettered(f"{self.actor_name}: {key}: refused: {error}") from exc

    def _refuse_keyless(self, store: Any, exc: IdempotencyKeyError, message: Any,
                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
        """Refuse a message without an idempotency key (sent by ``broker.enqueue`` or a
        producer of another language, bypassing :meth:`message_with_options`): a dead
        letter of kind ``message``, reason ``no_key`` (not requeueable: the caller sends the
        work again with a key), logged at ERROR, then :class:`DeadLettered`. Store
        unreachable while recording: retried."""
        message_id = getattr(message, "message_id", None)
        log.error("refusing to run %s[%s]: no idempotency key", self.actor_name, message_id)
        error = (f"{exc}. The message was not run and is not retried. Fix: send it with a key "
                 f"(`{self.actor_name}.send_with_key(key, ...)`, the message option "
                 f"{OPTION}={{'key': key}}, or declare the actor with "
                 "idempotency_key=callable), then send the work again")
        payload = {"actor": self.actor_name, "task": self.actor_name,
                   "key": str(message_id or ""), "task_id": message_id,
                   "queue": getattr(message, "queue_name", self.queue_name),
                   "args": _stored(list(args), "args"), "kwargs": _stored(dict(kwargs), "kwargs"),
                   "options": _stored(dict(message.options) if message is not None else {},
                                      "options")}
        try:
            runs.record_refused_message(store, key=str(message_id or "?"),
                                        task=self.actor_name, payload=payload, error=error,
                                        reason="no_key")
        except Exception as record_exc:
            raise dramatiq.Retry(delay=1000) from record_exc
        raise DeadLettered(f"{self.actor_name}[{message_id}]: refused: {exc}") from exc

    def _payload(self, claim: runs.Claim, message: Any) -> dict[str, Any]:
        opts = dict((message.options.get(OPTION) or {}) if message is not None else {})
        opts["key"] = claim.key
        return {"actor": self.actor_name, "task": self.actor_name, "args": list(claim.args),
                "kwargs": dict(claim.kwargs or {}), "key": claim.key,
                "queue": self.queue_name, "options": {OPTION: opts}}


def _stored(value: Any, what: str) -> Any:
    """``value`` as the JSON a dead letter keeps, else its ``repr`` (cut to 2000)."""
    try:
        return rb_values.to_json_value(value, what)
    except ValueError:
        return {runs.UNSTORABLE: repr(value)[:2000]}


def _interrupts() -> tuple[type[BaseException], ...]:
    from dramatiq.middleware.shutdown import Shutdown
    from dramatiq.middleware.time_limit import TimeLimitExceeded

    return (TimeLimitExceeded, Shutdown)
