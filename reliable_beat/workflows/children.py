"""Child workflows: ``ctx.child(wf, ...)`` / ``ctx.start_child`` + ``ctx.wait_child``
(docs/workflows.md, "Children").

Starting a child records a ``child`` event at the parent's next position and, in the same
fenced transaction, starts the child (idempotent on its workflow id, which defaults to
``<parent id>/child<run>.<seq>``) and links it to that event (``parent_pk``, ``parent_run_no``,
``parent_seq`` on the child's row). The child's end (``completed``, ``failed``, ``cancelled``)
completes the parent's event and wakes the parent **in the child's terminal transaction**:
there is no moment where the child is over and its parent was not told. If that write is
ever missing (a child ended by an older worker), the parent's wait repairs it from the
child's row, fenced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from reliable_beat.db.tables import workflow_events, workflows
from reliable_beat.values import from_json_value
from reliable_beat.workflows import history, registry
from reliable_beat.workflows._runtime import Event, Runtime
from reliable_beat.workflows.errors import ActivityError, WorkflowUsageError
from reliable_beat.workflows.lifecycle import CHILD_KIND, ENDED, child_outcome, notify_parent

__all__ = ["CHILD_KIND", "ChildHandle", "child_id_for", "notify_parent", "resolve",
           "start_child", "wait_child"]

@dataclass(frozen=True)
class ChildHandle:
    """A started child workflow (``ctx.start_child``): wait with ``ctx.wait_child``."""

    seq: int
    name: str
    workflow_id: str


def child_id_for(parent_id: str, run_no: int, seq: int) -> str:
    """The default id of the child started at ``seq``: ``<parent id>/child<run>.<seq>``."""
    return f"{parent_id}/child{run_no}.{seq}"


def start_child(rt: Runtime, wf: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                workflow_id: str | None) -> ChildHandle:
    """See :meth:`WorkflowContext.start_child`."""
    name = wf if isinstance(wf, str) else getattr(wf, "name", None)
    if not isinstance(name, str):
        raise WorkflowUsageError(
            f"ctx.start_child needs a @workflow definition or a registered workflow name, "
            f"got {wf!r}"
        )
    call = history.to_json([list(args), kwargs, workflow_id], f"child {name!r} arguments")
    digest, recorded = rt.recorded_match(CHILD_KIND, name, call)
    if not recorded:  # a replayed call was size-checked when it was recorded
        rt.check_size(CHILD_KIND, name, call, f"child {name!r} arguments")
    seq, digest, ev = rt.next(CHILD_KIND, name, call, digest=digest)
    claimed = rt.claimed
    child_id = workflow_id or child_id_for(claimed.workflow_id, claimed.run_no, seq)
    if ev is None:
        definition = registry.get_definition(name)
        queue = definition.queue if definition is not None else claimed.queue

        def launch(conn: Connection) -> None:
            # the child runs where its parent runs: its parent's schedule group
            group = conn.execute(select(workflows.c.schedule_group)
                                 .where(workflows.c.id == claimed.pk)).scalar()
            registry.start(conn, name, child_id, call[0], call[1], queue=queue,
                           schedule_group=group)
            linked = conn.execute(
                update(workflows)
                .where(workflows.c.workflow_id == child_id, workflows.c.parent_pk.is_(None))
                .values(parent_pk=claimed.pk, parent_run_no=claimed.run_no, parent_seq=seq)
            ).rowcount
            if linked != 1:
                raise WorkflowUsageError(
                    f"child workflow id {child_id!r} already belongs to another parent: give "
                    "ctx.start_child a workflow_id of its own"
                )

        rt.record(seq, CHILD_KIND, name, digest, call, state="scheduled", effect=launch,
                  run_key=child_id)
        rt.history[seq] = Event(seq, CHILD_KIND, name, digest, "scheduled", None, None, None,
                                child_id)
    return ChildHandle(seq=seq, name=name, workflow_id=child_id)


def resolve(rt: Runtime, handle: ChildHandle) -> tuple[bool, Any]:
    """(done, event) for a started child; repairs a missing completion from the child's row."""
    ev = rt.history[handle.seq]
    if ev.state != "scheduled":
        return True, ev
    with rt.store.connect() as conn:
        event = conn.execute(
            select(workflow_events.c.state, workflow_events.c.result, workflow_events.c.error)
            .where(workflow_events.c.workflow_pk == rt.claimed.pk,
                   workflow_events.c.run_no == rt.claimed.run_no,
                   workflow_events.c.seq == handle.seq)
        ).first()
        child = conn.execute(
            select(workflows.c.state, workflows.c.result, workflows.c.error)
            .where(workflows.c.workflow_id == handle.workflow_id)
        ).first()
    if event is not None and event.state != "scheduled":
        done = Event(handle.seq, CHILD_KIND, handle.name, ev.args_digest, event.state,
                     event.result, event.error, None, handle.workflow_id)
    elif child is not None and child.state in ENDED:
        state, result, error = child_outcome(child.state, child.result, child.error)
        rt.complete(handle.seq, state, result, error)
        done = Event(handle.seq, CHILD_KIND, handle.name, ev.args_digest, state, result, error,
                     None, handle.workflow_id)
    else:
        return False, ev
    rt.history[handle.seq] = done
    return True, done


def wait_child(rt: Runtime, handle: ChildHandle) -> Any:
    """See :meth:`WorkflowContext.wait_child`."""
    rt.check_pending()
    done, ev = resolve(rt, handle)
    if not done:
        raise rt.suspend(f"waiting for child workflow {handle.workflow_id!r}")
    if ev.state == "failed":
        err = ev.error or {}
        raise ActivityError(str(err.get("type")), str(err.get("message")), kind=CHILD_KIND,
                            name=handle.name)
    return from_json_value(ev.result)
