"""``ctx.continue_as_new``: end this run and start the next one under the same workflow id,
with an empty history and the arguments given (docs/workflows.md, "Continue-as-new").

Events are keyed by ``(workflow, run_no, seq)`` and signals by workflow: the switch is one
fenced transaction on the workflow row (``run_no + 1``, the new arguments, history counters
back to 0, the current code's ``version``, ``pending`` + a wake). Signals not yet consumed stay
in the inbox and are consumed by the next run. What cannot cross the boundary is refused
(the workflow is ``blocked`` with the reason, nothing is written): activities still open (their
completion belongs to the old run's history), children still running (their end completes
an event of the old run), saga blocks still open (their compensations too).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update

from reliable_beat import tracing, workflow_store
from reliable_beat.db.dialects import update_returning
from reliable_beat.db.tables import workflows
from reliable_beat.outbox import db_now
from reliable_beat.workflows import activities, children, crashes, lifecycle, limits
from reliable_beat.workflows._runtime import Runtime
from reliable_beat.workflows.activities import ActivityHandle
from reliable_beat.workflows.errors import WorkflowControl, WorkflowUsageError
from reliable_beat.workflows.history import to_json

__all__ = ["ContinueAsNew", "ContinueAsNewRefused", "continue_as_new", "open_work", "switch_run"]


class ContinueAsNew(WorkflowControl):
    """Raised by ``ctx.continue_as_new``: the engine ends the run and starts the next one.

    Attributes:
        next_args / next_kwargs: the next run's arguments (JSON, already checked).
    """

    def __init__(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        super().__init__(f"continue as new with args {args!r} kwargs {kwargs!r}")
        self.next_args = args
        self.next_kwargs = kwargs


class ContinueAsNewRefused(WorkflowControl):
    """``ctx.continue_as_new`` while work of this run is still open (the workflow blocks)."""


def _new_trace(claimed: Any) -> dict[str, Any]:
    """``{"traceparent": ...}`` of the new run's root span, linked to this run's, or nothing
    when tracing is off."""
    tp = tracing.linked_root(f"continue workflow {claimed.name}",
                             workflow_id=claimed.workflow_id, workflow_run=claimed.run_no + 1)
    return {"traceparent": tp} if tp else {}


def open_work(rt: Runtime) -> list[str]:
    """What of this run cannot cross a run boundary: ``["activity wfa.charge at seq 3",
    "saga block"]``; empty when ``continue_as_new`` may be called."""
    found: list[str] = []
    for seq in sorted(rt.history):
        if seq > rt.seq:
            break
        ev = rt.history[seq]
        if ev.kind == "activity" and ev.state == "scheduled":
            done, _ = activities.resolve(rt, ActivityHandle(seq=seq, name=str(ev.name),
                                                            key=str(ev.run_key)))
            if not done:
                found.append(f"activity {ev.name} at seq {seq}")
        elif ev.kind == children.CHILD_KIND and ev.state == "scheduled":
            done, _ = children.resolve(rt, children.ChildHandle(
                seq=seq, name=str(ev.name), workflow_id=str(ev.run_key)))
            if not done:
                found.append(f"child workflow {ev.run_key} at seq {seq}")
    # saga blocks (reliable_beat.workflows.saga) count their open blocks here
    sagas = rt.open_sagas
    if sagas:
        found.append(f"{sagas} saga block(s)")
    return found


def continue_as_new(rt: Runtime, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """See :meth:`WorkflowContext.continue_as_new`: raises :class:`ContinueAsNew` (or
    :class:`ContinueAsNewRefused` while work of this run is open) for the advance."""
    call_args = to_json(list(args), "continue_as_new args")
    call_kwargs = to_json(dict(kwargs), "continue_as_new kwargs")
    rt.check_pending()
    if rt.in_step:
        raise WorkflowUsageError("ctx.continue_as_new inside ctx.step/ctx.transaction")
    if rt.dry_run:
        raise rt.suspend(f"replay reached continue_as_new at seq {rt.seq}")
    limits.check_size("continue_as_new arguments", call_args, call_kwargs)
    still_open = open_work(rt)
    if still_open:
        raise rt.control(ContinueAsNewRefused(
            f"continue_as_new refused at seq {rt.seq} of run {rt.claimed.run_no}: "
            f"{', '.join(still_open)} still open (their completions belong to this run); "
            "wait for them (ctx.wait_all) before continuing, e.g. `if ctx.all_settled():`; "
            "fix the code, then `workflows resume`"
        ))
    raise rt.control(ContinueAsNew(call_args, call_kwargs))


def switch_run(rt: Runtime, request: ContinueAsNew) -> str:
    """End run *n* and start run *n + 1* in one fenced transaction. Returns ``continued``,
    ``fenced`` or the state a failed check led to (``blocked``)."""
    claimed = rt.claimed
    tail = rt.tail_check()
    if tail:
        return tail
    crashes.crash_point("continue.before")
    with rt.store.begin() as conn:
        now = db_now(conn)
        switched = update_returning(
            conn,
            update(workflows)
            .where(workflows.c.id == claimed.pk,
                   workflows.c.fence_token == claimed.fence_token)
            .values(
                run_no=claimed.run_no + 1, args=request.next_args, kwargs=request.next_kwargs,
                state="pending", history_len=0, history_bytes=0,
                version=rt.definition.version, wake_seq=workflows.c.wake_seq + 1,
                leased_by=None, lease_expires_at=None, updated_at=now,
                advances=0,  # the crash-loop budget is per run: a long loop is not a crash loop
                # the new run's trace, linked to this one's (a trace never grows unbounded);
                # the column only while tracing is on (a store not yet upgraded to it)
                **_new_trace(claimed),
            ),
            workflows, [workflows.c.wake_seq],
        )
        row = switched[0] if switched else None
        if row is None:
            return "fenced"
        workflow_store.add_wake(conn, claimed.workflow_id, claimed.queue,
                                f"run{claimed.run_no + 1}")
    crashes.crash_point("continue.after")
    lifecycle.log.info("workflow %s continued as new: run %d -> %d", claimed.workflow_id,
                       claimed.run_no, claimed.run_no + 1)
    return "continued"
