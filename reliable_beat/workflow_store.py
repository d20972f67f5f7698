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

from sqlalchemy import (
    Interval,
    Select,
    String,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from reliable_beat import handoff, outbox, tracing
from reliable_beat.db.dialects import update_returning
from reliable_beat.db.driver import DriverStatement, uses_psycopg
from reliable_beat.db.tables import outbox as outbox_rows
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
        params = {"p_workflow_id": workflow_id, "p_run_no": run_no, "p_seq": seq,
                  "p_key": key, "p_result": result}
        handing, group = handoff.handing_off()
        if handing:  # the wake's insert too: see _pg_completed_and_wake_statement
            return _completed_and_woken(conn, workflow_id, run_no, seq, params, group)
        wf = _PG_COMPLETED.first(conn, params)
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
    wf, ev = _completed_ctes()
    done = select(func.count()).select_from(ev).scalar_subquery().label("done")
    # the completed event as the history's select reads it (the same columns and types)
    event = [select(ev.c[c]).scalar_subquery().label(f"ev_{c}") for c in HistoryRow._fields]
    return select(wf.c.id, wf.c.queue, wf.c.wake_seq, wf.c.schedule_group, wf.c.name, done,
                  *event)


def _completed_ctes() -> tuple[Any, Any]:
    """The ``wf`` and ``ev`` CTEs of :func:`_pg_completed_statement`."""
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
    return wf, ev


#: :func:`_pg_completed_statement` run on the psycopg connection (reliable_beat.db.driver).
_PG_COMPLETED = DriverStatement(_pg_completed_statement)


@cache
def _pg_completed_and_wake_statement(traced: bool) -> Select[Any]:
    """:func:`_pg_completed_statement` and the insert of the wake it hands off (what
    :func:`_wake_after` writes through :func:`reliable_beat.handoff.add`), one statement::

        WITH wf AS (... as _pg_completed_statement), ev AS (... as _pg_completed_statement),
        ob AS (INSERT INTO outbox (message_id, destination, payload, headers,
                                   schedule_group, state, attempts, available_at,
                                   created_at[, traceparent])
               SELECT :wake_prefix || wf.wake_seq, :destination,
                      CASE WHEN coalesce(wf.queue, '') = '' THEN :payload
                           ELSE :payload || jsonb_build_object('options',
                                jsonb_build_object('queue', wf.queue)) END,
                      '{}', wf.schedule_group, 'pending', 0,
                      clock_timestamp() + CASE WHEN wf.schedule_group IS NOT DISTINCT FROM
                                               :group THEN :delay ELSE '0' END,
                      clock_timestamp()[, :traceparent]
               FROM wf WHERE (SELECT count(*) FROM ev) = 1
               ON CONFLICT DO NOTHING RETURNING *)
        SELECT wf.*, done, ev_..., ob.* AS ob_... FROM wf LEFT JOIN ob ON true

    ``ob`` reads ``wf`` and ``ev``: the workflow row and the event are updated first, and
    nothing is inserted unless the event was completed. Due after the hand-off's delay when
    the workflow's group is the publisher's (``:group``), else at once (the relay's row).
    ``traced``: with the ``traceparent`` column (written only while tracing is on)."""
    wf, ev = _completed_ctes()
    done = select(func.count()).select_from(ev).scalar_subquery()
    payload = bindparam("p_payload", type_=outbox_rows.c.payload.type)
    with_queue = payload.op("||")(func.jsonb_build_object(
        literal_column("'options'"), func.jsonb_build_object(literal_column("'queue'"),
                                                             wf.c.queue)))
    handed = wf.c.schedule_group.is_not_distinct_from(
        cast(bindparam("p_group", type_=String()), String()))
    names = ["message_id", "destination", "payload", "headers", "schedule_group", "state",
             "attempts", "available_at", "created_at"]
    values: list[Any] = [
        cast(bindparam("p_wake_prefix", type_=String()), String())
        .concat(cast(wf.c.wake_seq, String())),
        cast(bindparam("p_destination", type_=String()), String()),
        case((func.coalesce(wf.c.queue, literal_column("''")) == literal_column("''"),
              cast(payload, outbox_rows.c.payload.type)),
             else_=cast(with_queue, outbox_rows.c.payload.type)),
        cast(literal_column("'{}'"), outbox_rows.c.headers.type),
        wf.c.schedule_group, literal_column("'pending'"), literal_column("0"),
        func.clock_timestamp() + case((handed, bindparam("p_delay", type_=Interval())),
                                      else_=cast(literal_column("'0'"), Interval())),
        func.clock_timestamp(),
    ]
    if traced:
        names.append("traceparent")
        values.append(cast(bindparam("p_traceparent", type_=String()), String()))
    ob = (postgresql.insert(outbox_rows)
          .from_select(names, select(*values).select_from(wf).where(done == 1))
          .on_conflict_do_nothing()
          .returning(*outbox_rows.c)
          .cte("ob"))
    event = [select(ev.c[c]).scalar_subquery().label(f"ev_{c}") for c in HistoryRow._fields]
    return (select(wf.c.id, wf.c.queue, wf.c.wake_seq, wf.c.schedule_group, wf.c.name,
                   done.label("done"), *event, *(c.label(f"ob_{c.name}") for c in ob.c))
            .select_from(wf.outerjoin(ob, true())))


#: :func:`_pg_completed_and_wake_statement` (untraced, traced) on the psycopg connection
_PG_COMPLETED_AND_WAKE = (DriverStatement(lambda: _pg_completed_and_wake_statement(False)),
                          DriverStatement(lambda: _pg_completed_and_wake_statement(True)))


def _completed_and_woken(conn: Connection, workflow_id: str, run_no: int, seq: int,
                         params: dict[str, Any], group: str | None) -> bool:
    """psycopg, inside a hand-off (publisher of schedule group ``group``): the succeeded
    activity's completion and its workflow's wake row as one statement; the wake handed
    off as :func:`_wake_after` hands it off (the relay's, notified, when the workflow is
    of another group)."""
    traceparent = tracing.current_traceparent()
    prefix = f"wake:{workflow_id}:{run_no}#{seq}."
    params.update(p_wake_prefix=prefix, p_destination=WAKE_DESTINATION,
                  p_payload=_wake_payload(workflow_id, None), p_group=group,
                  p_delay=handoff.HANDOFF_DELAY,
                  **({"p_traceparent": traceparent} if traceparent else {}))
    wf = _PG_COMPLETED_AND_WAKE[bool(traceparent)].first(conn, params)
    if wf is None or wf.done != 1:
        return False
    row = (None if wf.ob_id is None
           else {c.name: getattr(wf, f"ob_{c.name}") for c in outbox_rows.c})
    wake = handoff.Wake(workflow_id, wf.name, wf.queue, run_no=run_no,
                        wake_seq=int(wf.wake_seq),
                        event=HistoryRow(*(getattr(wf, f"ev_{c}") for c in HistoryRow._fields)))
    if not handoff.added(conn, f"{prefix}{wf.wake_seq}", row, group=wf.schedule_group,
                         wakes=wake):
        outbox._notify_once(conn, WAKE_DESTINATION)
    return True
