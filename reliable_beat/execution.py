"""The framework-neutral worker protocol shared by the Celery and Dramatiq adapters.

An adapter's idempotent task/actor does, per execution (design.md invariants 1, 5, 6, 8):
resolve the idempotency key -> :func:`reliable_beat.runs.claim_run` (lease + fence token) ->
map the claim outcome (:func:`claim_decision`) onto its framework's verbs -> run the body
under the process's :data:`_renewer` (one lease-renewer thread per process) -> complete the
run fenced (in the body's transaction, or right after it) -> :func:`classify` a failure and
turn the :class:`Decision` into a framework retry or a dead letter.

What lives here has no framework in it: per-process stores that survive ``fork``, the run
state of an execution, the lease renewer, the schema check, failure classification and the
retry delay. ``reliable_beat.celery.task`` (``IdempotentTask``) and
``reliable_beat.dramatiq`` (``IdempotentActor``) call it; neither Celery nor kombu is
imported here.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, OperationalError

from reliable_beat import handoff, outbox, runs, tracing
from reliable_beat import values as rb_values
from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store
from reliable_beat.errors import PermanentError, SchemaError, StaleFenceToken
from reliable_beat.policies import backoff_delay
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings
from reliable_beat.slots import format_fire_at

__all__ = [
    "PERMANENT_DEFAULTS",
    "RESULT_NOTE_KEY",
    "Decision",
    "LeaseRenewer",
    "RunOutbox",
    "RunState",
    "claim_decision",
    "classify",
    "complete_after_body",
    "failure_decision",
    "raise_if_schema_missing",
    "run_and_complete",
    "run_body",
    "storable_result",
    "store_for",
    "transient_defaults",
]

log = get_logger("reliable_beat.execution")

#: Exceptions a retry cannot fix (validation errors, wrong arguments): dead letter at once.
PERMANENT_DEFAULTS: tuple[type[BaseException], ...] = (ValueError, TypeError)


def transient_defaults(*extra: type[BaseException]) -> tuple[type[BaseException], ...]:
    """Exceptions retried by default: connection errors, timeouts, ``OSError``, SQLAlchemy
    ``OperationalError``/``DBAPIError``, redis connection errors (when redis is installed),
    plus ``extra`` (an adapter's broker errors)."""
    found: list[type[BaseException]] = [
        ConnectionError, TimeoutError, OSError, OperationalError, DBAPIError, *extra,
    ]
    try:
        import redis.exceptions

        found += [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


def classify(
    exc: BaseException,
    *,
    permanent: tuple[type[BaseException], ...] = PERMANENT_DEFAULTS,
    transient: tuple[type[BaseException], ...] = (),
    retry_unknown: bool = True,
) -> str:
    """``"permanent"`` or ``"transient"`` for an exception raised by a body.

    First match wins: :class:`PermanentError` -> permanent; ``permanent`` -> permanent;
    ``transient`` (default :func:`transient_defaults`) -> transient; anything else ->
    transient when ``retry_unknown`` (an unlisted transient error would otherwise be lost;
    the attempt budget bounds the cost of retrying a bug), else permanent.
    """
    if isinstance(exc, PermanentError):
        return "permanent"
    if isinstance(exc, permanent):
        return "permanent"
    if isinstance(exc, transient or transient_defaults()):
        return "transient"
    return "transient" if retry_unknown else "permanent"


@dataclass(frozen=True)
class Decision:
    """What an adapter must do with one execution; it maps ``verb`` onto its framework.

    Attributes:
        verb: ``run`` (run the body), ``return_stored`` (deduplicated: return ``result``,
            the stored one), ``skip`` (the run is dead: nothing runs, nothing is retried),
            ``retry_in`` (send the message again in ``seconds``: busy lease or a transient
            failure; for a failure it is recorded ``retrying``, unless :attr:`unrecorded`
            says the store could not take it), ``retry_unrecorded`` (the failure is final
            but its dead letter could not be written: send the message again in
            ``seconds`` so the next try records it, never drop it), ``dead`` (a dead
            letter is recorded; fail the message), ``fenced_out`` (a newer runner owns
            the run: fail, never retry).
        seconds: the delay of ``retry_in``, in seconds.
        result: the stored result of ``return_stored``.
        reason: a short human reason, for the log.
    """

    verb: str
    seconds: float = 0.0
    result: Any = None
    reason: str = ""
    #: ``retry_in`` / ``retry_unrecorded`` after the store could not record the failure:
    #: the error that prevented it (already logged).
    unrecorded: BaseException | None = None


def claim_run(store: Store, key: str, **kwargs: Any) -> runs.Claim:
    """:func:`reliable_beat.runs.claim_run`, recorded on the execution's span (tracing on): a
    ``reliable_beat.claim`` event with its outcome; the key, entry, slot, fence token and
    attempt as the span's attributes (:func:`reliable_beat.tracing.claimed`)."""
    if tracing.tracer() is None:
        return runs.claim_run(store, key, **kwargs)
    fire_at = kwargs.get("fire_at")
    slot = None if fire_at is None else format_fire_at(fire_at)
    try:
        claim = runs.claim_run(store, key, **kwargs)
    except BaseException:
        tracing.claimed(None, key=key, entry=kwargs.get("entry"), slot=slot)
        raise
    tracing.claimed(claim, key=key, entry=kwargs.get("entry"), slot=slot)
    return claim


def claim_decision(claim: runs.Claim, lease: timedelta, max_attempts: int) -> Decision:
    """The decision for a claim's outcome (before the body runs).

    ``succeeded`` -> ``return_stored``; ``dead`` -> ``skip`` (also a run the claim found
    malformed and dead-lettered, :attr:`reliable_beat.runs.Claim.malformed`); ``busy`` ->
    ``retry_in`` the holder's remaining lease + 0.5 s (not a try: the budget is untouched);
    an attempt over ``max_attempts`` (redelivered after crashes, a poison message) ->
    ``dead`` (the caller records it with
    ``runs.record_failure(..., dead_reason="exhausted", ran_body=False)``); otherwise ``run``.
    """
    if claim.outcome == runs.ALREADY_SUCCEEDED:
        return Decision("return_stored", result=claim.result, reason="already succeeded")
    if claim.outcome == runs.DEAD and claim.malformed is not None:
        return Decision("skip", reason=(
            f"run row is malformed ({claim.malformed}); dead-lettered (reason malformed): "
            "repair it from the dead letter's payload and requeue it"))
    if claim.outcome == runs.DEAD:
        return Decision("skip", reason="run is dead (requeue it to run again)")
    if claim.outcome == runs.BUSY:
        wait = (claim.retry_after or lease).total_seconds() + 0.5
        return Decision("retry_in", seconds=wait, reason="busy: leased by another runner")
    if claim.attempt > max_attempts:
        return Decision("dead", reason=(
            f"attempt budget exhausted: {claim.attempt - 1} tries ran the body (the worker "
            "died during them)"))
    return Decision("run")


def failure_decision(
    store: Store, claim: runs.Claim, exc: BaseException, kind: str, **kwargs: Any,
) -> Decision:
    """:func:`decide_failure` in a span named by what it recorded (tracing on):
    ``reliable_beat.retry`` or ``reliable_beat.dead_letter`` (``reliable_beat.fenced_out`` when
    the fence moved), with the failure recorded redacted."""
    if tracing.tracer() is None:
        return decide_failure(store, claim, exc, kind, **kwargs)
    with tracing.span("reliable_beat.failure", attributes=tracing.attributes(
            key=claim.key, attempt=claim.attempt, fence_token=claim.fence_token)) as s:
        tracing.record_error(s, exc, status=False)
        decision = decide_failure(store, claim, exc, kind, **kwargs)
        name, outcome = _FAILURE_SPANS.get(decision.verb, ("reliable_beat.failure",
                                                           decision.verb))
        s.update_name(name)
        s.set_attribute(tracing.OUTCOME, outcome)
        tracing.annotate({tracing.OUTCOME: outcome})
        s.set_attribute("reliable_beat.retry_in_seconds", decision.seconds)
        return decision


#: failure_decision's span name and outcome per verb
_FAILURE_SPANS = {
    "retry_in": ("reliable_beat.retry", "retrying"),
    "retry_unrecorded": ("reliable_beat.retry", "retrying_unrecorded"),
    "dead": ("reliable_beat.dead_letter", "dead"),
    "fenced_out": ("reliable_beat.fenced_out", "fenced_out"),
}


def decide_failure(
    store: Store, claim: runs.Claim, exc: BaseException, kind: str, *,
    max_attempts: int, payload: dict[str, Any], delay: float | None = None,
    base_seconds: float = 1.0, cap_seconds: float = 300.0, task_name: str = "",
    logger: logging.Logger | None = None, error: str | None = None,
) -> Decision:
    """Record a body failure of kind ``kind`` (:func:`classify`) and decide what follows.

    Transient with attempts left: recorded ``retrying`` with the retry delay ``delay``
    (seconds; default full jitter ``uniform(0, min(cap, base * 2**(attempt-1)))``) ->
    ``retry_in``. Permanent or out of attempts (counted in the database, crashes included):
    a dead letter with ``payload`` -> ``dead``. A fence that moved meanwhile ->
    ``fenced_out``. Never raises for an unreachable store (invariant 8: never drop the work
    silently): a transient failure that could not be recorded is still ``retry_in`` (with
    :attr:`Decision.unrecorded`); a dead letter that could not be written is
    ``retry_unrecorded`` (the next try records it). Both are logged at ERROR on ``logger``.
    ``error``: the text recorded for the try (default ``exc``'s type, message and
    traceback), e.g. for a retry the body asked for, which is not an error.
    """
    logger = logger or log
    if delay is None:
        delay = backoff_delay(claim.attempt - 1, base=base_seconds, cap=cap_seconds)
    error = runs.format_error(exc) if error is None else error
    if kind == "transient" and claim.attempt < max_attempts:
        try:
            outcome = runs.record_failure(store, claim, error, retry_in_seconds=delay)
        except Exception as record_exc:
            logger.exception("%s: could not record the failure of %s", task_name, claim.key)
            return Decision("retry_in", seconds=delay, unrecorded=record_exc,
                            reason=f"{type(exc).__name__}: transient (not recorded)")
        if outcome == "fenced_out":
            return Decision("fenced_out", reason="fence moved")
        return Decision("retry_in", seconds=delay, reason=f"{type(exc).__name__}: transient")
    reason = "permanent" if kind == "permanent" else "exhausted"
    try:
        outcome = runs.record_failure(store, claim, error, dead_reason=reason, payload=payload)
    except Exception as record_exc:
        # The store is unreachable, so the dead letter cannot be written. Never drop the
        # work silently (invariant 8): send it again; the next try records it.
        logger.exception("%s: could not dead-letter %s; retrying", task_name, claim.key)
        return Decision("retry_unrecorded", seconds=delay, unrecorded=record_exc,
                        reason=f"{reason}: dead letter not recorded")
    if outcome == "fenced_out":
        return Decision("fenced_out", reason="fence moved")
    return Decision("dead", reason=reason)


def run_body(state: RunState, body: Callable[[], Any]) -> Any:
    """Run ``body()`` with ``state``'s lease renewed by the process's renewer; returns what
    it returns (exceptions propagate). The renewal stops when the body ends, or earlier when
    its ``transaction()`` begins the completion."""
    r = renewer()
    r.add(state)
    try:
        return body()
    finally:
        r.discard(state)


def run_and_complete(state: RunState, body: Callable[[], Any], *,
                     logger: logging.Logger | None = None) -> Any:
    """:func:`run_body` then :func:`complete_after_body`: the happy path of an execution.

    Returns:
        What ``body()`` returned.

    Raises:
        StaleFenceToken: see :func:`complete_after_body`; anything ``body()`` raises.
    """
    result = run_body(state, body)
    complete_after_body(state, result, logger=logger)
    return result


def complete_after_body(state: RunState, result: Any, *,
                        logger: logging.Logger | None = None) -> None:
    """The completion after a body returned ``result`` (shared by the adapters).

    When the body completed the run in its own ``transaction()`` (the effect committed with
    the key), the run succeeded whatever happens now: the result, unless one was declared
    inside the transaction, is stored best effort (logged on failure, never raised).
    Otherwise the run is completed fenced (``succeeded`` with the result) in a transaction
    of its own.

    Raises:
        StaleFenceToken: the fence moved before the completion (a newer runner owns the
            run); the attempt is recorded ``fenced_out``.
    """
    claim, store = state.claim, state.store
    stored = storable_result(state.task_name, claim.key, result)
    if state.completed:
        if state.transaction_used and result is not None and state.returned is None \
                and claim.key.startswith("wf:"):
            # a workflow activity: its outcome went into the workflow's history in the
            # completing transaction (without a result); storing this value on the run row
            # now cannot change what the workflow got (the history is final once committed)
            (logger or log).warning(
                "%s: %s is a workflow activity that returned a value after its "
                "self.transaction() block without declaring it: the workflow gets None. "
                "Call self.returns(value) inside the transaction (the result is then "
                "committed with the effect)", state.task_name, claim.key)
        if state.transaction_used and stored is not None and state.returned is None:
            try:
                if state.write_result is not None:
                    state.write_result(stored)
                else:
                    runs.set_result(store, claim, stored)
            except Exception:
                (logger or log).exception("%s: %s succeeded; its result could not be stored",
                                          state.task_name, claim.key)
        return
    with tracing.completion():
        try:
            # a workflow activity's wake is published right after the commit (handoff)
            with handoff.after_commit(store), store.begin() as conn:
                runs.complete(conn, claim, stored)
        except StaleFenceToken:
            runs.record_fenced_out(store, claim)
            raise
    state.completed = True


#: The key of the note stored instead of a result that cannot be stored as JSON.
RESULT_NOTE_KEY = "reliable_beat_unstored_result"


def storable_result(task_name: str, key: str, result: Any) -> Any:
    """``result`` as a JSON value for the runs table, or a note ``{RESULT_NOTE_KEY: why}``
    (logged) when it cannot be stored: the body returned, so the run succeeded anyway."""
    try:
        return rb_values.to_json_value(result, "result")
    except ValueError as exc:
        note = f"the result ({type(result).__name__}) could not be stored as JSON: {exc}"
        log.warning("%s: %s: %s; storing a note instead", task_name, key, note)
        return {RESULT_NOTE_KEY: note}


# ------------------------------------------------- moved from reliable_beat/celery/task.py ----

def raise_if_schema_missing(store: Store, exc: BaseException, task: str, key: str) -> None:
    """A store whose reliable_beat schema is missing or behind is a permanent error.
    A database error that is not a lost connection (e.g. ``no such table:
    reliable_beat_runs``) is checked against the schema's revision; retrying cannot create
    tables, so the task fails at once with :class:`SchemaError` logged at CRITICAL instead of
    retrying forever.

    Raises:
        SchemaError: the schema is missing or behind (``__cause__`` is ``exc``).
    """
    if not isinstance(exc, DBAPIError) or exc.connection_invalidated:
        return
    try:
        revision = migrate.current(store)
        if revision == migrate.head():
            return
    except Exception:  # the check itself failed: leave it to the retry path
        return
    what = "has no reliable_beat schema" if revision is None else (
        f"has reliable_beat schema {revision}, not {migrate.head()}")
    message = (
        f"{task}: run {key} refused: the store {store.safe_url} {what}: run `reliable-beat "
        "db upgrade` against it, or point reliable_beat_database_url at the store the beat "
        f"uses ({str(getattr(exc, 'orig', exc)).splitlines()[0]})"
    )
    log.critical("%s", message)
    raise SchemaError(message) from exc


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


def store_for(url: str) -> Store:
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

#: ``_current.states``: id(task) -> the RunState of the execution running in this thread.
_current = threading.local()


@dataclass(eq=False)  # hashed by identity: a member of the renewer's set
class RunState:
    claim: runs.Claim
    store: Store
    lease: timedelta
    task_name: str = ""
    lease_lost: bool = False
    completed: bool = False
    transaction_used: bool = False
    outbox_count: int = 0
    #: the JSON result declared with self.returns() (stored by the completing transaction)
    returned: Any = None
    #: Stores the result of a run completed in the body's transaction (None: at once, on
    #: the store); set by a transaction joined to an outer one (Django's ``atomic()``).
    write_result: Callable[[Any], None] | None = None
    #: time.monotonic() of the next lease renewal (set by LeaseRenewer.add).
    renew_at: float = 0.0


class RunOutbox:
    """The outbox of a running body: ``self.outbox`` of an ``IdempotentTask``,
    ``current().outbox`` of an ``IdempotentActor``.

    Each :meth:`add` writes a row in the body's transaction, stamped with the run
    (``run_id``), checked against the settings' ``max_payload_bytes`` and
    ``outbox_handlers``, and keyed by the run's idempotency key.

    Args:
        state: returns the run state of the execution the body runs in, read at each
            :meth:`add` (the Celery task looks it up per thread and raises ``RuntimeError``
            outside an execution; a Dramatiq run context holds its own).
        settings: returns the settings of the task or actor, read at each :meth:`add`.
    """

    def __init__(self, state: Callable[[], RunState], settings: Callable[[], Settings]) -> None:
        self._state = state
        self._settings = settings

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
        order produces the same message ids, and the far end can deduplicate. ``delay`` in
        seconds (a number) or a ``timedelta``.

        Returns:
            The outbox message id.
        """
        state = self._state()
        state.outbox_count += 1
        settings = self._settings()
        # The writer is looked up at each add, as sys.modules holds it then (a test may stand
        # a stub module in for reliable_beat.outbox, as the Celery task always allowed).
        add: Callable[..., str] = importlib.import_module(outbox.__name__).add
        return add(
            tx,
            destination,
            payload,
            key=key or f"{state.claim.key}#{state.outbox_count}",
            headers=headers,
            delay=timedelta(seconds=delay) if isinstance(delay, (int, float)) else delay,
            ordering_key=ordering_key,
            run_id=state.claim.run_id,
            max_bytes=settings.max_payload_bytes,
            handlers=settings.outbox_handlers,
        )


def _renew_interval(state: RunState) -> float:
    """Seconds between renewals of ``state``'s lease: a third of the lease (>= 0.05 s)."""
    return max(state.lease.total_seconds() / 3.0, 0.05)


class LeaseRenewer:
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
        self._states: set[RunState] = set()
        #: When the thread will next look (monotonic); None while it waits for work.
        self._wake_at: float | None = None
        self._thread: threading.Thread | None = None

    def add(self, state: RunState) -> None:
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

    def discard(self, state: RunState) -> None:
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

    def _renew(self, state: RunState) -> None:
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


_renewer = LeaseRenewer()


def _new_renewer_after_fork() -> None:
    """In a forked child: the parent's renewer thread does not exist here; start afresh.

    Reset in place (not rebound), so every module that imported ``_renewer`` sees it."""
    _renewer.__init__()  # type: ignore[misc]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_renewer_after_fork)


#: The names these helpers had when they lived in ``reliable_beat.celery.task``, still
#: imported by the Celery adapter (and ``_store_for`` patched by its tests).
_store_for = store_for
_RunState = RunState
_LeaseRenewer = LeaseRenewer
_raise_if_schema_missing = raise_if_schema_missing


def renewer() -> LeaseRenewer:
    """This process's lease renewer (one thread serving every execution in flight)."""
    return _renewer
