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

The context is the user's object and delegates: the calls live in their rooms
(:mod:`~reliable_beat.workflows.steps`, :mod:`~reliable_beat.workflows.activities`,
:mod:`~reliable_beat.workflows.waits`, :mod:`~reliable_beat.workflows.saga`,
:mod:`~reliable_beat.workflows.children`, :mod:`~reliable_beat.workflows.continuation`,
:mod:`~reliable_beat.workflows.versioning`), written against the runtime protocol
(:mod:`~reliable_beat.workflows._runtime`) that the context's
:class:`~reliable_beat.workflows.replay.Replay` implements.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sqlalchemy.exc import DBAPIError

from reliable_beat.redaction import get_logger
from reliable_beat.workflows import (
    activities,
    children,
    continuation,
    steps,
    tripwire,
    versioning,
    waits,
)
from reliable_beat.workflows._runtime import Event
from reliable_beat.workflows.activities import ActivityHandle
from reliable_beat.workflows.errors import WorkflowUsageError
from reliable_beat.workflows.replay import Replay, StoreTrouble
from reliable_beat.workflows.saga import Saga

if TYPE_CHECKING:
    from reliable_beat.db.dialects import Store
    from reliable_beat.workflows.history import Claimed
    from reliable_beat.workflows.registry import WorkflowDefinition

__all__ = ["ActivityHandle", "WorkflowContext", "WorkflowInfo", "current_context"]

#: The recorded event as replay reads it (now :class:`reliable_beat.workflows._runtime.Event`).
_Ev = Event

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


class _ReplayFilter(logging.Filter):
    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__()
        self._ctx = ctx

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._ctx.is_replaying


_F = TypeVar("_F", bound=Callable[..., Any])


def _durable(method: _F) -> _F:
    """Engine code (and steps, transactions) run with the tripwire off and the code clock
    paused (a deadline that passed raises here: :mod:`reliable_beat.workflows.runaway`)."""

    @functools.wraps(method)
    def wrapper(self: WorkflowContext, *args: Any, **kwargs: Any) -> Any:
        timed = self._rt.clock.pause()
        token = tripwire.in_workflow_code.set(False)
        try:
            return method(self, *args, **kwargs)
        except DBAPIError as exc:
            # the store failed under a durable call (connection lost, deadlock): not the
            # workflow's business; it must not be caught by its code nor recorded
            raise self._rt.control(StoreTrouble(str(exc))) from exc
        finally:
            tripwire.in_workflow_code.reset(token)
            self._rt.clock.resume(timed)

    return cast(_F, wrapper)


class WorkflowContext:
    """Passed as the first argument of a workflow function; see the module docstring.

    Not thread-safe by design: durable calls from a thread other than the advance's are
    refused (their positions would depend on scheduling).
    """

    def __init__(
        self, store: Store, claimed: Claimed, history: dict[int, Any],
        definition: WorkflowDefinition, *, dry_run: bool = False,
        code_timeout: float | None = None,
    ) -> None:
        #: the runtime the durable calls run on (positions, records, suspension)
        self._rt = Replay(store, claimed, history, definition, dry_run=dry_run,
                          code_timeout=code_timeout)
        base = get_logger(f"reliable_beat.workflows.{claimed.name}")
        self.logger = logging.LoggerAdapter(base, {"workflow_id": claimed.workflow_id})
        self._filter = _ReplayFilter(self)

    # ---------------------------------------------------------------- properties ----

    @property
    def info(self) -> WorkflowInfo:
        """Ids, run, history length and limit, position, ``continue_as_new_suggested``."""
        rt = self._rt
        d = rt.definition
        return WorkflowInfo(
            workflow_id=rt.claimed.workflow_id, name=rt.claimed.name,
            run_no=rt.claimed.run_no, history_length=rt.claimed.history_len,
            history_limit=d.history_limit, position=rt.seq,
            continue_as_new_suggested=rt.seq >= d.suggest_continue_at,
            version=d.version,
        )

    @property
    def fence_token(self) -> int:
        """This advance's fence token: pass it to other stores to fence their writes."""
        return self._rt.claimed.fence_token

    @property
    def is_replaying(self) -> bool:
        """True while the code is answered from the history (before the frontier)."""
        return self._rt.is_replaying

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

    @property
    def _step_key(self) -> str | None:
        """The key of the step running now (the runtime's), None outside a step."""
        return self._rt.step_key

    @property
    def open_sagas(self) -> int:
        """Saga blocks open right now (continue-as-new must refuse to cross one)."""
        return self._rt.open_sagas

    @open_sagas.setter
    def open_sagas(self, value: int) -> None:
        self._rt.open_sagas = value

    # ---------------------------------------------------------------- running ----

    def run_code(self, fn: Callable[..., Any]) -> str:
        """Run the workflow function; return ``suspended``, ``completed``, ``failed``,
        ``blocked`` or ``fenced`` (used by :func:`~reliable_beat.workflows.advance.advance`)."""
        token = _current.set(self)
        logger = self.logger.logger
        logger.addFilter(self._filter)
        try:
            return self._rt.run(fn, self)
        finally:
            logger.removeFilter(self._filter)
            _current.reset(token)

    def replay_code(self, fn: Callable[..., Any]) -> str | None:
        """Offline replay (``workflows replay``): run the code against the history, answer
        every recorded call from it, write nothing. Returns the first mismatch (position,
        both sides) or None."""
        token = _current.set(self)
        try:
            return self._rt.replay(fn, self)
        finally:
            _current.reset(token)

    # ---------------------------------------------------------------- sagas ----

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
        return Saga(self._rt, parallel=parallel, continue_on_error=continue_on_error)

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
        return steps.transaction(self._rt, fn, args, kwargs, name)

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
        return steps.step(self._rt, fn, args, kwargs, name)

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
        return activities.start_activity(self._rt, task, args, kwargs, queue)

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
        return activities.wait_all(self._rt, handles)

    @_durable
    def wait_any(self, *handles: ActivityHandle) -> tuple[int, Any]:
        """``(index, result)`` of the first of ``handles`` seen done; suspends until one is.

        Which one was first is recorded (a ``wait_any`` event), so a replay picks the same
        one even if more have finished since.

        Raises:
            ActivityError: the chosen activity failed.
        """
        return activities.wait_any(self._rt, handles)

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
        waits.sleep(self._rt, duration)

    @_durable
    def sleep_until(self, instant: datetime) -> None:
        """Durable sleep until ``instant`` (tz-aware; naive datetimes are refused).

        Raises:
            WorkflowValueError: ``instant`` is not a tz-aware ``datetime``.
        """
        waits.sleep_until(self._rt, instant)

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
        return waits.wait_signal(self._rt, name, timeout)

    # ---------------------------------------------------------------- recorded values ----

    @_durable
    def now(self) -> datetime:
        """The store's clock, recorded: replays return the same instant (UTC-aware)."""
        return steps.now(self._rt)

    @_durable
    def random(self) -> float:
        """A float in [0, 1) from a generator seeded per run (seed stored at start)."""
        self._rt.check_pending()
        return self._rt.random.random()

    @_durable
    def uuid4(self) -> uuid.UUID:
        """A version-4 UUID from the run's seeded generator (stable across replays)."""
        self._rt.check_pending()
        return uuid.UUID(int=self._rt.random.getrandbits(128), version=4)

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
        return versioning.patched(self._rt, patch_id)

    @_durable
    def deprecate_patch(self, patch_id: str) -> None:
        """Step 2 of removing a patch: consumes the marker ``patch <id>`` if the history has
        it at the next position, never records one. Once no run without the marker can
        exist, replace ``if ctx.patched(id): new else: old`` by ``deprecate_patch(id); new``;
        once no run with the marker can exist either, remove the call."""
        versioning.deprecate_patch(self._rt, patch_id)

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
        return children.start_child(self._rt, wf, args, kwargs, workflow_id)

    @_durable
    def wait_child(self, handle: children.ChildHandle) -> Any:
        """The child's result; suspends until it ends.

        Raises:
            ActivityError: the child failed (``type``/``message`` of its error) or was
                cancelled (``type`` ``"cancelled"``); ``kind`` is ``"child"``.
        """
        return children.wait_child(self._rt, handle)

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
        return not continuation.open_work(self._rt)

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
        continuation.continue_as_new(self._rt, args, kwargs)
