"""Activities: ``ctx.activity``, ``ctx.start_activity``, ``ctx.wait``, ``ctx.wait_all``,
``ctx.wait_any`` (docs/workflows.md, "Activities").

An activity is an ``IdempotentTask`` run keyed ``wf:<id>/<run>#<seq>`` dispatched through the
outbox: its ``activity`` event and its message commit in one fenced transaction, and its
completing transaction writes the result into the history with its effect (the completion
hook). A completion that is missing (an older worker) is repaired from the run row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from reliable_beat import handoff, tracing
from reliable_beat.db.tables import runs, workflow_events
from reliable_beat.workflow_store import WAKE_DESTINATION, activity_key, group_of
from reliable_beat.workflows._runtime import Event, Runtime
from reliable_beat.workflows.errors import WorkflowUsageError
from reliable_beat.workflows.history import outcome, to_json

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

__all__ = ["ActivityHandle", "activity_message", "resolve", "start_activity", "wait_all",
           "wait_any"]


@dataclass(frozen=True)
class ActivityHandle:
    """A started activity (``ctx.start_activity``): wait for it with ``ctx.wait_all`` /
    ``ctx.wait_any`` (or ``ctx.wait(handle)``)."""

    seq: int
    name: str
    key: str


def activity_message(rt: Runtime, task_name: str, call: list[Any], queue: str | None,
                     seq: int | None = None) -> dict[str, Any]:
    """The outbox payload of the activity (or compensation) ``task_name`` called with
    ``call`` (``[args, kwargs]``) at position ``seq`` (None: the next one)."""
    key = activity_key(rt.claimed.workflow_id, rt.claimed.run_no,
                       rt.seq + 1 if seq is None else seq)
    payload: dict[str, Any] = {"task": task_name, "args": call[0], "kwargs": call[1],
                               "headers": {"reliable_beat_key": key}}
    if queue:
        payload["options"] = {"queue": queue}
    return payload


def start_activity(rt: Runtime, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   queue: str | None) -> ActivityHandle:
    """See :meth:`WorkflowContext.start_activity`."""
    if not isinstance(task, str) and not callable(getattr(task, "returns", None)):
        raise WorkflowUsageError(
            f"activity {getattr(task, 'name', task)!r} is not an IdempotentTask: an "
            "activity's completion must write the workflow's history with its effect; "
            "use @app.task(base=IdempotentTask, bind=True) (a task given by name must be one)"
        )
    task_name = task if isinstance(task, str) else str(task.name)
    call = to_json([list(args), kwargs], f"activity {task_name!r} arguments")
    # one digest per call; a call the history records as it is (a replay) was size-checked
    # when it was recorded, and its message is not built again
    digest, recorded = rt.recorded_match("activity", task_name, call)
    if not recorded:
        rt.check_size("activity", task_name, call,
                      f"activity {task_name!r} arguments (in their message)",
                      message=activity_message(rt, task_name, call, queue))
    seq, digest, ev = rt.next("activity", task_name, call, digest=digest)
    key = activity_key(rt.claimed.workflow_id, rt.claimed.run_no, seq)
    if ev is None:
        payload = activity_message(rt, task_name, call, queue, seq)
        # the activity joins the workflow's trace (not part of the size check: the
        # check must not depend on whether tracing is on)
        payload["headers"].update(tracing.carrier())

        def dispatch(conn: Connection, fenced: Any = None) -> None:
            # published by this advance right after the commit (reliable_beat.handoff)
            # the row's group: the workflow's (set at its start, never changed), as its
            # claim read it; not known (a claim that did not read it): read in the insert.
            # ``fenced`` (psycopg): the record's fence check and event, run by the insert
            extra = rt.claimed.extra
            handoff.add(conn, WAKE_DESTINATION, payload, key=f"act:{key}",
                        group=extra.get("schedule_group", handoff.UNKNOWN),
                        schedule_group=extra["schedule_group"] if "schedule_group" in extra
                        else group_of(rt.claimed.workflow_id), fenced=fenced)

        # stored with its queue (not part of the digest), for the re-dispatch sweep
        rt.record(seq, "activity", task_name, digest, [*call, queue],
                  state="scheduled", run_key=key, effect=dispatch, dispatch=True)
        rt.dispatched.add(seq)
        rt.history[seq] = Event(seq, "activity", task_name, digest, "scheduled", None,
                                None, None, key)
    return ActivityHandle(seq=seq, name=task_name, key=key)


def resolve(rt: Runtime, handle: ActivityHandle) -> tuple[bool, Any]:
    """(done, event) for a started activity; records its completion if the run ended."""
    ev = rt.history[handle.seq]
    if ev.state != "scheduled":
        return True, ev
    if handle.seq in rt.dispatched:
        # dispatched by this very advance: if it has already completed, its completion
        # bumped wake_seq after our claim, so the release's wake_seq check runs the code
        # again with the new history; no need to read the run and the event now
        return False, ev
    with rt.store.connect() as conn:
        run = conn.execute(
            select(runs.c.state, runs.c.result, runs.c.error)
            .where(runs.c.idempotency_key == handle.key)
        ).first()
        event = conn.execute(
            select(workflow_events.c.state, workflow_events.c.result,
                   workflow_events.c.error)
            .where(workflow_events.c.workflow_pk == rt.claimed.pk,
                   workflow_events.c.run_no == rt.claimed.run_no,
                   workflow_events.c.seq == handle.seq)
        ).first()
    if event is not None and event.state != "scheduled":  # completed by the hook
        done = Event(handle.seq, "activity", handle.name, ev.args_digest, event.state,
                     event.result, event.error, None, handle.key)
    elif run is not None and run.state in ("succeeded", "dead"):
        # the completion hook's write is missing (e.g. an older worker): repair from the
        # run row, which committed with the activity's effect
        state = "completed" if run.state == "succeeded" else "failed"
        error = None if state == "completed" else {"type": "dead",
                                                    "message": (run.error or "")[-2000:]}
        rt.complete(handle.seq, state, run.result, error)
        done = Event(handle.seq, "activity", handle.name, ev.args_digest, state,
                     run.result, error, None, handle.key)
    else:
        return False, ev
    rt.history[handle.seq] = done
    return True, done


def wait_all(rt: Runtime, handles: Sequence[ActivityHandle]) -> list[Any]:
    """See :meth:`WorkflowContext.wait_all`."""
    rt.check_pending()
    resolved = [resolve(rt, h) for h in handles]
    if not all(done for done, _ in resolved):
        waiting = [h.name for h, (done, _) in zip(handles, resolved, strict=True) if not done]
        raise rt.suspend(f"waiting for activities {waiting}")
    return [outcome(ev.state, ev.result, ev.error, "activity", h.name)
            for h, (_, ev) in zip(handles, resolved, strict=True)]


def wait_any(rt: Runtime, handles: Sequence[ActivityHandle]) -> tuple[int, Any]:
    """See :meth:`WorkflowContext.wait_any`."""
    seqs = [h.seq for h in handles]
    seq, digest, ev = rt.next("wait_any", None, seqs)
    if ev is None:
        resolved = [resolve(rt, h) for h in handles]
        first = next((i for i, (done, _) in enumerate(resolved) if done), None)
        if first is None:
            rt.seq -= 1  # not recorded: the position is taken when it is satisfied
            raise rt.suspend("waiting for any activity")
        rt.record(seq, "wait_any", None, digest, seqs, state="completed", result=first)
        index = first
    else:
        index = int(ev.result)
    _, chosen = resolve(rt, handles[index])
    return index, outcome(chosen.state, chosen.result, chosen.error, "activity",
                          handles[index].name)
