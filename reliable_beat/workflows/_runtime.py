"""The runtime protocol: the few operations the engine's extensions call on a running
workflow (Temporal's ``_Runtime``; DBOS keeps its extensions on the same kind of seam).

Activities, timers, signals, steps, sagas, child workflows, continue-as-new and patches are
written against :class:`Runtime`, never against :class:`~reliable_beat.workflows.context.
WorkflowContext`: the context is the user's object, and a
:class:`~reliable_beat.workflows.replay.Replay` it owns implements this protocol (positions
in the history, the fenced record of the frontier, completion, suspension). So an extension
needs no private member of the context, the context needs no engine-only public method, and
the rooms import downwards only.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from reliable_beat.workflows.errors import Suspend, WorkflowControl

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from reliable_beat.db.dialects import Store
    from reliable_beat.workflows.history import Claimed
    from reliable_beat.workflows.registry import WorkflowDefinition

__all__ = ["Event", "Runtime", "current", "enter", "leave"]

_C = TypeVar("_C", bound=WorkflowControl)


@dataclass
class Event:
    """One position of the run's history as replay reads it (the columns
    :func:`~reliable_beat.workflows.history.load_history` selects)."""

    seq: int
    kind: str
    name: str | None
    args_digest: str
    state: str
    result: Any
    error: Any
    fire_at: datetime | None
    run_key: str | None


class Runtime(Protocol):
    """A running workflow as the extensions see it.

    Attributes:
        store: the store; claimed: the workflow row this advance claimed (fence token,
            ids, run); definition: the registered definition running.
        history: the run's events by seq; an extension that records or completes a
            position writes its new :class:`Event` here.
        seq: the position the code has reached (the last one taken).
        dry_run: an offline replay (``workflows replay``): stop at the frontier, write
            nothing.
        dispatched: activity seqs recorded by this advance (their completion wakes it).
        in_step: inside ``ctx.step`` / ``ctx.transaction`` (no durable call may nest);
            step_key: that step's idempotency key.
        unwinding: a saga runs its compensations (no cancel point).
        open_sagas: saga blocks open now (continue-as-new refuses to cross one).
        patches: ``ctx.patched`` answers of this run, by patch id.
    """

    store: Store
    claimed: Claimed
    definition: WorkflowDefinition
    history: dict[int, Any]
    seq: int
    dry_run: bool
    dispatched: set[int]
    in_step: bool
    step_key: str | None
    unwinding: bool
    open_sagas: int
    patches: dict[str, bool]

    def check_caller(self, what: str) -> None:
        """Refuse a durable call from another thread or inside a step; re-raise the
        engine's control flow the code swallowed."""

    def check_pending(self) -> None:
        """Re-raise the engine's control flow the code swallowed, if any."""

    def next(self, kind: str, name: str | None, args: Any, *,
             digest: str | None = None) -> tuple[int, str, Any]:
        """Take the next position and check it against the history: ``(seq, digest,
        recorded event or None)``; ``digest``: the call's, if already computed."""

    def recorded_match(self, kind: str, name: str | None, args: Any) -> tuple[str, bool]:
        """``(digest, matches)``: the next call's digest; whether the history records it."""

    def check_size(self, kind: str, name: str | None, args: Any, what: str, *,
                   message: Any = None) -> None:
        """Refuse a call whose arguments (or outbox ``message``) are over the size limit."""

    def record(self, seq: int, kind: str, name: str | None, digest: str, args: Any, *,
               state: str, result: Any = None, error: Any = None,
               fire_at: datetime | None = None, run_key: str | None = None,
               effect: Callable[[Connection], Any] | None = None,
               holder: dict[str, Any] | None = None, dispatch: bool = False) -> Any:
        """Record the frontier at ``seq`` in one fenced transaction with ``effect``
        (``dispatch``: ``effect`` only sends a message, its return value unused)."""

    def complete(self, seq: int, state: str, result: Any = None, error: Any = None,
                 effect: Callable[[Connection], Any] | None = None) -> Any:
        """Complete the scheduled event at ``seq`` (fenced)."""

    def suspend(self, why: str) -> Suspend:
        """The :class:`Suspend` to raise (a pending cancel interrupts the wait instead)."""

    def control(self, exc: _C) -> _C:
        """Remember engine control flow ``exc`` before it is raised into the code (a code
        that swallows it gets it again at its next durable call)."""

    def tail_check(self) -> str | None:
        """Block the workflow if the code ended before the history does; the outcome."""


_current: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar(
    "reliable_beat_workflow_runtime", default=None)


def current() -> Runtime:
    """The runtime of the workflow code running in this thread.

    Raises:
        RuntimeError: no workflow code runs here.
    """
    rt = _current.get()
    if rt is None:
        raise RuntimeError("no workflow code is running in this thread")
    return rt


def enter(rt: Runtime) -> contextvars.Token[Runtime | None]:
    """Make ``rt`` the current runtime (the advance, while the workflow code runs)."""
    return _current.set(rt)


def leave(token: contextvars.Token[Runtime | None]) -> None:
    """Undo :func:`enter`."""
    _current.reset(token)
