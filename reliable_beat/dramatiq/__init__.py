"""The Dramatiq adapter: ``ReliableBeat`` middleware, ``IdempotentActor``, periodic entries,
a trigger publisher for the core :class:`~reliable_beat.loop.BeatLoop`, and a ``dramatiq``
outbox destination handler. See ``docs/dramatiq.md``.

::

    broker = RedisBroker(url="redis://...")
    broker.add_middleware(ReliableBeat(settings={"database_url": "postgresql+psycopg://..."}))
    dramatiq.set_broker(broker)     # before any actor module is imported

    @dramatiq.actor(actor_class=IdempotentActor, periodic="0 2 * * *")
    def pay_merchants():
        rb = current()
        with rb.transaction() as tx:
            tx.execute(insert(payouts).values(run_id=rb.run_id))
            rb.outbox.add(tx, "webhook", {...})

The worker protocol is the core's (:mod:`reliable_beat.execution`): key -> claim (lease +
fence) -> body under the process's lease renewer -> fenced completion -> classification.
Retries are decided by us and counted in the database (``dramatiq.Retry(delay=ms)``);
Dramatiq's own retry counter is switched off on idempotent actors (``max_retries=None``).
A permanent failure or an exhausted budget is a dead letter in ``reliable_beat_dead_letters``
and the message is failed (``throws``: Dramatiq nacks it to ``<queue>.XQ``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NoReturn

import dramatiq
from dramatiq.middleware import Middleware
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, IntegrityError

from reliable_beat import execution, joins, runs, slots, tracing
from reliable_beat import values as rb_values
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
from reliable_beat.outbox import OutboxMessage
from reliable_beat.policies import backoff_delay
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings

__all__ = [
    "OPTION",
    "TRIGGER_DESTINATION",
    "DeadLettered",
    "DramatiqHandler",
    "DramatiqPublisher",
    "IdempotentActor",
    "ReliableBeat",
    "RunContext",
    "beat_loop",
    "current",
    "definitions",
    "rabbitmq_url",
    "record_skipped_message",
    "requeue_dead_letter",
]

log = get_logger("reliable_beat.dramatiq")

#: The outbox destination of Dramatiq triggers (a member of beat.TRIGGER_DESTINATIONS).
TRIGGER_DESTINATION = "dramatiq"
#: The message option carrying ``{"key", "entry", "fire_at", "trigger"}``; survives retries.
OPTION = "reliable_beat"
#: Actor options our middleware declares (Dramatiq refuses undeclared ones at decoration).
ACTOR_OPTIONS = frozenset({
    "periodic", "periodic_name", "reliable_beat", "idempotency_key", "lease_seconds",
    "max_attempts",
})

#: Entry publish options of Celery's message that a Dramatiq trigger has no field for
#: (:func:`definitions` refuses them, naming the entry).
CELERY_ONLY_OPTIONS = frozenset({"routing_key", "exchange", "serializer", "priority", "headers"})

_message: ContextVar[Any] = ContextVar("reliable_beat_dramatiq_message", default=None)
_run: ContextVar[RunContext | None] = ContextVar("reliable_beat_dramatiq_run", default=None)


class DeadLettered(Exception):
    """Raised after a dead letter was recorded: listed in ``throws``, so Dramatiq fails the
    message (no retry) and its broker keeps it in ``<queue>.XQ``."""


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
    from sqlalchemy import update

    from reliable_beat.db.tables import runs as runs_table

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


# ----------------------------------------------------------------- the worker side ----

@dataclass
class RunContext:
    """The run an :class:`IdempotentActor` body executes (``current()``).

    Attributes:
        state: the core run state (claim, lease, flags).
        settings: the middleware's settings.
    """

    state: execution.RunState
    settings: Settings
    _outbox: execution.RunOutbox | None = field(default=None, repr=False)

    @property
    def idempotency_key(self) -> str:
        return self.state.claim.key

    @property
    def run_id(self) -> int:
        """``reliable_beat_runs.id``; stamp it on every row the body writes."""
        return self.state.claim.run_id

    @property
    def fence_token(self) -> int:
        """This runner's fence token; stamp it on writes to other stores to fence them."""
        return self.state.claim.fence_token

    @property
    def attempt(self) -> int:
        """This try's number (1 = first), counted in the database, crashes included."""
        return self.state.claim.attempt

    @property
    def lease_lost(self) -> bool:
        """True once a renewal found the fence moved: the commit will be rejected."""
        return self.state.lease_lost

    @property
    def outbox(self) -> execution.RunOutbox:
        """``current().outbox.add(tx, destination, payload, ...)``: see
        :class:`~reliable_beat.execution.RunOutbox`."""
        if self._outbox is None:
            self._outbox = execution.RunOutbox(lambda: self.state, lambda: self.settings)
        return self._outbox

    @contextmanager
    def transaction(self, *, using: str | None = None) -> Iterator[Connection]:
        """One transaction on the store's database for the body's effect; leaving the block
        marks the run ``succeeded`` (fenced) in it and commits: effect, outbox rows and key
        together or not at all. Use it once per execution.

        Args:
            using: a Django database alias: the block is ``transaction.atomic(using=using)``
                on Django's own connection (its database must be the store's), so ORM
                writes in it commit with the key. In a Django project with
                ``reliable_beat.contrib.django`` installed it defaults to the alias whose
                database is the store's, and a write on any other Django connection inside
                the block raises ``ConfigurationError`` naming ``using=`` (``docs/django.md``).

        Raises:
            StaleFenceToken: the fence moved (a newer runner owns the run); everything
                rolled back, the attempt is recorded ``fenced_out``.
            ConfigurationError: ``using`` names another database than the store's, or
                (Django) an ORM write on another connection inside the block.
            RuntimeError: used twice in one execution.
        """
        state = self.state
        if state.transaction_used:
            raise RuntimeError(f"{state.task_name}: transaction() may be used once per run")
        state.transaction_used = True
        join = joins.registered()  # Django's, when the app is installed
        if using is None and join is not None:
            using = join.default_alias(state.store)  # the store is this Django database
        if using is not None:
            join = joins.for_using(using, f"{state.task_name}: current().transaction")
        try:
            opened = join.atomic(using) if join is not None and using is not None \
                else state.store.begin()
            with opened as conn:
                joins.check_same_database(conn.engine, state.store)
                with joins.guard(join, using, where="current().transaction",
                                 task_name=state.task_name, store=state.store):
                    yield conn
                execution.renewer().discard(state)
                runs.complete(conn, state.claim, None)
        except StaleFenceToken:
            runs.record_fenced_out(state.store, state.claim)
            raise
        if join is not None and using is not None:
            state.write_result = join.result_writer(using, state.store, state.claim)
        state.completed = True


def current() -> RunContext:
    """The run of the :class:`IdempotentActor` body executing in this context.

    Raises:
        RuntimeError: not inside an IdempotentActor execution.
    """
    ctx = _run.get()
    if ctx is None:
        raise RuntimeError("reliable_beat.dramatiq.current(): not inside an IdempotentActor")
    return ctx


def _parse_instant(value: Any, what: str = "fire_at") -> datetime | None:
    """A trigger's instant: :func:`reliable_beat.slots.parse_fire_at` (no zone: UTC)."""
    return slots.parse_fire_at(value, what)


class IdempotentActor(dramatiq.Actor):  # type: ignore[misc,type-arg]
    """``@dramatiq.actor(actor_class=IdempotentActor, ...)``: the twin of ``IdempotentTask``.

    Key, in order: the message option ``reliable_beat["key"]`` (the beat, a requeue,
    :meth:`send_with_key`), else the actor option ``idempotency_key`` (a string, or a callable
    of the call's arguments returning one). Neither -> :class:`IdempotencyKeyError` (nothing
    runs, the message is failed). Never a random key.

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
        """Dramatiq's, without the message options that would drop our retries
        (``max_retries``, ``throws``: a WARNING names them)."""
        drop_message_options(self.actor_name, options, where="when the message was built")
        return super().message_with_options(args=args, kwargs=kwargs, **options)

    def send_with_key(self, key: str, *args: Any, **kwargs: Any) -> Any:
        """``send(*args, **kwargs)`` under the explicit idempotency ``key``."""
        options: dict[str, Any] = {OPTION: {"key": key}}
        return self.send_with_options(args=args, kwargs=kwargs, **options)

    def _resolve_key(self, message: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        opts = (message.options.get(OPTION) or {}) if message is not None else {}
        key = opts.get("key")
        if not key:
            derive = self.options.get("idempotency_key")
            key = derive(*args, **kwargs) if callable(derive) else derive
        if not key:
            raise IdempotencyKeyError(
                f"{self.actor_name}[{getattr(message, 'message_id', None)}]: no idempotency key "
                f"(no {OPTION}['key'] message option, no idempotency_key actor option); "
                "refusing to run: use send_with_key(key, ...) or idempotency_key=callable")
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
        key = self._resolve_key(message, args, kwargs)
        opts = (message.options.get(OPTION) or {}) if message is not None else {}
        store = execution.store_for(settings.database_url)
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

    def _payload(self, claim: runs.Claim, message: Any) -> dict[str, Any]:
        opts = dict((message.options.get(OPTION) or {}) if message is not None else {})
        opts["key"] = claim.key
        return {"actor": self.actor_name, "task": self.actor_name, "args": list(claim.args),
                "kwargs": dict(claim.kwargs or {}), "key": claim.key,
                "queue": self.queue_name, "options": {OPTION: opts}}


def _interrupts() -> tuple[type[BaseException], ...]:
    from dramatiq.middleware.shutdown import Shutdown
    from dramatiq.middleware.time_limit import TimeLimitExceeded

    return (TimeLimitExceeded, Shutdown)


def _broker_errors() -> tuple[type[BaseException], ...]:
    import dramatiq.errors as errors

    # dramatiq >= 2.1 renamed ConnectionError to BrokerConnectionError (the old name warns).
    if hasattr(errors, "BrokerConnectionError"):
        return (errors.BrokerConnectionError,)
    return (errors.ConnectionError,)  # pragma: no cover (dramatiq < 2.1)


# ------------------------------------------------------------- the publishing side ----

def message_for_trigger(broker: Any, payload: Mapping[str, Any]) -> Any:
    """The ``dramatiq.Message`` of a trigger payload
    (:func:`reliable_beat.beat.build_trigger_payload`, either shape: the neutral one with
    ``message_id`` and a ``reliable_beat`` object, or the Celery-shaped one of rows written
    before it, ``task_id`` and ``reliable_beat_*`` headers): ``message_id`` = the run's
    deterministic id, ``options["reliable_beat"]`` = key / entry / fire_at / trigger,
    ``queue_name`` from the actor (or ``options.queue``).

    Raises:
        KeyError: the actor is not registered on ``broker`` and no queue is given.
    """
    from reliable_beat.triggers import trigger_identity

    identity = trigger_identity(payload)
    options = dict(payload.get("options") or {})
    actor_name = str(payload["task"])
    queue = options.pop("queue_name", None) or options.pop("queue", None)
    if queue is None:
        queue = broker.get_actor(actor_name).queue_name
    message_options: dict[str, Any] = {OPTION: {
        "key": identity["key"], "entry": identity["entry"], "fire_at": identity["fire_at"],
        "trigger": identity["trigger"],
    }}
    traceparent = (payload.get("reliable_beat") or {}).get(tracing.TRACEPARENT)
    if isinstance(traceparent, str):  # the slot's trace (reliable_beat.tracing)
        message_options[tracing.TRACEPARENT] = traceparent
    extra: dict[str, Any] = {}
    fire_at = _parse_instant(identity["fire_at"])
    expires_at = _parse_instant(payload.get("expires_at"), "expires_at")
    if fire_at is not None and expires_at is not None:
        # ``expires`` counts from the slot, as for Celery entries: AgeLimit measures from
        # message_timestamp, so a delivery later than slot + expires is skipped (its run is
        # then retired as skipped/expired by the re-dispatch sweep, which will not re-send it).
        extra["message_timestamp"] = int(fire_at.timestamp() * 1000)
        message_options["max_age"] = max(1, int((expires_at - fire_at).total_seconds() * 1000))
    return dramatiq.Message(
        queue_name=queue, actor_name=actor_name, args=tuple(payload.get("args") or ()),
        kwargs=dict(payload.get("kwargs") or {}), options=message_options, **extra,
        message_id=str(payload.get("message_id") or payload.get("task_id") or uuid.uuid4()),
    )


def _publish_errors(exc: Exception) -> Exception:
    from reliable_beat.handlers import DestinationUnavailableError

    transient: tuple[type[BaseException], ...] = (*_broker_errors(), ConnectionError, OSError)
    try:
        import redis.exceptions

        transient += (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, transient):
        return DestinationUnavailableError(f"dramatiq broker unreachable: {exc!r}")
    return exc


@dataclass
class DramatiqPublisher:
    """The core loop's :class:`~reliable_beat.loop.HoldingPublisher` for a Dramatiq broker:
    one ``dramatiq.Message`` per trigger row (:func:`message_for_trigger`), enqueued on the
    broker; an expired trigger is :class:`~reliable_beat.handlers.MessageExpiredError`, an
    unreachable broker :class:`~reliable_beat.handlers.DestinationUnavailableError`."""

    broker: Any
    destination: str = TRIGGER_DESTINATION

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        """Enqueue trigger rows now (see :meth:`publish_at`)."""
        return self.publish_at(messages, now, lambda: None)

    def publish_at(self, messages: Sequence[OutboxMessage], now: datetime,
                   wait: Callable[[], None]) -> list[tuple[int, BaseException | None]]:
        """Build every message first, call ``wait()`` (the core loop sleeps there until the
        slot of triggers it claimed ahead), then enqueue them back to back. A ``wait`` that
        raises abandons the batch before anything was enqueued."""
        from reliable_beat.handlers import MessageExpiredError

        built: list[tuple[int, Any]] = []
        out: dict[int, BaseException | None] = {}
        for m in messages:
            try:
                payload = m.payload if isinstance(m.payload, Mapping) else {}
                expires_at = _parse_instant(payload.get("expires_at"), "expires_at")
                if expires_at is not None and now >= expires_at:
                    raise MessageExpiredError(f"{m.message_id}: expired at {expires_at}")
                built.append((m.id, message_for_trigger(self.broker, payload)))
            except Exception as exc:  # expired, or no such actor: this message only
                out[m.id] = _publish_errors(exc)
        wait()
        for outbox_id, message in built:
            try:
                self.broker.enqueue(message)
                out[outbox_id] = None
            except Exception as exc:
                out[outbox_id] = _publish_errors(exc)
        return [(m.id, out[m.id]) for m in messages]

    def tracked_tasks(self) -> Collection[str]:
        return sorted(n for n, a in self.broker.actors.items() if isinstance(a, IdempotentActor))

    def queue_depths(self, messages: Sequence[OutboxMessage]) -> list[tuple[str, int | None]]:
        """Ready messages in each trigger's queue, for the re-dispatch sweep's backlog check
        (:func:`reliable_beat.dramatiq.backlog.queue_depths`)."""
        from reliable_beat.dramatiq.backlog import queue_depths

        return queue_depths(self.broker, messages)


class DramatiqHandler:
    """Outbox handler of destination ``dramatiq`` (application messages) and of the beat's
    Dramatiq triggers: payload ``{"actor", "args"?, "kwargs"?, "queue"?, "delay_ms"?,
    "options"?}`` or a trigger payload; ``message_id`` = uuid5 of the outbox message id, so a
    re-delivery by the relay carries the same id.
    """

    def __init__(self, broker: Any = None) -> None:
        self.broker = broker or dramatiq.get_broker()

    def __call__(self, message: OutboxMessage) -> None:
        payload = message.payload if isinstance(message.payload, Mapping) else {}
        try:
            if "actor" not in payload:  # a beat's trigger
                self.broker.enqueue(message_for_trigger(self.broker, payload))
                return
            actor = str(payload["actor"])
            queue = payload.get("queue") or self.broker.get_actor(actor).queue_name
            options = dict(payload.get("options") or {})
            options["reliable_beat_message_id"] = message.message_id
            msg: Any = dramatiq.Message(
                queue_name=queue, actor_name=actor, args=tuple(payload.get("args") or ()),
                kwargs=dict(payload.get("kwargs") or {}), options=options,
                message_id=str(uuid.uuid5(uuid.NAMESPACE_URL,
                                          "reliable_beat:" + message.message_id)))
            self.broker.enqueue(msg, delay=payload.get("delay_ms"))
        except Exception as exc:
            raise _publish_errors(exc) from exc


def rabbitmq_url(url: str) -> str:
    """An ``amqp://`` URL as pika (Dramatiq's ``RabbitmqBroker``) reads it.

    Celery/kombu write the default vhost ``/`` as a trailing ``//``
    (``amqp://guest@host:5672//``); pika reads that path as the vhost ``""`` and RabbitMQ
    refuses the connection (``NOT_ALLOWED - vhost  not found``). This returns the same URL
    with the vhost spelled ``%2F``; any other URL is returned unchanged.
    """
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme.startswith("amqp") and parts.path == "//":
        return urlunsplit(parts._replace(path="/%2F"))
    return url


def requeue_dead_letter(broker: Any, store: Any, dead_letter_id: int, *, by: str,
                        force: bool = False, queue: str | None = None) -> dict[str, Any]:
    """Run a dead Dramatiq run again under the SAME idempotency key, through ``broker``.

    :func:`reliable_beat.runs.requeue_dead_letter` resets the run (``scheduled``, a fresh
    attempt budget, the dead letter marked requeued by ``by``), then a new message is
    enqueued for the dead letter's actor with ``options["reliable_beat"]["key"]`` = the
    run's key (a fresh ``message_id``: Dramatiq's own dead letter of the old message stays
    in ``<queue>.XQ``), and the run is marked ``dispatched``. Sending fails -> the requeue
    is undone (the run stays ``dead``) and the error raised.

    Args:
        broker: the app's Dramatiq broker (the actor need not be declared on it when the
            dead letter names its queue).
        store: the store.
        dead_letter_id: ``reliable_beat_dead_letters.id`` of a run dead letter written by
            an :class:`IdempotentActor` (its payload has ``actor``).
        by: who decided (recorded in ``requeued_by``).
        force: requeue even if it was requeued before.
        queue: send to this queue (default: the queue the run died on).

    Returns:
        ``{"dead_letter", "actor", "key", "queue", "message_id", "by"}``.

    Raises:
        reliable_beat.runs.DeadLetterNotFound: no such run dead letter.
        ValueError: not a Dramatiq actor's dead letter, already requeued (without
            ``force``), the run is not dead, or its effect committed.
        Exception: the broker refused the message (the run stays dead).
    """
    dl = runs.get_dead_letter(store, dead_letter_id)
    payload = dl.get("payload") or {}
    if dl.get("kind") != "run" or not isinstance(payload, Mapping) or "actor" not in payload:
        raise ValueError(
            f"dead letter {dead_letter_id} is not a Dramatiq actor's run dead letter (kind "
            f"{dl.get('kind')!r}); Celery tasks: `reliable-beat -A APP dead-letters requeue`")
    runs.requeue_dead_letter(store, dead_letter_id, by=by, force=force)
    key = str(payload["key"])
    actor = str(payload["actor"])
    try:
        target = queue or payload.get("queue") or broker.get_actor(actor).queue_name
        options = dict(payload.get("options") or {})
        rb = dict(options.get(OPTION) or {})
        rb["key"] = key
        options[OPTION] = rb
        msg: Any = dramatiq.Message(
            queue_name=target, actor_name=actor, args=tuple(payload.get("args") or ()),
            kwargs=dict(payload.get("kwargs") or {}), options=options)
        broker.enqueue(msg)
    except Exception:
        runs.undo_requeue(store, dead_letter_id)
        raise
    runs.mark_dispatched(store, key)
    log.warning("dead letter %s requeued by %s: %s under key %s (message %s)", dead_letter_id,
                by, actor, key, msg.message_id)
    return {"dead_letter": dead_letter_id, "actor": actor, "key": key, "queue": target,
            "message_id": msg.message_id, "by": by}


# ------------------------------------------------------------------ periodic entries ----

def definitions(broker: Any, schedule: Mapping[str, Any] | None = None, *,
                now: datetime, settings: Settings) -> list[Any]:
    """The entry definitions of ``broker``'s actors declared with ``periodic=`` plus a
    ``BEAT_SCHEDULE`` mapping (``"actor"`` for Celery's ``"task"``), validated like Celery's
    ``beat_schedule`` (:func:`reliable_beat.entries.definition_from_celery`).

    Raises:
        ConfigurationError: every bad entry, each named, in one error.
    """
    from reliable_beat.entries import definition_from_celery

    def is_idempotent(name: str) -> bool | None:
        actor = broker.actors.get(name)
        return None if actor is None else isinstance(actor, IdempotentActor)

    raw: dict[str, dict[str, Any]] = {}
    for name, actor in sorted(broker.actors.items()):
        periodic = actor.options.get("periodic")
        if periodic is None:
            continue
        item: dict[str, Any] = {"task": name, "schedule": periodic}
        if actor.options.get("reliable_beat"):
            item["reliable_beat"] = actor.options["reliable_beat"]
        raw[str(actor.options.get("periodic_name") or name)] = item
    for name, spec in (schedule or {}).items():
        item = dict(spec)
        if "actor" in item:
            item["task"] = item.pop("actor")
        raw[name] = item
    out: list[Any] = []
    problems: list[str] = []
    for name, item in raw.items():
        opts = item.get("options")
        celery_only = sorted(set(opts if isinstance(opts, Mapping) else ()) & CELERY_ONLY_OPTIONS)
        if celery_only:
            # a Dramatiq message has no such field: refused, never silently dropped
            problems.append(
                f"{name}: publish option(s) {', '.join(map(repr, celery_only))} are Celery "
                "message fields a Dramatiq trigger cannot carry; remove them (a Dramatiq "
                "entry's options: queue, expires)")
            continue
        try:
            out.append(definition_from_celery(
                name, item, default_timezone="UTC", settings=settings, now=now,
                is_idempotent=is_idempotent))
        except (ConfigurationError, ValueError, TypeError) as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        raise ConfigurationError("bad Dramatiq periodic entries: " + "; ".join(problems))
    return out


def sync_entries(broker: Any, store: Any, settings: Settings,
                 schedule: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Validate and sync the broker's periodic entries into the store (config entries)."""
    from reliable_beat.entries import sync_config_entries
    from reliable_beat.outbox import db_now

    with store.begin() as conn:
        now = db_now(conn)
    from reliable_beat.groups import DEFAULT_GROUP

    # the group its BeatLoop fires (reliable_beat.loop.BeatLoop.schedule_group)
    return sync_config_entries(store, definitions(broker, schedule, now=now, settings=settings),
                               group=settings.schedule_group or DEFAULT_GROUP)


def beat_loop(broker: Any, store: Any = None) -> Any:
    """The core :class:`~reliable_beat.loop.BeatLoop` of a Dramatiq beat for ``broker``:
    its :class:`DramatiqPublisher`, its periodic entries (:func:`definitions`, synced by
    :meth:`~reliable_beat.loop.BeatLoop.start` into ``reliable_beat_schedule_group``, default
    ``default``), its idempotent actors tracked, logging as ``reliable_beat.loop``.

    Raises:
        ConfigurationError: the broker has no :class:`ReliableBeat` middleware.
    """
    from reliable_beat.db.dialects import Store
    from reliable_beat.loop import BeatLoop

    rb = _middleware(broker)
    settings = rb.settings
    if store is None:
        store = Store.from_url(settings.database_url, role="beat")

    def entries(now: datetime) -> list[Any]:
        return definitions(broker, rb.schedule, now=now, settings=settings)

    return BeatLoop(store, settings, DramatiqPublisher(broker), settings.owner,
                    definitions=entries, is_registered=lambda name: name in broker.actors)
