"""The workflow rows that modules below the engine read and write: DBOS's system database.

The workflow engine (:mod:`reliable_beat.workflows`) owns these rows; modules below it never
import it. They read here what the beat's overlap policy asks (:func:`active_entries`), and
the run store writes here an activity's outcome into its workflow's history and wakes the
workflow (:func:`on_run_finished`, in the activity's completing transaction), with the
activity key and wake message helpers the engine uses too.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from functools import cache
from typing import Any, NamedTuple

from sqlalchemy import Select, bindparam, func, literal_column, select, update
from sqlalchemy.engine import Connection

from reliable_beat import handoff, outbox
from reliable_beat.db.dialects import update_returning
from reliable_beat.db.driver import DriverStatement, uses_psycopg
from reliable_beat.db.tables import workflow_events, workflows
from reliable_beat.outbox import now_sql

__all__ = [
    "ADVANCE_TASK",
    "OVERLAP_STATES",
    "WAKE_DESTINATION",
    "HistoryRow",
    "active_entries",
    "activity_key",
    "add_wake",
    "group_of",
    "now_sql",
    "on_run_finished",
    "parse_activity_key",
]

#: Name of the advance task (a Celery task registered by the adapter).
ADVANCE_TASK = "reliable_beat.workflow.advance"
#: Outbox destination of advance and activity messages.
WAKE_DESTINATION = "celery"
#: Workflow states in which an entry's previous slot counts as still running (overlap).
OVERLAP_STATES = ("pending", "running", "waiting", "blocked")


def active_entries(conn: Connection, names: Iterable[str]) -> set[str]:
    """The entries among ``names`` with a workflow still pending, running, waiting or
    blocked (the beat's overlap policy reads it beside the runs' states)."""
    wanted = list(names)
    if not wanted:
        return set()
    return {str(n) for n in conn.execute(
        select(workflows.c.entry_name).distinct().where(
            workflows.c.entry_name.in_(wanted), workflows.c.state.in_(OVERLAP_STATES))
    ).scalars()}


def activity_key(workflow_id: str, run_no: int, seq: int) -> str:
    """The idempotency key of the activity at ``seq``: ``wf:<workflow id>/<run>#<seq>``."""
    return f"wf:{workflow_id}/{run_no}#{seq}"


def parse_activity_key(key: str) -> tuple[str, int, int] | None:
    """``(workflow id, run, seq)`` of an activity key, or None for any other key."""
    if not key.startswith("wf:"):
        return None
    head, _, seq = key[3:].rpartition("#")
    wf, _, run = head.rpartition("/")
    if not (wf and run.isdigit() and seq.isdigit()):
        return None
    return wf, int(run), int(seq)


class HistoryRow(NamedTuple):
    """One event as an advance's history read returns it (its columns, in order)."""

    seq: int
    kind: str
    name: str | None
    args_digest: str
    state: str
    result: Any
    error: Any
    fire_at: Any
    run_key: str | None


def _first(rows: list[Any]) -> Any:
    return rows[0] if rows else None


def _wake_payload(workflow_id: str, queue: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"task": ADVANCE_TASK, "args": [workflow_id], "kwargs": {}}
    if queue:
        payload["options"] = {"queue": queue}
    return payload


def group_of(workflow_id: str) -> Any:
    """SQL: the schedule group of workflow ``workflow_id`` (NULL: none, or no such row), for
    the ``schedule_group`` of the outbox rows it writes: only the relays and beats of that
    group publish them, into the broker of the app that runs the workflow."""
    return (select(workflows.c.schedule_group)
            .where(workflows.c.workflow_id == workflow_id).scalar_subquery())


def add_wake(
    conn: Connection, workflow_id: str, queue: str | None, what: str,
    delay: timedelta | None = None,
) -> str:
    """Add the advance message ``wake:<workflow id>:<what>`` to the outbox (joins ``conn``),
    scoped to the workflow's schedule group (:func:`group_of`)."""
    return outbox.add(
        conn, WAKE_DESTINATION, _wake_payload(workflow_id, queue),
        key=f"wake:{workflow_id}:{what}", delay=delay, schedule_group=group_of(workflow_id),
    )


def on_run_finished(
    conn: Connection, key: str, state: str, result: Any = None, error: str | None = None
) -> bool:
    """Write an activity's outcome into its workflow's history, in the caller's transaction.

    Called by :func:`reliable_beat.runs.complete` (``state='succeeded'``, in the activity's
    completing transaction: effect, run, result and history commit together) and by
    :func:`reliable_beat.runs.record_failure` when the run dies (``state='dead'``). A no-op
    for keys that are not activity keys, or whose event is no longer ``scheduled``.
    Retrying activities do not wake the workflow (retries are the activity's business).

    Returns:
        True if an event was completed (and the workflow woken).
    """
    parsed = parse_activity_key(key)
    if parsed is None:
        return False
    workflow_id, run_no, seq = parsed
    if state == "succeeded" and uses_psycopg(conn):  # the hot path: one statement
        wf = _PG_COMPLETED.first(conn, {"p_workflow_id": workflow_id, "p_run_no": run_no,
                                        "p_seq": seq, "p_key": key, "p_result": result})
        if wf is None or wf.done != 1:
            return False
        _wake_after(conn, workflow_id, run_no, seq, wf,
                    HistoryRow(*(getattr(wf, f"ev_{c}") for c in HistoryRow._fields)))
        return True
    # the workflow row first: the same lock order as an advance's record transaction
    wf = _first(update_returning(
        conn,
        update(workflows)
        .where(workflows.c.workflow_id == workflow_id, workflows.c.run_no == run_no)
        .values(wake_seq=workflows.c.wake_seq + 1),
        workflows, [workflows.c.id, workflows.c.queue, workflows.c.wake_seq,
                    workflows.c.schedule_group, workflows.c.name],
    ))
    if wf is None:
        return False
    values: dict[str, Any] = {"completed_at": now_sql(conn)}
    if state == "succeeded":
        values.update(state="completed", result=result)
    else:
        values.update(state="failed", error={"type": "dead", "message": (error or "")[-2000:]})
    done = conn.execute(
        update(workflow_events)
        .where(
            workflow_events.c.workflow_pk == wf.id,
            workflow_events.c.run_no == run_no,
            workflow_events.c.seq == seq,
            workflow_events.c.run_key == key,
            workflow_events.c.state == "scheduled",
        )
        .values(**values)
    ).rowcount
    if done != 1:
        return False
    if state == "succeeded":
        _wake_after(conn, workflow_id, run_no, seq, wf)
    else:
        add_wake(conn, workflow_id, wf.queue, f"{run_no}#{seq}.{wf.wake_seq}")
    return True


def _wake_after(conn: Connection, workflow_id: str, run_no: int, seq: int, wf: Any,
                event: HistoryRow | None = None) -> None:
    """The wake of a workflow whose activity at ``seq`` completed (``wf``: its row's id,
    queue, wake_seq, schedule_group, name after the bump; ``event``: the completed event as
    stored, when the statement returned it)."""
    # wake_seq in the id: a requeued compensation completes the same seq a second time
    what = f"{run_no}#{seq}.{wf.wake_seq}"
    # advanced by this process right after the activity, or published by it after the
    # commit (reliable_beat.handoff); the relay sends it if neither happens
    handoff.add(conn, WAKE_DESTINATION, _wake_payload(workflow_id, wf.queue),
                key=f"wake:{workflow_id}:{what}", group=wf.schedule_group,
                schedule_group=wf.schedule_group,
                wakes=handoff.Wake(workflow_id, wf.name, wf.queue, run_no=run_no,
                                   wake_seq=int(wf.wake_seq), event=event))


@cache
def _pg_completed_statement() -> Select[Any]:
    """PostgreSQL: :func:`on_run_finished` of a succeeded activity in one statement::

        WITH wf AS (UPDATE workflows SET wake_seq = wake_seq + 1
                    WHERE workflow_id = :id AND run_no = :run
                    RETURNING id, queue, wake_seq, schedule_group, name),
        ev AS (UPDATE workflow_events SET state = 'completed', result = :result,
                      completed_at = clock_timestamp()
               WHERE workflow_pk = (SELECT id FROM wf) AND run_no = :run AND seq = :seq
                 AND run_key = :key AND state = 'scheduled' RETURNING seq)
        SELECT wf.*, (SELECT count(*) FROM ev) AS done FROM wf

    The event's ``workflow_pk`` is the workflow row's update (an init plan, run first): the
    workflow row is locked before the event row, the lock order of an advance's record.
    No row: no such workflow run.
    """
    # p_ names: a parameter named like a column would become a SET (see runs/complete.py)
    wf = (
        update(workflows)
        .where(workflows.c.workflow_id == bindparam("p_workflow_id",
                                                    type_=workflows.c.workflow_id.type),
               workflows.c.run_no == bindparam("p_run_no", type_=workflows.c.run_no.type))
        .values(wake_seq=workflows.c.wake_seq + 1)
        .returning(workflows.c.id, workflows.c.queue, workflows.c.wake_seq,
                   workflows.c.schedule_group, workflows.c.name)
        .cte("wf")
    )
    evc = workflow_events.c
    ev = (
        update(workflow_events)
        .where(
            workflow_events.c.workflow_pk == select(wf.c.id).scalar_subquery(),
            workflow_events.c.run_no == bindparam("p_run_no",
                                                  type_=workflow_events.c.run_no.type),
            workflow_events.c.seq == bindparam("p_seq", type_=workflow_events.c.seq.type),
            workflow_events.c.run_key == bindparam("p_key",
                                                   type_=workflow_events.c.run_key.type),
            workflow_events.c.state == literal_column("'scheduled'"),
        )
        .values(state=literal_column("'completed'"),
                result=bindparam("p_result", type_=workflow_events.c.result.type),
                completed_at=func.clock_timestamp())
        .returning(*(evc[c] for c in HistoryRow._fields))
        .cte("ev")
    )
    done = select(func.count()).select_from(ev).scalar_subquery().label("done")
    # the completed event as the history's select reads it (the same columns and types)
    event = [select(ev.c[c]).scalar_subquery().label(f"ev_{c}") for c in HistoryRow._fields]
    return select(wf.c.id, wf.c.queue, wf.c.wake_seq, wf.c.schedule_group, wf.c.name, done,
                  *event)


#: :func:`_pg_completed_statement` run on the psycopg connection (reliable_beat.db.driver).
_PG_COMPLETED = DriverStatement(_pg_completed_statement)
