"""The workflow context: every durable call a workflow function makes goes through it.

Each durable call takes the next position (``seq``) in the run. A recorded position must
match the call's kind, name and argument digest (else :class:`NonDeterminismError`) and
answers from the history; the first unrecorded position (the frontier) is recorded in one
fenced transaction with whatever it dispatches; a call whose answer is not there yet raises
:class:`Suspend` and the advance ends, holding nothing.

Three kinds of step, three guarantees (docs/workflows.md):

* ``ctx.transaction(fn, *a)``: ``fn(conn, *a)`` runs inline inside the transaction that
  records it, fenced: **exactly once** for what ``fn`` writes through ``conn``.
* ``ctx.step(fn, *a)``: runs inline, then checkpoints its result: **at least once** (a crash
  between the body and the checkpoint runs it again); pass ``ctx.step_key`` to the far end.
* ``ctx.activity(task, *a)``: an ``IdempotentTask`` run keyed ``wf:<id>/<run>#<seq>``
  dispatched through the outbox; its completing transaction writes the result into the
  history with its effect.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import random as _random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError, OperationalError

from reliable_beat import joins, outbox, tracing, workflow_store
from reliable_beat.db.tables import runs, workflow_events, workflow_signals
from reliable_beat.outbox import db_now
from reliable_beat.redaction import get_logger
from reliable_beat.values import from_json_value
from reliable_beat.workflows import (
    children,
    continuation,
    crashes,
    history,
    lifecycle,
    limits,
    registry,
    runaway,
    tripwire,
    versioning,
)
from reliable_beat.workflows.errors import (
    ActivityError,
    CodeTimeout,
    EndWorkflow,
    FencedOut,
    NonDeterminismError,
    Suspend,
    WorkflowCancelled,
    WorkflowControl,
    WorkflowUsageError,
    WorkflowValueError,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from reliable_beat.db.dialects import Store
    from reliable_beat.workflows.saga import Saga

__all__ = ["ActivityHandle", "WorkflowContext", "WorkflowInfo", "current_context"]

_current: contextvars.ContextVar[WorkflowContext | None] = contextvars.ContextVar(
    "reliable_beat_workflow_context", default=None
)


def current_context() -> WorkflowContext | None:
    """The context of the workflow code running in this thread, if any."""
    return _current.get()


@dataclass(frozen=True)
class WorkflowInfo:
    """What the workflow code may know about itself (all replay-stable).

    Attributes:
        workflow_id: the business id; name: the registered name; run_no: the run.
        history_length: events recorded before this advance started.
        history_limit: the cap past which the workflow is blocked.
        position: the position (``seq``) the code has reached in this run.
        continue_as_new_suggested: ``position`` reached the definition's
            ``continue_as_new_after`` (replay-stable: it depends on the position only);
            call ``ctx.continue_as_new(...)`` at the next convenient point.
        version: the definition's ``version`` in this process (None if it declares none).
    """

    workflow_id: str
    name: str
    run_no: int
    history_length: int
    history_limit: int
    position: int = 0
    continue_as_new_suggested: bool = False
    version: str | None = None


@dataclass(frozen=True)
class ActivityHandle:
    """A started activity (``ctx.start_activity``): wait for it with ``ctx.wait_all`` /
    ``ctx.wait_any`` (or ``ctx.wait(handle)``)."""

    seq: int
    name: str
    key: str


class _ReplayFilter(logging.Filter):
    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__()
        self._ctx = ctx

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._ctx.is_replaying


def _callable_name(fn: Any, name: str | None) -> str:
    if name:
        return name
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_F = TypeVar("_F", bound=Callable[..., Any])

#: What a write on a framework connection inside ``ctx.transaction(fn)`` is told to do
#: instead (:mod:`reliable_beat.joins`): ``fn`` runs on the store's own connection.
_TRANSACTION_FIX = (
    "fn runs on the store's own connection (conn), not on Django's: write the effect "
    "through conn (SQLAlchemy), or in an activity whose body writes it in "
    "self.transaction() (it joins Django's connection when the store is a Django database)"
)


def _durable(method: _F) -> _F:
    """Engine code (and steps, transactions) run with the tripwire off and the code clock
    paused (a deadline that passed raises here: :mod:`reliable_beat.workflows.runaway`)."""

    @functools.wraps(method)
    def wrapper(self: WorkflowContext, *args: Any, **kwargs: Any) -> Any:
        timed = self._clock.pause()
        token = tripwire.in_workflow_code.set(False)
        try:
            return method(self, *args, **kwargs)
        except DBAPIError as exc:
            # the store failed under a durable call (connection lost, deadlock): not the
            # workflow's business; it must not be caught by its code nor recorded
            raise self._raise(_StoreTrouble(str(exc))) from exc
        finally:
            tripwire.in_workflow_code.reset(token)
            self._clock.resume(timed)

    return cast(_F, wrapper)


class WorkflowContext:
    """Passed as the first argument of a workflow function; see the module docstring.

    Not thread-safe by design: durable calls from a thread other than the advance's are
    refused (their positions would depend on scheduling).
    """

    def __init__(
        self, store: Store, claimed: history.Claimed, history: dict[int, Any],
        definition: registry.WorkflowDefinition, *, dry_run: bool = False,
        code_timeout: float | None = None,
    ) -> None:
        self._dry_run = dry_run  # offline replay: stop at the frontier, write nothing
        #: times the code between durable calls (None: no deadline); see runaway.py
        self._clock = runaway.CodeClock(code_timeout, claimed.workflow_id,
                                        on_stuck=self._park_stuck)
        self._store = store
        self._claimed = claimed
        self._history = history
        self._last_recorded = max(history) if history else 0
        self._definition = definition
        self._seq = 0
        self._thread = threading.get_ident()
        self._pending: WorkflowControl | None = None
        self._in_step = False
        self._step_key: str | None = None
        self._dispatched: set[int] = set()  # activity seqs recorded by this advance
        self._random = _random.Random(claimed.random_seed * 1000003 + claimed.run_no)
        self._patches: dict[str, bool] = {}  # ctx.patched answers, memoized per run
        base = get_logger(f"reliable_beat.workflows.{claimed.name}")
        self.logger = logging.LoggerAdapter(base, {"workflow_id": claimed.workflow_id})
        self._filter = _ReplayFilter(self)
        self._unwinding = False  # a saga is running its compensations (no cancel point)
        self._cancel_checked: bool | None = None  # cached: a cooperative cancel is pending
        #: saga blocks open right now (continue-as-new must refuse to cross one)
        self.open_sagas = 0

    # ---------------------------------------------------------------- properties ----

    @property
    def info(self) -> WorkflowInfo:
        """Ids, run, history length and limit, position, ``continue_as_new_suggested``."""
        d = self._definition
        return WorkflowInfo(
            workflow_id=self._claimed.workflow_id, name=self._claimed.name,
            run_no=self._claimed.run_no, history_length=self._claimed.history_len,
            history_limit=d.history_limit, position=self._seq,
            continue_as_new_suggested=self._seq >= d.suggest_continue_at,
            version=d.version,
        )

    @property
    def fence_token(self) -> int:
        """This advance's fence token: pass it to other stores to fence their writes."""
        return self._claimed.fence_token

    @property
    def is_replaying(self) -> bool:
        """True while the code is answered from the history (before the frontier)."""
        return self._seq < self._last_recorded

    @property
    def step_key(self) -> str:
        """Inside ``ctx.step``: the step's stable idempotency key ``wf:<id>/<run>#<seq>``,
        the same on every attempt; pass it to the far end (e.g. an Idempotency-Key header).

        Raises:
            WorkflowUsageError: outside a step.
        """
        if self._step_key is None:
            raise WorkflowUsageError("ctx.step_key is only defined inside ctx.step(...)")
        return self._step_key

    # ---------------------------------------------------------------- running ----

    def run_code(self, fn: Callable[..., Any]) -> str:
        """Run the workflow function; return ``suspended``, ``completed``, ``failed``,
        ``blocked`` or ``fenced`` (used by :func:`engine.advance`)."""
        token = _current.set(self)
        logger = self.logger.logger
        logger.addFilter(self._filter)
        try:
            tripwire.install()
            try:
                result = self._call_code(fn)
            except CodeTimeout:
                return self._block_runaway()
            except Suspend:
                return "suspended"
            except _StoreTrouble as exc:
                raise exc.__cause__ or exc from None  # the advance fails; the sweep retries
            except tripwire.NondeterministicCallError as exc:
                return lifecycle.block(self._store, self._claimed,
                                    f"tripwire at seq {self._seq}: {exc}")
            except NonDeterminismError as exc:
                return lifecycle.block(self._store, self._claimed, f"non-determinism: {exc}")
            except FencedOut:
                return "fenced"
            except _HistoryLimit as exc:
                return lifecycle.block(self._store, self._claimed, str(exc))
            except continuation.ContinueAsNewRefused as exc:
                return lifecycle.block(self._store, self._claimed, str(exc))
            except continuation.ContinueAsNew as request:
                return continuation.switch_run(self, request)
            except EndWorkflow as exc:  # a saga: compensation dead-lettered; data-only unwind
                if exc.values.get("state") == "blocked":
                    lifecycle.log.error("workflow %s blocked: %s", self._claimed.workflow_id, exc)
                return lifecycle.finish(self._store, self._claimed, **exc.values)
            except Exception as exc:
                if self._clock.fired:  # the code caught the deadline and raised its own
                    return self._block_runaway()
                swallowed = self._swallowed()
                if swallowed:
                    return swallowed
                tail = self._tail_check()
                if tail:
                    return tail
                crashes.crash_point("advance.before_finish")
                ended = "cancelled" if isinstance(exc, WorkflowCancelled) else "failed"
                return lifecycle.finish(self._store, self._claimed, state=ended,
                                      error=history.error_json(exc))
            if self._clock.fired:  # the code caught the deadline and returned
                return self._block_runaway()
            swallowed = self._swallowed()
            if swallowed:
                return swallowed
            tail = self._tail_check()
            if tail:
                return tail
            try:
                what = f"workflow {self._claimed.name!r} result"
                value = history.to_json(result, what)
                limits.check_size(what, value)
            except (TypeError, WorkflowValueError) as exc:
                return lifecycle.finish(self._store, self._claimed, state="failed",
                                      error=history.error_json(exc))
            crashes.crash_point("advance.before_finish")
            return lifecycle.finish(self._store, self._claimed, state="completed", result=value)
        finally:
            self._clock.disarm()
            logger.removeFilter(self._filter)
            _current.reset(token)

    def _call_code(self, fn: Callable[..., Any]) -> Any:
        """Run the workflow function with the tripwire armed and its code clock running
        (both off again inside durable calls, and once the function has returned or
        raised)."""
        token = tripwire.in_workflow_code.set(True)
        try:
            self._clock.start()
            # fresh copies on every pass: a wake during the advance runs the code again in
            # this advance, and the code may have mutated what it was given
            return fn(self, *from_json_value(self._claimed.args),
                      **from_json_value(self._claimed.kwargs))
        finally:
            self._clock.disarm()
            tripwire.in_workflow_code.reset(token)

    def _park_stuck(self, ran: float) -> None:
        """The watchdog's thread: the code stayed past its deadline through every
        interruption (swallowed, or stuck in a call): park the workflow now, fenced, so the
        sweep hands it to no other worker (:func:`~reliable_beat.workflows.runaway.park_stuck`).
        """
        assert self._clock.timeout is not None
        reason = runaway.stuck_reason(self._claimed.workflow_id, self._seq, ran,
                                      self._clock.timeout)
        try:
            with self._store.engine.begin() as conn:
                runaway.park_stuck(conn, self._claimed.pk, self._claimed.workflow_id,
                                   self._claimed.fence_token, reason, db_now(conn))
        except Exception:  # the store is away: the takeover count still parks it
            get_logger("reliable_beat.workflows").exception(
                "workflow %s: parking its stuck code failed", self._claimed.workflow_id)

    def _block_runaway(self) -> str:
        """The code ran past ``reliable_beat_workflow_code_timeout_seconds`` between
        durable calls: park the workflow, naming the position and the fix."""
        self._clock.disarm()
        assert self._clock.timeout is not None
        return lifecycle.block(self._store, self._claimed, runaway.code_timeout_reason(
            self._claimed.workflow_id, self._seq, self._clock.ran, self._clock.timeout))

    def replay_code(self, fn: Callable[..., Any]) -> str | None:
        """Offline replay (``workflows replay``): run the code against the history, answer
        every recorded call from it, write nothing. Returns the first mismatch (position,
        both sides) or None."""
        token = _current.set(self)
        try:
            try:
                fn(self, *from_json_value(self._claimed.args),
                   **from_json_value(self._claimed.kwargs))
            except Suspend:
                return None
            except NonDeterminismError as exc:
                return str(exc)
            except Exception:
                pass
            if self._last_recorded > self._seq:
                return (f"the code ended at seq {self._seq}, the history goes on to seq "
                        f"{self._last_recorded}")
            return None
        finally:
            _current.reset(token)

    def _swallowed(self) -> str | None:
        pending = self._pending
        if pending is None:
            return None
        if isinstance(pending, FencedOut):
            return "fenced"
        return lifecycle.block(
            self._store, self._claimed,
            f"suspension swallowed: the workflow code caught the engine's "
            f"{type(pending).__name__} at seq {self._seq} (a bare `except:` or "
            f"`except BaseException:` around a durable call) and went on; remove it. "
            f"{pending}",
        )

    def _tail_check(self) -> str | None:
        if self._last_recorded > self._seq:
            ev = self._history[self._seq + 1]
            return lifecycle.block(
                self._store, self._claimed,
                f"non-determinism: the code ended at seq {self._seq}, the history goes on "
                f"to seq {self._last_recorded} (seq {self._seq + 1}: {ev.kind} {ev.name}); "
                "the code now does less than the run that recorded it",
            )
        return None

    def _raise(self, exc: WorkflowControl) -> WorkflowControl:
        self._pending = exc
        return exc

    def _next(self, kind: str, name: str | None, args: Any) -> tuple[int, str, Any]:
        """Take the next position; check it against the history. Returns (seq, digest,
        recorded event or None)."""
        if self._pending is not None:
            raise self._pending  # the code swallowed it once; it does not get further
        if threading.get_ident() != self._thread:
            raise WorkflowUsageError(
                "durable calls must come from the advance's thread (positions would depend "
                "on thread scheduling)"
            )
        if self._in_step:
            raise WorkflowUsageError(
                f"{kind} {name!r} called inside ctx.step/ctx.transaction: durable calls "
                "cannot be nested"
            )
        self._seq += 1
        seq = self._seq
        digest = history.args_digest(kind, name, args)
        ev = self._history.get(seq)
        if ev is not None and ev.kind == "cancel":
            raise WorkflowCancelled(f"workflow {self._claimed.workflow_id!r} was cancelled "
                                    f"(seq {seq})")
        if ev is None and self._cancel_pending():
            self._record_cancel(seq)
        if ev is None and self._dry_run:
            raise self._suspend(f"replay reached the frontier at seq {seq}")
        if ev is not None and (ev.kind, ev.name, ev.args_digest) != (kind, name, digest):
            raise self._raise(NonDeterminismError(
                f"seq {seq}: code did {_describe(kind, name, args)} (args digest {digest}), "
                f"history has {_describe(ev.kind, ev.name, self._recorded_args(seq))} "
                f"(args digest {ev.args_digest})"
            ))
        return seq, digest, ev

    def _recorded_args(self, seq: int) -> Any:
        """The stored ``args`` of the event at ``seq`` (for an error message only), or
        ``None`` when they cannot be read."""
        try:
            with self._store.connect() as conn:
                return conn.execute(
                    select(workflow_events.c.args).where(
                        workflow_events.c.workflow_pk == self._claimed.pk,
                        workflow_events.c.run_no == self._claimed.run_no,
                        workflow_events.c.seq == seq,
                    )
                ).scalar()
        except Exception:  # the message is still right without them
            return None

    def _activity_message(self, task_name: str, call: list[Any], queue: str | None,
                         seq: int | None = None) -> dict[str, Any]:
        """The outbox payload of the activity (or compensation) ``task_name`` called with
        ``call`` (``[args, kwargs]``) at position ``seq`` (None: the next one)."""
        key = workflow_store.activity_key(self._claimed.workflow_id, self._claimed.run_no,
                                  self._seq + 1 if seq is None else seq)
        payload: dict[str, Any] = {"task": task_name, "args": call[0], "kwargs": call[1],
                                   "headers": {"reliable_beat_key": key}}
        if queue:
            payload["options"] = {"queue": queue}
        return payload

    def _check_size(self, kind: str, name: str | None, args: Any, what: str, *,
                    message: Any = None) -> None:
        """Refuse a durable call whose ``args`` (as stored), or the outbox ``message`` it
        sends if given, are over the size limit, before it takes a position
        (:mod:`~reliable_beat.workflows.limits`): the check depends on the arguments only,
        so a replay refuses it at the same place. The call the history records at the next
        position (written before the limit) replays as it was.

        Raises:
            WorkflowValueError: over :data:`~reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES`.
        """
        # an outbox row's size counts its headers too: {} for activity messages
        size = limits.over_size(args) if message is None else limits.over_size(message, {})
        if size is None:
            return
        ev = self._history.get(self._seq + 1)
        if ev is not None and (ev.kind, ev.name, ev.args_digest) == (
                kind, name, history.args_digest(kind, name, args)):
            return
        raise limits.size_error(what, size)

    def _record(
        self, seq: int, kind: str, name: str | None, digest: str, args: Any, *,
        state: str, result: Any = None, error: Any = None,
        fire_at: datetime | None = None, run_key: str | None = None,
        effect: Callable[[Connection], Any] | None = None,
        holder: dict[str, Any] | None = None,
    ) -> Any:
        """Record position ``seq`` (the frontier) in one fenced transaction with ``effect``
        (``effect(conn)`` runs first; its return value is the event's result). ``effect``
        may set ``holder["fire_at"]`` (computed on the DB clock in this transaction) and
        ``holder["done"]`` (the event is recorded ``completed`` at once)."""
        if self._claimed.history_len + seq - self._last_recorded > self._definition.history_limit:
            raise _HistoryLimit(
                f"history_limit: run {self._claimed.run_no} would pass "
                f"{self._definition.history_limit} events at seq {seq} ({kind} {name}); "
                "continue as new before it (ctx.continue_as_new when "
                "ctx.info.continue_as_new_suggested) or raise the limit, then resume"
            )
        crashes.crash_point(f"record.{kind}.before")
        try:
            with self._store.begin() as conn:
                size = len(history.canonical_json([args, result]))
                now = history.fence_check(conn, self._claimed, events=1, size=size)
                if effect is not None:
                    result = effect(conn)
                if holder:
                    fire_at = holder.get("fire_at", fire_at)
                    if holder.get("done"):
                        state = "completed"
                conn.execute(workflow_events.insert().values(
                    workflow_pk=self._claimed.pk, run_no=self._claimed.run_no, seq=seq,
                    kind=kind, name=name, args_digest=digest, args=args, state=state,
                    result=result, error=error, fire_at=fire_at, run_key=run_key,
                    fence_token=self._claimed.fence_token, created_at=now,
                    completed_at=now if state != "scheduled" else None,
                ))
                crashes.crash_point(f"record.{kind}.in")
        except FencedOut as exc:
            raise self._raise(exc) from None
        crashes.crash_point(f"record.{kind}.after")
        return result

    def _complete(self, seq: int, state: str, result: Any = None, error: Any = None,
                  effect: Callable[[Connection], Any] | None = None) -> Any:
        """Complete the scheduled event at ``seq`` (fenced)."""
        if self._dry_run:
            raise self._suspend(f"replay stops before completing seq {seq}")
        crashes.crash_point("complete.before")
        try:
            with self._store.begin() as conn:
                history.fence_check(conn, self._claimed)
                if effect is not None:
                    result = effect(conn)
                conn.execute(
                    update(workflow_events)
                    .where(workflow_events.c.workflow_pk == self._claimed.pk,
                           workflow_events.c.run_no == self._claimed.run_no,
                           workflow_events.c.seq == seq,
                           workflow_events.c.state == "scheduled")
                    .values(state=state, result=result, error=error,
                            completed_at=db_now(conn))
                )
        except FencedOut as exc:
            raise self._raise(exc) from None
        crashes.crash_point("complete.after")
        return result

    def _suspend(self, why: str) -> Suspend:
        recorded = self._history.get(self._seq + 1)
        if recorded is not None and recorded.kind == "cancel" and not self._unwinding:
            self._seq += 1  # cancelled while it waited here: replay the cancel, not the wait
            raise WorkflowCancelled(f"workflow {self._claimed.workflow_id!r} was cancelled "
                                    f"(seq {self._seq})")
        if self._cancel_pending():  # a cancel interrupts the wait (at the next position)
            self._seq += 1
            self._record_cancel(self._seq)
        return self._raise(Suspend(why))  # type: ignore[return-value]

    # ---------------------------------------------------------------- sagas, cancel ----

    def _cancel_pending(self) -> bool:
        """A cooperative cancel was asked for and not yet raised in this run."""
        if self._dry_run or self._unwinding:
            return False
        if self._cancel_checked is None:
            from reliable_beat.workflows import saga

            self._cancel_checked = saga.cancel_requested(self)
        return self._cancel_checked

    def _record_cancel(self, seq: int) -> None:
        """Record a ``cancel`` event at ``seq`` and raise :class:`WorkflowCancelled`."""
        digest = history.args_digest("cancel", None, None)
        self._record(seq, "cancel", None, digest, None, state="completed")
        self._history[seq] = _Ev(seq, "cancel", None, digest, "completed", None, None, None,
                                 None)
        self._cancel_checked = False
        raise WorkflowCancelled(f"workflow {self._claimed.workflow_id!r} was cancelled "
                                f"(seq {seq})")

    def saga(self, *, parallel: bool = False, continue_on_error: bool = False) -> Saga:
        """A saga block: ``with ctx.saga() as saga: saga.compensate(task, *args)``.

        Register each compensation **before** the step it undoes; if an ``Exception``
        leaves the block (an :class:`ActivityError`, :class:`WorkflowCancelled`, your own),
        the registered compensations run in reverse as ordinary keyed activities, one at a
        time, then the exception goes on. See :class:`reliable_beat.workflows.saga.Saga`.

        Args:
            parallel: send all the block's compensations at once (newest first) and wait
                for all of them, instead of one at a time; for undo steps that do not
                depend on each other.
            continue_on_error: a compensation that dead-letters does not stop the ones
                after it in the undo order.

        With either, the workflow is still parked ``blocked`` (``compensation_failed``,
        naming every dead compensation) once all have settled, if any dead-lettered; never
        ``failed`` with an undo missing. ``workflows compensate ID`` then runs the dead ones
        from data, one at a time.
        """
        from reliable_beat.workflows.saga import Saga

        return Saga(self, parallel=parallel, continue_on_error=continue_on_error)

    @staticmethod
    def _outcome(ev_state: str, result: Any, error: Any, kind: str, name: str) -> Any:
        if ev_state == "failed":
            err = error or {}
            raise ActivityError(str(err.get("type")), str(err.get("message")), kind=kind,
                                name=name)
        return from_json_value(result)

    # ---------------------------------------------------------------- inline steps ----

    @_durable
    def transaction(self, fn: Callable[..., Any], *args: Any, name: str | None = None,
                    **kwargs: Any) -> Any:
        """Run ``fn(conn, *args, **kwargs)`` in the transaction that records it (fenced).

        Exactly once for what ``fn`` writes through ``conn`` (the store's database): the
        effect, the history record and the fence check commit together or not at all.
        Replays return the recorded result without running ``fn``. In a Django project
        with ``reliable_beat.contrib.django`` installed, an ORM write inside ``fn`` (on
        Django's connection, not ``conn``) is refused: ``ConfigurationError``, recorded as
        the step's failure.

        Returns:
            ``fn``'s JSON-serialisable return value.

        Raises:
            ActivityError: ``fn`` raised (its writes rolled back; the failure is recorded and
                raised the same way on every replay).
        """
        step_name = _callable_name(fn, name)
        call = history.to_json([list(args), kwargs], f"transaction {step_name!r} arguments")
        self._check_size("transaction", step_name, call,
                         f"transaction {step_name!r} arguments")
        seq, digest, ev = self._next("transaction", step_name, call)
        if ev is not None:
            return self._outcome(ev.state, ev.result, ev.error, "transaction", step_name)

        def effect(conn: Connection) -> Any:
            self._in_step = True
            try:
                with joins.guard(joins.registered(), None, where="ctx.transaction",
                                 task_name=f"workflow {self._definition.name}",
                                 store=self._store, fix=_TRANSACTION_FIX):
                    value = fn(conn, *args, **kwargs)
                value = history.to_json(value, f"transaction {step_name!r} result")
                limits.check_size(f"transaction {step_name!r} result", value)
                return value
            except OperationalError:
                raise  # the database, not the step (deadlock, connection): the advance retries
            except Exception as exc:
                raise _StepFailed(exc) from exc
            finally:
                self._in_step = False

        try:
            return from_json_value(self._record(seq, "transaction", step_name, digest, call,
                                                state="completed", effect=effect))
        except _StepFailed as failed:  # fn failed: its writes rolled back; record the failure
            exc = failed.exc
            err = history.error_json(exc)
            self._record(seq, "transaction", step_name, digest, call, state="failed",
                         error=err)
            raise ActivityError(err["type"], err["message"], kind="transaction",
                                name=step_name) from exc

    @_durable
    def step(self, fn: Callable[..., Any], *args: Any, name: str | None = None,
             **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` inline, then checkpoint its result.

        At least once: a crash after ``fn`` returns and before the checkpoint commits runs
        it again on the next advance; ``ctx.step_key`` is the same on each attempt, so pass
        it to the far end. Keep it short (well under the lease and the broker's visibility
        timeout); long work is an activity.

        Raises:
            ActivityError: ``fn`` raised (recorded; raised the same way on replay).
        """
        step_name = _callable_name(fn, name)
        call = history.to_json([list(args), kwargs], f"step {step_name!r} arguments")
        self._check_size("step", step_name, call, f"step {step_name!r} arguments")
        seq, digest, ev = self._next("step", step_name, call)
        if ev is not None:
            return self._outcome(ev.state, ev.result, ev.error, "step", step_name)
        self._in_step = True
        self._step_key = workflow_store.activity_key(self._claimed.workflow_id,
                                                     self._claimed.run_no, seq)
        try:
            value = fn(*args, **kwargs)
            value = history.to_json(value, f"step {step_name!r} result")
            limits.check_size(f"step {step_name!r} result", value)
        except Exception as exc:
            self._in_step = False
            err = history.error_json(exc)
            self._record(seq, "step", step_name, digest, call, state="failed", error=err)
            raise ActivityError(err["type"], err["message"], kind="step",
                                name=step_name) from exc
        finally:
            self._in_step = False
            self._step_key = None
        crashes.crash_point("step.after_body")
        return from_json_value(self._record(seq, "step", step_name, digest, call,
                                            state="completed", result=value))

    # ---------------------------------------------------------------- activities ----

    @_durable
    def start_activity(self, task: Any, *args: Any, queue: str | None = None,
                       **kwargs: Any) -> ActivityHandle:
        """Dispatch activity ``task`` (an ``IdempotentTask`` or its name) without waiting.

        A plain Celery task cannot be an activity (nothing would record its completion):
        given as an object it is refused with :class:`WorkflowUsageError`; given by name it
        must name an ``IdempotentTask`` (not checked: the name may live on another app).

        Records the ``activity`` event and its message (outbox, key ``wf:<id>/<run>#<seq>``)
        in one fenced transaction. Wait for it with :meth:`wait_all` / :meth:`wait_any`.
        """
        if not isinstance(task, str) and not callable(getattr(task, "returns", None)):
            raise WorkflowUsageError(
                f"activity {getattr(task, 'name', task)!r} is not an IdempotentTask: an "
                "activity's completion must write the workflow's history with its effect; "
                "use @app.task(base=IdempotentTask, bind=True) (a task given by name must be one)"
            )
        task_name = task if isinstance(task, str) else str(task.name)
        call = history.to_json([list(args), kwargs], f"activity {task_name!r} arguments")
        self._check_size("activity", task_name, call,
                         f"activity {task_name!r} arguments (in their message)",
                         message=self._activity_message(task_name, call, queue))
        seq, digest, ev = self._next("activity", task_name, call)
        key = workflow_store.activity_key(self._claimed.workflow_id, self._claimed.run_no, seq)
        if ev is None:
            payload = self._activity_message(task_name, call, queue, seq)
            # the activity joins the workflow's trace (not part of the size check: the
            # check must not depend on whether tracing is on)
            payload["headers"].update(tracing.carrier())

            def dispatch(conn: Connection) -> None:
                outbox.add(conn, workflow_store.WAKE_DESTINATION, payload, key=f"act:{key}",
                           schedule_group=workflow_store.group_of(self._claimed.workflow_id))

            # stored with its queue (not part of the digest), for the re-dispatch sweep
            self._record(seq, "activity", task_name, digest, [*call, queue],
                         state="scheduled", run_key=key, effect=dispatch)
            self._dispatched.add(seq)
            self._history[seq] = _Ev(seq, "activity", task_name, digest, "scheduled", None,
                                     None, None, key)
        return ActivityHandle(seq=seq, name=task_name, key=key)

    def _resolve(self, handle: ActivityHandle) -> tuple[bool, Any]:
        """(done, event) for a started activity; records its completion if the run ended."""
        ev = self._history[handle.seq]
        if ev.state != "scheduled":
            return True, ev
        if handle.seq in self._dispatched:
            # dispatched by this very advance: if it has already completed, its completion
            # bumped wake_seq after our claim, so the release's wake_seq check runs the code
            # again with the new history; no need to read the run and the event now
            return False, ev
        with self._store.connect() as conn:
            run = conn.execute(
                select(runs.c.state, runs.c.result, runs.c.error)
                .where(runs.c.idempotency_key == handle.key)
            ).first()
            event = conn.execute(
                select(workflow_events.c.state, workflow_events.c.result,
                       workflow_events.c.error)
                .where(workflow_events.c.workflow_pk == self._claimed.pk,
                       workflow_events.c.run_no == self._claimed.run_no,
                       workflow_events.c.seq == handle.seq)
            ).first()
        if event is not None and event.state != "scheduled":  # completed by the hook
            done = _Ev(handle.seq, "activity", handle.name, ev.args_digest, event.state,
                       event.result, event.error, None, handle.key)
        elif run is not None and run.state in ("succeeded", "dead"):
            # the completion hook's write is missing (e.g. an older worker): repair from the
            # run row, which committed with the activity's effect
            state = "completed" if run.state == "succeeded" else "failed"
            error = None if state == "completed" else {"type": "dead",
                                                        "message": (run.error or "")[-2000:]}
            self._complete(handle.seq, state, run.result, error)
            done = _Ev(handle.seq, "activity", handle.name, ev.args_digest, state,
                       run.result, error, None, handle.key)
        else:
            return False, ev
        self._history[handle.seq] = done
        return True, done

    @_durable
    def wait(self, handle: ActivityHandle) -> Any:
        """The activity's result; suspends until it is there.

        Raises:
            ActivityError: the activity died (dead letter: permanent error or attempts
                exhausted); ``type`` is ``"dead"``, ``message`` its error.
        """
        return self.wait_all(handle)[0]

    @_durable
    def activity(self, task: Any, *args: Any, queue: str | None = None, **kwargs: Any) -> Any:
        """Start activity ``task`` and wait for its result (see :meth:`start_activity`)."""
        return self.wait(self.start_activity(task, *args, queue=queue, **kwargs))

    @_durable
    def wait_all(self, *handles: ActivityHandle) -> list[Any]:
        """The results of all ``handles``, in order; suspends until every one is done.

        Records nothing itself (the answer is fixed by the activities' events).

        Raises:
            ActivityError: the first (in argument order) that failed.
        """
        if self._pending is not None:
            raise self._pending
        resolved = [self._resolve(h) for h in handles]
        if not all(done for done, _ in resolved):
            waiting = [h.name for h, (done, _) in zip(handles, resolved, strict=True) if not done]
            raise self._suspend(f"waiting for activities {waiting}")
        return [self._outcome(ev.state, ev.result, ev.error, "activity", h.name)
                for h, (_, ev) in zip(handles, resolved, strict=True)]

    @_durable
    def wait_any(self, *handles: ActivityHandle) -> tuple[int, Any]:
        """``(index, result)`` of the first of ``handles`` seen done; suspends until one is.

        Which one was first is recorded (a ``wait_any`` event), so a replay picks the same
        one even if more have finished since.

        Raises:
            ActivityError: the chosen activity failed.
        """
        seqs = [h.seq for h in handles]
        seq, digest, ev = self._next("wait_any", None, seqs)
        if ev is None:
            resolved = [self._resolve(h) for h in handles]
            first = next((i for i, (done, _) in enumerate(resolved) if done), None)
            if first is None:
                self._seq -= 1  # not recorded: the position is taken when it is satisfied
                raise self._suspend("waiting for any activity")
            self._record(seq, "wait_any", None, digest, seqs, state="completed", result=first)
            index = first
        else:
            index = int(ev.result)
        _, chosen = self._resolve(handles[index])
        return index, self._outcome(chosen.state, chosen.result, chosen.error, "activity",
                                    handles[index].name)

    # ---------------------------------------------------------------- timers ----

    @_durable
    def sleep(self, duration: timedelta) -> None:
        """Durable sleep: suspends for ``duration`` (a ``timedelta`` >= 0) on the store's clock.

        Records a ``timer`` event with ``fire_at = db now + duration`` and an outbox wake
        with ``available_at = fire_at`` in one transaction; nothing holds a worker or a
        message meanwhile. Precision: the relay's poll.

        Raises:
            WorkflowValueError: ``duration`` is not a ``timedelta`` from 0 to
                :data:`~reliable_beat.workflows.limits.MAX_TIMER` (100 years).
        """
        limits.check_duration("ctx.sleep duration", duration)
        self._timer(["sleep", duration.total_seconds()], lambda now: now + duration)

    @_durable
    def sleep_until(self, instant: datetime) -> None:
        """Durable sleep until ``instant`` (tz-aware; naive datetimes are refused).

        Raises:
            WorkflowValueError: ``instant`` is not a tz-aware ``datetime``.
        """
        if not isinstance(instant, datetime) or instant.tzinfo is None:
            raise WorkflowValueError(
                f"ctx.sleep_until instant must be a tz-aware datetime, got {instant!r}; "
                "e.g. datetime(2030, 1, 1, tzinfo=timezone.utc)")
        self._timer(["until", instant.isoformat()], lambda now: max(now, instant))

    def _timer(self, args: Any, fire: Callable[[datetime], datetime]) -> None:
        seq, digest, ev = self._next("timer", None, args)
        if ev is None:
            holder: dict[str, datetime] = {}

            def schedule(conn: Connection) -> None:
                now = db_now(conn)
                holder["fire_at"] = fire_at = fire(now)
                workflow_store.add_wake(conn, self._claimed.workflow_id, self._claimed.queue,
                                f"{self._claimed.run_no}t{seq}", delay=fire_at - now)

            self._record(seq, "timer", None, digest, args, state="scheduled", effect=schedule,
                         holder=holder)
            fire_at = holder["fire_at"]
            state = "scheduled"
        else:
            fire_at, state = ev.fire_at, ev.state
        if state != "scheduled":
            return
        with self._store.connect() as conn:
            now = db_now(conn)
        if now < fire_at:
            raise self._suspend(f"timer at seq {seq} fires at {fire_at.isoformat()}")
        self._complete(seq, "completed")
        self._history[seq] = _Ev(seq, "timer", None, digest, "completed", None, None, fire_at,
                                 None)

    # ---------------------------------------------------------------- signals ----

    @_durable
    def wait_signal(self, name: str, timeout: timedelta | None = None) -> Any:
        """The payload of the oldest unconsumed signal ``name``; suspends until one comes.

        Consuming the signal and recording it are one fenced transaction: each signal is
        consumed by exactly one wait. With ``timeout``, returns None if none came in time
        (which came first is decided once, by the advance that sees it, then replayed).
        ``timeout=timedelta(0)`` polls: the oldest signal if one is there, else None.

        Raises:
            WorkflowValueError: ``timeout`` is not None nor a ``timedelta`` from 0 to
                :data:`~reliable_beat.workflows.limits.MAX_TIMER` (100 years).
        """
        if timeout is not None:
            limits.check_duration("ctx.wait_signal timeout", timeout)
        args = [name, None if timeout is None else timeout.total_seconds()]
        seq, digest, ev = self._next("signal", name, args)
        if ev is not None and ev.state != "scheduled":
            return from_json_value(ev.result)
        if ev is None:
            holder: dict[str, Any] = {}

            def first(conn: Connection) -> Any:
                consumed = self._consume(conn, name, seq)
                if consumed is not _NOTHING:
                    holder["done"] = True
                    return consumed
                if timeout is not None:
                    now = db_now(conn)
                    holder["fire_at"] = now + timeout
                    workflow_store.add_wake(conn, self._claimed.workflow_id, self._claimed.queue,
                                    f"{self._claimed.run_no}t{seq}", delay=timeout)
                return None

            result = self._record(seq, "signal", name, digest, args, state="scheduled",
                                  effect=first, holder=holder)
            if holder.get("done"):
                self._history[seq] = _Ev(seq, "signal", name, digest, "completed", result,
                                         None, None, None)
                return from_json_value(result)
            fire_at = holder.get("fire_at")
        else:
            fire_at = ev.fire_at
        # scheduled: a signal may have come since
        outcome: dict[str, Any] = {}

        def consume(conn: Connection) -> Any:
            value = self._consume(conn, name, seq)
            if value is not _NOTHING:
                outcome["done"] = True
                return value
            if fire_at is not None and db_now(conn) >= fire_at:
                outcome["done"] = True
                return None
            raise _NotYet

        with self._store.connect() as conn:
            pending = conn.execute(
                select(workflow_signals.c.id).where(
                    workflow_signals.c.workflow_pk == self._claimed.pk,
                    workflow_signals.c.name == name,
                    workflow_signals.c.consumed_seq.is_(None),
                ).limit(1)
            ).first()
            now = db_now(conn)
        if pending is None and (fire_at is None or now < fire_at):
            raise self._suspend(f"waiting for signal {name!r} at seq {seq}")
        try:
            result = self._complete(seq, "completed", effect=consume)
        except _NotYet:
            raise self._suspend(f"waiting for signal {name!r} at seq {seq}") from None
        self._history[seq] = _Ev(seq, "signal", name, digest, "completed", result, None,
                                 fire_at, None)
        return from_json_value(result)

    def _consume(self, conn: Connection, name: str, seq: int) -> Any:
        row = conn.execute(
            select(workflow_signals.c.id, workflow_signals.c.payload)
            .where(workflow_signals.c.workflow_pk == self._claimed.pk,
                   workflow_signals.c.name == name,
                   workflow_signals.c.consumed_seq.is_(None))
            .order_by(workflow_signals.c.id)
            .limit(1)
        ).first()
        if row is None:
            return _NOTHING
        done = conn.execute(
            update(workflow_signals)
            .where(workflow_signals.c.id == row.id, workflow_signals.c.consumed_seq.is_(None))
            .values(consumed_run_no=self._claimed.run_no, consumed_seq=seq)
        ).rowcount
        if done != 1:  # pragma: no cover - only the fenced advance consumes
            return _NOTHING
        return row.payload

    # ---------------------------------------------------------------- recorded values ----

    @_durable
    def now(self) -> datetime:
        """The store's clock, recorded: replays return the same instant (UTC-aware)."""
        seq, digest, ev = self._next("now", None, None)
        if ev is not None:
            return datetime.fromisoformat(str(ev.result))
        holder: dict[str, str] = {}

        def read(conn: Connection) -> str:
            holder["v"] = db_now(conn).isoformat()
            return holder["v"]

        value = self._record(seq, "now", None, digest, None, state="completed", effect=read)
        return datetime.fromisoformat(str(value))

    @_durable
    def random(self) -> float:
        """A float in [0, 1) from a generator seeded per run (seed stored at start)."""
        if self._pending is not None:
            raise self._pending
        return self._random.random()

    @_durable
    def uuid4(self) -> uuid.UUID:
        """A version-4 UUID from the run's seeded generator (stable across replays)."""
        if self._pending is not None:
            raise self._pending
        return uuid.UUID(int=self._random.getrandbits(128), version=4)

    # ---------------------------------------------------------------- versioning ----

    @_durable
    def patched(self, patch_id: str) -> bool:
        """Whether this run takes the new code path of change ``patch_id`` (Temporal's
        semantics; truth table in :mod:`reliable_beat.workflows.versioning`).

        A new run (the frontier) records the marker ``patch <id>`` and gets True; a replay
        finding the marker at the next position consumes it and gets True; a replay finding
        another event there (the run passed this point under the old code) gets False and
        takes no position. Memoized per id for the run.

        Raises:
            ValueError: ``patch_id`` not a string of 1..255 characters.
        """
        return versioning.patched(self, patch_id)

    @_durable
    def deprecate_patch(self, patch_id: str) -> None:
        """Step 2 of removing a patch: consumes the marker ``patch <id>`` if the history has
        it at the next position, never records one. Once no run without the marker can
        exist, replace ``if ctx.patched(id): new else: old`` by ``deprecate_patch(id); new``;
        once no run with the marker can exist either, remove the call."""
        versioning.deprecate_patch(self, patch_id)

    # ---------------------------------------------------------------- children ----

    @_durable
    def start_child(self, wf: Any, *args: Any, workflow_id: str | None = None,
                    **kwargs: Any) -> children.ChildHandle:
        """Start child workflow ``wf`` (a ``@workflow`` definition or its registered name)
        without waiting; wait with :meth:`wait_child`.

        The ``child`` event, the child's row (idempotent on its id, default
        ``<parent id>/child<run>.<seq>``) and its first wake commit in one fenced
        transaction; the child's end completes the event and wakes this workflow in the
        child's terminal transaction.

        Raises:
            WorkflowUsageError: ``workflow_id`` already names another parent's child.
            WorkflowConflict: ``workflow_id`` names a workflow of another name.
        """
        return children.start_child(self, wf, args, kwargs, workflow_id)

    @_durable
    def wait_child(self, handle: children.ChildHandle) -> Any:
        """The child's result; suspends until it ends.

        Raises:
            ActivityError: the child failed (``type``/``message`` of its error) or was
                cancelled (``type`` ``"cancelled"``); ``kind`` is ``"child"``.
        """
        return children.wait_child(self, handle)

    @_durable
    def child(self, wf: Any, *args: Any, workflow_id: str | None = None, **kwargs: Any) -> Any:
        """Start child workflow ``wf`` and wait for its result (see :meth:`start_child`)."""
        return self.wait_child(self.start_child(wf, *args, workflow_id=workflow_id, **kwargs))

    # ---------------------------------------------------------------- continue-as-new ----

    @_durable
    def all_settled(self) -> bool:
        """True when nothing of this run is open (activities started and not finished, saga
        blocks): :meth:`continue_as_new` may be called. Decide to *wait* with it (e.g.
        ``ctx.wait_all(...)``), not which durable calls to make: on a replay more may have
        finished."""
        return not continuation.open_work(self)

    @_durable
    def continue_as_new(self, *args: Any, **kwargs: Any) -> None:
        """End this run and start the next one under the same workflow id: an empty history,
        ``fn(ctx, *args, **kwargs)`` from the top, ``info.run_no + 1``. Never returns.

        Unconsumed signals carry over to the next run. Open activities and saga blocks cannot
        cross the boundary: the call is refused and the workflow ``blocked`` (wait for them
        first; :meth:`all_settled`). The next run records the current code's ``version``.

        Raises:
            TypeError: the arguments are not JSON-serialisable (raised into the code).
            WorkflowValueError: the arguments are over the size limit as JSON (the next
                run would read them on every advance); raised into the code, nothing is
                written.
        """
        call_args = history.to_json(list(args), "continue_as_new args")
        call_kwargs = history.to_json(dict(kwargs), "continue_as_new kwargs")
        if self._pending is not None:
            raise self._pending
        if self._in_step:
            raise WorkflowUsageError("ctx.continue_as_new inside ctx.step/ctx.transaction")
        if self._dry_run:
            raise self._suspend(f"replay reached continue_as_new at seq {self._seq}")
        limits.check_size("continue_as_new arguments", call_args, call_kwargs)
        still_open = continuation.open_work(self)
        if still_open:
            raise self._raise(continuation.ContinueAsNewRefused(
                f"continue_as_new refused at seq {self._seq} of run {self._claimed.run_no}: "
                f"{', '.join(still_open)} still open (their completions belong to this run); "
                "wait for them (ctx.wait_all) before continuing, e.g. `if ctx.all_settled():`; "
                "fix the code, then `workflows resume`"
            ))
        raise self._raise(continuation.ContinueAsNew(call_args, call_kwargs))


class _HistoryLimit(WorkflowControl):
    """The run reached its history limit (the workflow is blocked)."""


class _StoreTrouble(WorkflowControl):
    """A database error under a durable call; the advance fails and is retried."""


class _StepFailed(Exception):
    """The user's function raised inside ``ctx.transaction`` (not the engine)."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _NotYet(Exception):
    """Nothing to consume yet (rolls the completion transaction back)."""


_NOTHING = object()


@dataclass
class _Ev:
    seq: int
    kind: str
    name: str | None
    args_digest: str
    state: str
    result: Any
    error: Any
    fire_at: datetime | None
    run_key: str | None


def _seconds(value: float) -> str:
    return f"{int(value)}s" if float(value).is_integer() else f"{value}s"


def _describe(kind: str, name: str | None, args: Any) -> str:
    """A position as a person reads it in a non-determinism message: ``activity
    billing.charge``, ``timer sleep 40s``, ``timer until 2026-01-10T12:00:00+00:00``."""
    if kind == "timer":
        if isinstance(args, str):  # stored args read back as JSON text (some dialects)
            import json

            try:
                args = json.loads(args)
            except ValueError:
                return "timer"
        if isinstance(args, list) and len(args) == 2:
            how, when = args
            if how == "sleep" and isinstance(when, (int, float)):
                return f"timer sleep {_seconds(when)}"
            if how == "until":
                return f"timer until {when}"
        return "timer"
    return f"{kind} {name}" if name is not None else kind
