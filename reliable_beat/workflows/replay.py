"""One run of the workflow code against its history: the implementation of
:class:`~reliable_beat.workflows._runtime.Runtime`.

Each durable call takes the next position (``seq``) in the run. A recorded position must
match the call's kind, name and argument digest (else :class:`NonDeterminismError`) and
answers from the history; the first unrecorded position (the frontier) is recorded in one
fenced transaction with whatever it dispatches; a call whose answer is not there yet raises
:class:`Suspend` and the advance ends, holding nothing. :meth:`Replay.run` runs the code and
turns how it ended into the workflow's state (completed, failed, blocked, suspended,
continued, fenced).
"""

from __future__ import annotations

import json
import random as _random
import threading
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import select, update

from reliable_beat import handoff
from reliable_beat.db.driver import uses_psycopg
from reliable_beat.db.tables import workflow_events
from reliable_beat.outbox import db_now
from reliable_beat.redaction import get_logger
from reliable_beat.values import from_json_value
from reliable_beat.workflows import (
    _runtime,
    continuation,
    crashes,
    lifecycle,
    limits,
    pg_statements,
    runaway,
    saga,
    tripwire,
)
from reliable_beat.workflows._runtime import Event
from reliable_beat.workflows.errors import (
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
from reliable_beat.workflows.history import (
    Claimed,
    args_digest,
    canonical_json,
    error_json,
    fence_check,
    to_json,
)

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from reliable_beat.db.dialects import Store
    from reliable_beat.workflows.registry import WorkflowDefinition

__all__ = ["Replay", "StoreTrouble"]

_C = TypeVar("_C", bound=WorkflowControl)


class Replay:
    """The runtime of one pass of a workflow's code in an advance (or an offline replay).

    Not thread-safe by design: durable calls from a thread other than the advance's are
    refused (their positions would depend on scheduling).
    """

    def __init__(
        self, store: Store, claimed: Claimed, history: dict[int, Any],
        definition: WorkflowDefinition, *, dry_run: bool = False,
        code_timeout: float | None = None,
    ) -> None:
        self.dry_run = dry_run  # offline replay: stop at the frontier, write nothing
        #: times the code between durable calls (None: no deadline); see runaway.py
        self.clock = runaway.CodeClock(code_timeout, claimed.workflow_id,
                                       on_stuck=self._park_stuck)
        self.store = store
        self.claimed = claimed
        self.history = history
        self.last_recorded = max(history) if history else 0
        self.definition = definition
        self.seq = 0
        self._thread = threading.get_ident()
        self._pending: WorkflowControl | None = None
        self.in_step = False
        self.step_key: str | None = None
        self.dispatched: set[int] = set()  # activity seqs recorded by this advance
        self.random = _random.Random(claimed.random_seed * 1000003 + claimed.run_no)
        self.patches: dict[str, bool] = {}  # ctx.patched answers, memoized per run
        self.unwinding = False  # a saga is running its compensations (no cancel point)
        self._cancel_checked: bool | None = None  # cached: a cooperative cancel is pending
        #: saga blocks open right now (continue-as-new must refuse to cross one)
        self.open_sagas = 0

    @property
    def is_replaying(self) -> bool:
        """True while the code is answered from the history (before the frontier)."""
        return self.seq < self.last_recorded

    # ---------------------------------------------------------------- running ----

    def run(self, fn: Callable[..., Any], ctx: Any) -> str:
        """Run the workflow function ``fn(ctx, *args, **kwargs)``; return ``suspended``,
        ``completed``, ``failed``, ``blocked``, ``continued`` or ``fenced``."""
        token = _runtime.enter(self)
        try:
            tripwire.install()
            try:
                result = self._call_code(fn, ctx)
            except CodeTimeout:
                return self._block_runaway()
            except Suspend:
                return "suspended"
            except StoreTrouble as exc:
                raise exc.__cause__ or exc from None  # the advance fails; the sweep retries
            except tripwire.NondeterministicCallError as exc:
                return lifecycle.block(self.store, self.claimed,
                                       f"tripwire at seq {self.seq}: {exc}")
            except NonDeterminismError as exc:
                return lifecycle.block(self.store, self.claimed, f"non-determinism: {exc}")
            except FencedOut:
                return "fenced"
            except _HistoryLimit as exc:
                return lifecycle.block(self.store, self.claimed, str(exc))
            except continuation.ContinueAsNewRefused as exc:
                return lifecycle.block(self.store, self.claimed, str(exc))
            except continuation.ContinueAsNew as request:
                return continuation.switch_run(self, request)
            except EndWorkflow as exc:  # a saga: compensation dead-lettered; data-only unwind
                if exc.values.get("state") == "blocked":
                    lifecycle.log.error("workflow %s blocked: %s", self.claimed.workflow_id,
                                        exc)
                return lifecycle.finish(self.store, self.claimed, **exc.values)
            except Exception as exc:
                if self.clock.fired:  # the code caught the deadline and raised its own
                    return self._block_runaway()
                swallowed = self._swallowed()
                if swallowed:
                    return swallowed
                tail = self.tail_check()
                if tail:
                    return tail
                crashes.crash_point("advance.before_finish")
                ended = "cancelled" if isinstance(exc, WorkflowCancelled) else "failed"
                return lifecycle.finish(self.store, self.claimed, state=ended,
                                        error=error_json(exc))
            if self.clock.fired:  # the code caught the deadline and returned
                return self._block_runaway()
            swallowed = self._swallowed()
            if swallowed:
                return swallowed
            tail = self.tail_check()
            if tail:
                return tail
            try:
                what = f"workflow {self.claimed.name!r} result"
                value = to_json(result, what)
                limits.check_size(what, value)
            except (TypeError, WorkflowValueError) as exc:
                return lifecycle.finish(self.store, self.claimed, state="failed",
                                        error=error_json(exc))
            crashes.crash_point("advance.before_finish")
            return lifecycle.finish(self.store, self.claimed, state="completed", result=value)
        finally:
            self.clock.disarm()
            _runtime.leave(token)

    def _call_code(self, fn: Callable[..., Any], ctx: Any) -> Any:
        """Run the workflow function with the tripwire armed and its code clock running
        (both off again inside durable calls, and once the function has returned or
        raised)."""
        token = tripwire.in_workflow_code.set(True)
        try:
            self.clock.start()
            # fresh copies on every pass: a wake during the advance runs the code again in
            # this advance, and the code may have mutated what it was given
            return fn(ctx, *from_json_value(self.claimed.args),
                      **from_json_value(self.claimed.kwargs))
        finally:
            self.clock.disarm()
            tripwire.in_workflow_code.reset(token)

    def _park_stuck(self, ran: float) -> None:
        """The watchdog's thread: the code stayed past its deadline through every
        interruption (swallowed, or stuck in a call): park the workflow now, fenced, so the
        sweep hands it to no other worker (:func:`~reliable_beat.workflows.runaway.park_stuck`).
        """
        assert self.clock.timeout is not None
        reason = runaway.stuck_reason(self.claimed.workflow_id, self.seq, ran,
                                      self.clock.timeout)
        try:
            with self.store.engine.begin() as conn:
                runaway.park_stuck(conn, self.claimed.pk, self.claimed.workflow_id,
                                   self.claimed.fence_token, reason, db_now(conn))
        except Exception:  # the store is away: the takeover count still parks it
            get_logger("reliable_beat.workflows").exception(
                "workflow %s: parking its stuck code failed", self.claimed.workflow_id)

    def _block_runaway(self) -> str:
        """The code ran past ``reliable_beat_workflow_code_timeout_seconds`` between
        durable calls: park the workflow, naming the position and the fix."""
        self.clock.disarm()
        assert self.clock.timeout is not None
        return lifecycle.block(self.store, self.claimed, runaway.code_timeout_reason(
            self.claimed.workflow_id, self.seq, self.clock.ran, self.clock.timeout))

    def replay(self, fn: Callable[..., Any], ctx: Any) -> str | None:
        """Offline replay (``workflows replay``): run the code against the history, answer
        every recorded call from it, write nothing. Returns the first mismatch (position,
        both sides) or None."""
        token = _runtime.enter(self)
        try:
            try:
                fn(ctx, *from_json_value(self.claimed.args),
                   **from_json_value(self.claimed.kwargs))
            except Suspend:
                return None
            except NonDeterminismError as exc:
                return str(exc)
            except Exception:
                pass
            if self.last_recorded > self.seq:
                return (f"the code ended at seq {self.seq}, the history goes on to seq "
                        f"{self.last_recorded}")
            return None
        finally:
            _runtime.leave(token)

    def _swallowed(self) -> str | None:
        pending = self._pending
        if pending is None:
            return None
        if isinstance(pending, FencedOut):
            return "fenced"
        return lifecycle.block(
            self.store, self.claimed,
            f"suspension swallowed: the workflow code caught the engine's "
            f"{type(pending).__name__} at seq {self.seq} (a bare `except:` or "
            f"`except BaseException:` around a durable call) and went on; remove it. "
            f"{pending}",
        )

    def tail_check(self) -> str | None:
        """Block the workflow if the code ended before the history does; the outcome."""
        if self.last_recorded > self.seq:
            ev = self.history[self.seq + 1]
            return lifecycle.block(
                self.store, self.claimed,
                f"non-determinism: the code ended at seq {self.seq}, the history goes on "
                f"to seq {self.last_recorded} (seq {self.seq + 1}: {ev.kind} {ev.name}); "
                "the code now does less than the run that recorded it",
            )
        return None

    # ---------------------------------------------------------------- positions ----

    def control(self, exc: _C) -> _C:
        """Remember engine control flow ``exc`` (raised into the code next)."""
        self._pending = exc
        return exc

    def check_pending(self) -> None:
        """Re-raise the control flow the code swallowed once; it does not get further."""
        if self._pending is not None:
            raise self._pending

    def check_caller(self, what: str) -> None:
        """Refuse a durable call from another thread or nested in a step."""
        self.check_pending()
        if threading.get_ident() != self._thread:
            raise WorkflowUsageError(f"{what} must be called from the advance's thread")
        if self.in_step:
            raise WorkflowUsageError(f"{what} called inside ctx.step/ctx.transaction: durable "
                                     "calls cannot be nested")

    def next(self, kind: str, name: str | None, args: Any, *,
             digest: str | None = None) -> tuple[int, str, Any]:
        """Take the next position; check it against the history. Returns (seq, digest,
        recorded event or None). ``digest``: ``args_digest(kind, name, args)`` when the
        caller has computed it already (:meth:`recorded_match`); computed here otherwise."""
        self.check_pending()
        if threading.get_ident() != self._thread:
            raise WorkflowUsageError(
                "durable calls must come from the advance's thread (positions would depend "
                "on thread scheduling)"
            )
        if self.in_step:
            raise WorkflowUsageError(
                f"{kind} {name!r} called inside ctx.step/ctx.transaction: durable calls "
                "cannot be nested"
            )
        self.seq += 1
        seq = self.seq
        if digest is None:
            digest = args_digest(kind, name, args)
        ev = self.history.get(seq)
        if ev is not None and ev.kind == "cancel":
            raise WorkflowCancelled(f"workflow {self.claimed.workflow_id!r} was cancelled "
                                    f"(seq {seq})")
        if ev is None and self._cancel_pending():
            self._record_cancel(seq)
        if ev is None and self.dry_run:
            raise self.suspend(f"replay reached the frontier at seq {seq}")
        if ev is not None and (ev.kind, ev.name, ev.args_digest) != (kind, name, digest):
            raise self.control(NonDeterminismError(
                f"seq {seq}: code did {_describe(kind, name, args)} (args digest {digest}), "
                f"history has {_describe(ev.kind, ev.name, self._recorded_args(seq))} "
                f"(args digest {ev.args_digest})"
            ))
        return seq, digest, ev

    def recorded_match(self, kind: str, name: str | None, args: Any) -> tuple[str, bool]:
        """``(digest, matches)``: the digest of the next durable call and whether the
        history already records that very call (kind, name and digest) at the next
        position. A matching call was validated when it was recorded: its replay skips the
        checks that depend on the arguments only (the message size); a call that does not
        match is checked as a new one, and :meth:`next` (given this ``digest``) reports the
        mismatch."""
        digest = args_digest(kind, name, args)
        ev = self.history.get(self.seq + 1)
        return digest, ev is not None and (ev.kind, ev.name, ev.args_digest) == (
            kind, name, digest)

    def _recorded_args(self, seq: int) -> Any:
        """The stored ``args`` of the event at ``seq`` (for an error message only), or
        ``None`` when they cannot be read."""
        try:
            with self.store.connect() as conn:
                return conn.execute(
                    select(workflow_events.c.args).where(
                        workflow_events.c.workflow_pk == self.claimed.pk,
                        workflow_events.c.run_no == self.claimed.run_no,
                        workflow_events.c.seq == seq,
                    )
                ).scalar()
        except Exception:  # the message is still right without them
            return None

    def check_size(self, kind: str, name: str | None, args: Any, what: str, *,
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
        ev = self.history.get(self.seq + 1)
        if ev is not None and (ev.kind, ev.name, ev.args_digest) == (
                kind, name, args_digest(kind, name, args)):
            return
        raise limits.size_error(what, size)

    def record(
        self, seq: int, kind: str, name: str | None, digest: str, args: Any, *,
        state: str, result: Any = None, error: Any = None,
        fire_at: datetime | None = None, run_key: str | None = None,
        effect: Callable[..., Any] | None = None,
        holder: dict[str, Any] | None = None, dispatch: bool = False,
    ) -> Any:
        """Record position ``seq`` (the frontier) in one fenced transaction with ``effect``
        (``effect(conn)`` runs first; its return value is the event's result). ``effect``
        may set ``holder["fire_at"]`` (computed on the DB clock in this transaction) and
        ``holder["done"]`` (the event is recorded ``completed`` at once).

        ``dispatch``: ``effect`` only sends (its return value is not the result, it sets
        nothing in ``holder``); on psycopg it is called ``effect(conn, fenced)`` and passes
        ``fenced`` to :func:`reliable_beat.handoff.add`: the fence check, the event's insert
        and the message's insert are then one statement (the workflow row is locked first
        either way)."""
        if self.claimed.history_len + seq - self.last_recorded > self.definition.history_limit:
            raise _HistoryLimit(
                f"history_limit: run {self.claimed.run_no} would pass "
                f"{self.definition.history_limit} events at seq {seq} ({kind} {name}); "
                "continue as new before it (ctx.continue_as_new when "
                "ctx.info.continue_as_new_suggested) or raise the limit, then resume"
            )
        crashes.crash_point(f"record.{kind}.before")
        try:
            # an activity's message is published right after this commit (handoff)
            with handoff.after_commit(self.store), self.store.begin() as conn:
                size = len(canonical_json([args, result]))
                if dispatch and holder is None and uses_psycopg(conn):
                    self._fenced_event_then(conn, effect, size, dict(
                        workflow_pk=self.claimed.pk, run_no=self.claimed.run_no, seq=seq,
                        kind=kind, name=name, args_digest=digest, args=args, state=state,
                        result=result, error=error, fire_at=fire_at, run_key=run_key,
                        fence_token=self.claimed.fence_token))
                else:
                    result = self._fence_effect_event(
                        conn, seq, kind, name, digest, args, size, state=state,
                        result=result, error=error, fire_at=fire_at, run_key=run_key,
                        effect=effect, holder=holder)
                crashes.crash_point(f"record.{kind}.in")
        except FencedOut as exc:
            raise self.control(exc) from None
        crashes.crash_point(f"record.{kind}.after")
        return result

    def _fence_effect_event(
        self, conn: Connection, seq: int, kind: str, name: str | None, digest: str,
        args: Any, size: int, *, state: str, result: Any, error: Any,
        fire_at: datetime | None, run_key: str | None,
        effect: Callable[[Connection], Any] | None, holder: dict[str, Any] | None,
    ) -> Any:
        """The fence check, ``effect``, then the event's insert; the event's result."""
        now = fence_check(conn, self.claimed, events=1, size=size)
        if effect is not None:
            result = effect(conn)
        if holder:
            fire_at = holder.get("fire_at", fire_at)
            if holder.get("done"):
                state = "completed"
        event = dict(
            workflow_pk=self.claimed.pk, run_no=self.claimed.run_no, seq=seq,
            kind=kind, name=name, args_digest=digest, args=args, state=state,
            result=result, error=error, fire_at=fire_at, run_key=run_key,
            fence_token=self.claimed.fence_token, created_at=now,
            completed_at=now if state != "scheduled" else None,
        )
        if uses_psycopg(conn):  # the same insert, fixed SQL on the driver
            pg_statements.insert_event(conn, event)
        else:
            conn.execute(workflow_events.insert().values(**event))
        return result

    def _fenced_event_then(self, conn: Connection, effect: Callable[..., Any] | None,
                           size: int, event: dict[str, Any]) -> None:
        """psycopg, a record that only dispatches: the fence check and the event's insert
        in one statement (the workflow row locked first, as :func:`fence_check` does),
        then ``effect`` (its message) in the same transaction. ``effect(conn, fenced)``
        passes ``fenced`` to :func:`reliable_beat.handoff.add`, which runs it with the
        message's insert (one statement: the fence check, the event and the outbox row), or
        alone before the insert on any other path."""
        ran: list[bool] = []

        def fenced(c: Connection, outbox_params: dict[str, Any] | None) -> Any:
            if ran:
                raise RuntimeError("a record's fence check ran twice")
            ran.append(True)
            if outbox_params is None:
                done: Any = pg_statements.fence_check_and_insert_event(
                    c, self.claimed.pk, self.claimed.fence_token, self.claimed.lease, size,
                    event)
                row = None
            else:
                done = pg_statements.fence_check_event_and_outbox(
                    c, self.claimed.pk, self.claimed.fence_token, self.claimed.lease, size,
                    event, outbox_params)
                row = None if done is None else done[1]
            if done is None:
                raise FencedOut(f"workflow {self.claimed.workflow_id!r}: fence "
                                f"{self.claimed.fence_token} is stale")
            return row

        if effect is not None:
            effect(conn, fenced)
        if not ran:  # an effect that wrote no message: the fence check alone
            fenced(conn, None)

    def complete(self, seq: int, state: str, result: Any = None, error: Any = None,
                 effect: Callable[[Connection], Any] | None = None) -> Any:
        """Complete the scheduled event at ``seq`` (fenced)."""
        if self.dry_run:
            raise self.suspend(f"replay stops before completing seq {seq}")
        crashes.crash_point("complete.before")
        try:
            with self.store.begin() as conn:
                fence_check(conn, self.claimed)
                if effect is not None:
                    result = effect(conn)
                conn.execute(
                    update(workflow_events)
                    .where(workflow_events.c.workflow_pk == self.claimed.pk,
                           workflow_events.c.run_no == self.claimed.run_no,
                           workflow_events.c.seq == seq,
                           workflow_events.c.state == "scheduled")
                    .values(state=state, result=result, error=error,
                            completed_at=db_now(conn))
                )
        except FencedOut as exc:
            raise self.control(exc) from None
        crashes.crash_point("complete.after")
        return result

    def suspend(self, why: str) -> Suspend:
        """The :class:`Suspend` to raise; a cancel recorded or pending at the next position
        is raised instead (it interrupts the wait)."""
        recorded = self.history.get(self.seq + 1)
        if recorded is not None and recorded.kind == "cancel" and not self.unwinding:
            self.seq += 1  # cancelled while it waited here: replay the cancel, not the wait
            raise WorkflowCancelled(f"workflow {self.claimed.workflow_id!r} was cancelled "
                                    f"(seq {self.seq})")
        if self._cancel_pending():  # a cancel interrupts the wait (at the next position)
            self.seq += 1
            self._record_cancel(self.seq)
        return self.control(Suspend(why))

    # ---------------------------------------------------------------- cancel ----

    def _cancel_pending(self) -> bool:
        """A cooperative cancel was asked for and not yet raised in this run."""
        if self.dry_run or self.unwinding:
            return False
        if self._cancel_checked is None:
            self._cancel_checked = saga.cancel_requested(self)
        return self._cancel_checked

    def _record_cancel(self, seq: int) -> None:
        """Record a ``cancel`` event at ``seq`` and raise :class:`WorkflowCancelled`."""
        digest = args_digest("cancel", None, None)
        self.record(seq, "cancel", None, digest, None, state="completed")
        self.history[seq] = Event(seq, "cancel", None, digest, "completed", None, None, None,
                                  None)
        self._cancel_checked = False
        raise WorkflowCancelled(f"workflow {self.claimed.workflow_id!r} was cancelled "
                                f"(seq {seq})")


class _HistoryLimit(WorkflowControl):
    """The run reached its history limit (the workflow is blocked)."""


class StoreTrouble(WorkflowControl):
    """A database error under a durable call; the advance fails and is retried."""


def _seconds(value: float) -> str:
    return f"{int(value)}s" if float(value).is_integer() else f"{value}s"


def _describe(kind: str, name: str | None, args: Any) -> str:
    """A position as a person reads it in a non-determinism message: ``activity
    billing.charge``, ``timer sleep 40s``, ``timer until 2026-01-10T12:00:00+00:00``."""
    if kind == "timer":
        if isinstance(args, str):  # stored args read back as JSON text (some dialects)
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
