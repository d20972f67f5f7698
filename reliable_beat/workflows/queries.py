"""Reading workflows: one workflow with its events and signals, lists, counts, and the health
``reliable-beat status`` and the metrics report (blocked, overdue timers, crash loops,
runaway advances)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflow_events, workflow_signals, workflows
from reliable_beat.outbox import db_now
from reliable_beat.workflows import runaway
from reliable_beat.workflows.errors import WorkflowNotFound
from reliable_beat.workflows.history import ACTIVE_STATES
from reliable_beat.workflows.malformed import lenient_select, unknown_states

__all__ = [
    "CRASH_LOOP_ADVANCES",
    "get_workflow",
    "list_workflows",
    "overdue_timers",
    "workflow_counts",
    "workflow_health",
]

def _row_dict(row: Any) -> dict[str, Any]:
    m = dict(row._mapping)
    return {
        "workflow_id": m["workflow_id"], "name": m["name"], "state": m["state"],
        "run_no": m["run_no"], "args": m["args"], "kwargs": m["kwargs"],
        "result": m["result"], "error": m["error"], "block_reason": m["block_reason"],
        "version": m.get("version"), "queue": m["queue"], "fence_token": m["fence_token"],
        "leased_by": m["leased_by"], "entry_name": m.get("entry_name"),
        "slot_fire_at": m.get("fire_at"), "schedule_group": m.get("schedule_group"),
        "lease_expires_at": m["lease_expires_at"], "wake_seq": m["wake_seq"],
        "claimed_wake_seq": m["claimed_wake_seq"], "history_len": m["history_len"],
        "advances": m["advances"], "takeovers": m.get("takeovers", 0),
        "created_at": m["created_at"],
        "updated_at": m["updated_at"], "finished_at": m["finished_at"],
        "cancel_requested": m.get("cancel_requested"),
    }


def get_workflow(store: Store, workflow_id: str, *, events: bool = False) -> dict[str, Any]:
    """One workflow as a dict (see :meth:`WorkflowHandle.status`); with ``events`` also
    ``"events"`` (``[{"seq", "kind", "name", "state", "result", "error", "fire_at",
    "run_key", "args_digest"}]``) and ``"signals"`` (pending and consumed).

    Raises:
        WorkflowNotFound: no such workflow.
    """
    with store.connect() as conn:
        found = lenient_select(
            conn, select(workflows).where(workflows.c.workflow_id == workflow_id))
        if not found:
            raise WorkflowNotFound(f"no workflow {workflow_id!r} (see `workflows list`)")
        row = found[0]
        out = _row_dict(row)
        if events:
            evs = lenient_select(
                conn,
                select(workflow_events)
                .where(workflow_events.c.workflow_pk == row.id,
                       workflow_events.c.run_no == row.run_no)
                .order_by(workflow_events.c.seq)
            )
            out["events"] = [
                {k: e._mapping[k] for k in ("seq", "kind", "name", "args_digest", "state",
                                            "result", "error", "fire_at", "run_key",
                                            "fence_token", "created_at", "completed_at")}
                for e in evs
            ]
            # the columns shown (not `traceparent`: a store not yet upgraded lacks it)
            shown = ("id", "name", "payload", "dedup_key", "consumed_run_no", "consumed_seq",
                     "created_at")
            sigs = lenient_select(
                conn,
                select(*(workflow_signals.c[k] for k in shown))
                .where(workflow_signals.c.workflow_pk == row.id)
                .order_by(workflow_signals.c.id)
            )
            out["signals"] = [{k: s._mapping[k] for k in shown} for s in sigs]
    return out


def list_workflows(
    store: Store, *, state: str | None = None, name: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Workflows newest first, optionally of one state / name."""
    q = select(workflows).order_by(workflows.c.id.desc()).limit(limit)
    if state:
        q = q.where(workflows.c.state == state)
    if name:
        q = q.where(workflows.c.name == name)
    with store.connect() as conn:
        return [_row_dict(r) for r in lenient_select(conn, q)]


def workflow_counts(conn: Connection) -> dict[str, int]:
    """``{state: count}`` over all workflows (for ``status`` and metrics)."""
    rows = conn.execute(
        select(workflows.c.state, func.count()).group_by(workflows.c.state)
    ).all()
    return {str(s): int(n) for s, n in rows}


def overdue_timers(conn: Connection, *, grace: timedelta) -> int:
    """Timer / timeout events still ``scheduled`` more than ``grace`` after their fire_at
    on a workflow that is not running (a wake that did not arrive)."""
    now = db_now(conn)
    return int(conn.execute(
        select(func.count())
        .select_from(workflow_events.join(workflows,
                                          workflows.c.id == workflow_events.c.workflow_pk))
        .where(workflow_events.c.state == "scheduled",
               workflow_events.c.fire_at < now - grace,
               workflows.c.state == "waiting")
    ).scalar_one())


#: Advances of one workflow (claims since its last resume) past which it is crash-looping.
CRASH_LOOP_ADVANCES = 50


def workflow_health(
    store: Store, *, grace: timedelta,
    pending_after: timedelta = timedelta(seconds=runaway.DEFAULT_PENDING_ALARM_SECONDS),
    max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS,
) -> dict[str, Any]:
    """For ``reliable-beat status``: ``{"counts": {state: n}, "blocked": [ids],
    "overdue_timers": n, "crash_looping": [ids], "malformed_states": [ids of workflows
    whose state is none the engine writes], "advances_expiring": {"count", "workflows":
    [{"workflow_id", "takeovers", "leased_by", "lease_expires_at"}]}, "pending_late":
    {"count", "queues": {queue: n}, "workflow_ids"}, "problems": [str]}``.

    ``overdue_timers``: timers / signal timeouts of waiting workflows still scheduled more
    than ``grace`` after their fire_at (no relay publishes wakes?). ``crash_looping``: active
    workflows claimed more than :data:`CRASH_LOOP_ADVANCES` times (an advance that dies every
    time, e.g. a step that kills the worker). ``advances_expiring``: ``running`` workflows
    whose advance's lease expired twice in a row without finishing; ``pending_late``:
    ``pending`` longer than ``pending_after``
    (:mod:`reliable_beat.workflows.runaway`; ``max_takeovers`` is named in the advice).
    """
    with store.connect() as conn:
        counts = workflow_counts(conn)
        blocked_rows = conn.execute(
            select(workflows.c.workflow_id, workflows.c.block_reason)
            .where(workflows.c.state == "blocked")
            .order_by(workflows.c.updated_at).limit(20)).all()
        blocked = [r.workflow_id for r in blocked_rows]
        # a saga whose compensation was dead-lettered is unblocked by running the
        # compensations again (`workflows compensate`), not by `resume`
        by_compensation = [r.workflow_id for r in blocked_rows
                           if str(r.block_reason or "").startswith("compensation_failed")]
        overdue = overdue_timers(conn, grace=grace)
        overdue_ids = list(conn.execute(
            select(workflows.c.workflow_id).distinct()
            .select_from(workflow_events.join(
                workflows, workflows.c.id == workflow_events.c.workflow_pk))
            .where(workflow_events.c.state == "scheduled",
                   workflow_events.c.fire_at < db_now(conn) - grace,
                   workflows.c.state == "waiting")
            .limit(10)).scalars()) if overdue else []
        n_unknown, unknown = unknown_states(conn)
        looping = list(conn.execute(
            select(workflows.c.workflow_id)
            .where(workflows.c.state.in_(ACTIVE_STATES),
                   workflows.c.advances > CRASH_LOOP_ADVANCES).limit(20)).scalars())
        now = db_now(conn)
        expiring = runaway.expiring_advances(conn, now)
        pending = runaway.late_pending(conn, now, after=pending_after)
    # parked by a runaway guard: the reason starts with the guard's tag
    runaways = [r.workflow_id for r in blocked_rows
                if str(r.block_reason or "").startswith(("code_timeout:", "advance_expired:"))]
    problems = []
    if blocked:
        problems.append(
            f"BLOCKED WORKFLOWS: {counts.get('blocked', 0)} workflows wait for a person "
            f"({', '.join(blocked[:10])}): `reliable-beat workflows show ID` gives the reason; "
            "fix the code, then `reliable-beat workflows resume ID`"
            + (f"; for a failed compensation ({', '.join(by_compensation[:10])}): fix it, then "
               "`reliable-beat workflows compensate ID`" if by_compensation else "")
            + (f"; runaway code parked ({', '.join(runaways[:10])}): it ran past "
               f"{runaway.CODE_TIMEOUT_SETTING} between durable calls, or its advance's lease "
               f"kept expiring ({runaway.MAX_TAKEOVERS_SETTING}): fix the loop or the hung "
               "call, restart workers still stuck in it, then resume" if runaways else "")
        )
    problems.extend(runaway.problems(expiring, pending, pending_after=pending_after,
                                     max_takeovers=max_takeovers))
    if overdue:
        problems.append(
            f"OVERDUE TIMERS: {overdue} workflow timers are more than {grace.total_seconds():g}"
            f" s past due ({', '.join(overdue_ids[:10])}): their wake was lost or no relay "
            "runs. A running relay's sweep re-sends such a wake within "
            "reliable_beat_redispatch_seconds of the timer; kick one now with "
            "`reliable-beat workflows resume ID`; if none advances, start a relay "
            "(`reliable-beat relay`) and check its log"
        )
    if looping:
        problems.append(
            f"CRASH-LOOPING WORKFLOWS: {', '.join(looping[:10])} were claimed more than "
            f"{CRASH_LOOP_ADVANCES} times: see the workers' logs"
        )
    if unknown:
        problems.append(
            f"MALFORMED WORKFLOW ROWS: {n_unknown} workflows have a state the engine never "
            f"writes ({', '.join(unknown[:10])}): nothing advances them and signals to them "
            "are refused. Set the state back by SQL (e.g. 'blocked', then `reliable-beat "
            "workflows resume ID`) or terminate them: `reliable-beat workflows cancel ID "
            "--no-compensate`"
        )
    return {"counts": counts, "blocked": blocked, "overdue_timers": overdue,
            "crash_looping": looping, "malformed_states": unknown,
            "advances_expiring": {"count": expiring[0], "workflows": expiring[1]},
            "pending_late": {"count": pending[0], "queues": pending[1],
                             "workflow_ids": pending[2]},
            "problems": problems}
