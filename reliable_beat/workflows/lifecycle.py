"""A workflow's life outside its code: signals, resume, and the end (completed, failed,
cancelled, blocked), with what an end must do in its own transaction: lock the row against a
racing signal, drop the delayed wakes, tell a parent its child ended."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.engine import Connection

from reliable_beat import tracing
from reliable_beat.db.dialects import Store, update_returning
from reliable_beat.db.tables import outbox as outbox_table
from reliable_beat.db.tables import workflow_events, workflow_signals, workflows
from reliable_beat.outbox import db_now, insert_ignore
from reliable_beat.redaction import get_logger
from reliable_beat.workflow_store import ADVANCE_TASK, WAKE_DESTINATION, add_wake
from reliable_beat.workflows import crashes, limits, signal_keys
from reliable_beat.workflows.errors import WorkflowConflict, WorkflowNotFound
from reliable_beat.workflows.history import (
    TERMINAL_STATES,
    Claimed,
    first,
    insert_one_ignored,
    to_json,
    transaction,
)
from reliable_beat.workflows.malformed import WORKFLOW_STATES, state_problem
from reliable_beat.workflows.queries import get_workflow

__all__ = [
    "CHILD_KIND",
    "ENDED",
    "block",
    "child_outcome",
    "drop_wakes",
    "finish",
    "lock_for_end",
    "notify_parent",
    "resume",
    "signal",
]

log = get_logger("reliable_beat.workflows")

CHILD_KIND = "child"
#: Child states that end the parent's wait.
ENDED = ("completed", "failed", "cancelled")


def drop_wakes(conn: Connection, workflow_id: str) -> int:
    """Delete the delayed wake rows of a workflow that just ended (joins ``conn``, the
    transaction that ends it): pending, not yet due and unclaimed. A 24 h ``ctx.sleep`` or
    signal timeout leaves such a wake; it would only find the workflow ended. Rows already
    due are left to the relay (a no-op advance): one may be the message being delivered
    right now. Activity messages are left alone. Returns the rows deleted."""
    o = outbox_table
    now = db_now(conn)
    still = (o.c.state == "pending", o.c.claimed_by.is_(None), o.c.available_at > now)
    found = conn.execute(
        select(o.c.id, o.c.payload).where(
            o.c.destination == WAKE_DESTINATION, *still,
            o.c.message_id.startswith(f"wake:{workflow_id}:", autoescape=True))
    ).all()
    ids = []
    for r in found:  # another workflow's id may extend this one's ("a" vs "a:b")
        payload = r.payload
        if isinstance(payload, str):
            try:
                payload = json.loads(payload)
            except ValueError:
                continue
        if isinstance(payload, dict) and payload.get("task") == ADVANCE_TASK \
                and payload.get("args") == [workflow_id]:
            ids.append(r.id)
    if not ids:
        return 0
    # re-checked: a relay may have claimed one since the read
    return int(conn.execute(o.delete().where(o.c.id.in_(ids), *still)).rowcount or 0)



def _traced_signal(fn: Callable[..., bool]) -> Callable[..., bool]:
    """``signal`` in a ``signal <name>`` span of the workflow's trace (the traceparent stored
    at start), linked to the caller's span; ``reliable_beat.outcome``: ``stored`` or
    ``duplicate``. Its wake message is written under it: the wake's delivery joins the trace,
    and the advance that consumes the signal has a ``receive signal <name>`` span linked to
    it (the signal row keeps this span's ``traceparent``)."""
    @functools.wraps(fn)
    def traced(target: Store | Connection, workflow_id: str, name: str, payload: Any = None,
               *, key: str | None = None) -> bool:
        if tracing.tracer() is None:
            return fn(target, workflow_id, name, payload, key=key)
        caller = tracing.current_traceparent()
        read = select(workflows.c.traceparent).where(workflows.c.workflow_id == workflow_id)
        with (transaction(target) if isinstance(target, Connection)
              else target.connect()) as conn:
            tp = conn.execute(read).scalar()
        with tracing.span(f"signal {name}", parent=tp, root=True, kind="producer",
                          links=[caller], attributes=tracing.attributes(
                              workflow_id=workflow_id, key=key)) as s:
            stored = fn(target, workflow_id, name, payload, key=key)
            s.set_attribute(tracing.OUTCOME, "stored" if stored else "duplicate")
            return stored
    return traced


@_traced_signal
def signal(
    target: Store | Connection,
    workflow_id: str,
    name: str,
    payload: Any = None,
    *,
    key: str | None = None,
) -> bool:
    """Send signal ``name`` with ``payload`` to a workflow; it wakes the workflow.

    Writes the inbox row and a wake message in one transaction (the caller's when
    ``target`` is a Connection): when this returns True (and the caller committed) the
    signal is durable and will be consumed by exactly one ``ctx.wait_signal(name)``, oldest
    first, unless the workflow ends without waiting for it. Retrying after an error with
    the same ``key`` is safe: the signal is stored once.

    Never waits for a running advance (PostgreSQL): the workflow row is read ``FOR KEY
    SHARE``, which no advance's write conflicts with, and ``wake_seq`` is bumped only if the
    row is free (``FOR NO KEY UPDATE SKIP LOCKED``). When an advance holds the row, the
    bump is skipped and the wake message does its work: the advance it starts finds the
    holder's lease live, sees the unconsumed signal and bumps ``wake_seq`` itself (a worker
    may wait for a row lock; a web request must not), so the holder's release runs the code
    again; if that message fails (the holder frozen inside a transaction past the worker's
    ``lock_timeout``), the re-dispatch sweep wakes a ``waiting`` workflow parked on a
    ``wait_signal`` whose signal sits unconsumed (:func:`redispatch_workflows`). No wake-up
    is lost. The one wait left is the transaction that *ends* the workflow (it takes the
    row ``FOR UPDATE``): it lasts milliseconds, and it decides the race with a workflow
    completing concurrently: a signal is either committed before the end (stored; consumed
    if the code waits for it, like any signal sent while the workflow ran) or refused with
    :class:`WorkflowConflict`, never stored on an ended workflow. A process frozen inside
    that ending transaction makes ``signal`` wait up to the connection's ``lock_timeout``
    and raise; sending again with the same ``key`` is safe.

    SQLite (one writer at a time) and MariaDB/MySQL (InnoDB's foreign-key check of the inbox
    row takes a shared lock on the workflow row, which an advance's write holds) bump
    ``wake_seq`` first, locking the row as an advance does: there a signal waits for the
    advance's current transaction (``lock_timeout`` / the busy timeout, then an error).

    Args:
        target: the store, or a connection inside the caller's transaction on it.
        workflow_id: the business id.
        name: the signal's name (<= 200 characters), as ``ctx.wait_signal(name)`` asks it.
        payload: a JSON value (see :func:`to_json`); None reads as a timeout to a
            ``wait_signal(timeout=...)``: send a value.
        key: dedup key (<= 400 characters), unique per workflow: a second signal with
            the same key to the same workflow is a no-op (another workflow may use the same
            key). A re-send whose name or payload differs is not stored either, and logs a
            WARNING (the key names one signal: give a new signal a new key).

    Returns:
        True if the signal was stored, False if this workflow already has a signal with
        ``key``.

    Raises:
        WorkflowNotFound: no such workflow.
        WorkflowError-derived WorkflowConflict: the workflow has ended (the signal would be
            lost; nothing is written), or its row's state is malformed, or (a schema before
            0016_signalkey, one key per store) another workflow holds ``key``.
        TypeError: ``payload`` is not JSON-serialisable (nothing is written).
        WorkflowValueError: ``payload`` is over the size limit as JSON
            (:data:`~reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES`); nothing is written.
    """
    data = to_json(payload, f"signal {name!r} payload")
    limits.check_size(f"signal {name!r} payload", data)
    with transaction(target) as conn:
        if conn.dialect.name != "postgresql":
            return _signal_locking(conn, workflow_id, name, data, key)
        now = db_now(conn)
        # FOR KEY SHARE: blocks only while a transaction that ends the workflow holds the
        # row FOR UPDATE (lock_for_end), never behind an advance's FOR NO KEY UPDATE writes
        row = _refuse_unsignallable(workflow_id, name, conn.execute(
            select(workflows.c.id, workflows.c.state, workflows.c.queue)
            .where(workflows.c.workflow_id == workflow_id)
            .with_for_update(read=True, key_share=True)
        ).first())
        sid = conn.execute(insert_ignore(conn, workflow_signals).values(
            workflow_pk=row.id, name=name, payload=data, dedup_key=key, created_at=now,
            **_traceparent_column(),
        ).returning(workflow_signals.c.id)).scalar()
        if sid is None:  # only a key makes a duplicate
            return signal_keys.stored_key(conn, row.id, workflow_id, name, data, str(key))
        free = conn.execute(
            select(workflows.c.id).where(workflows.c.id == row.id)
            .with_for_update(key_share=True, skip_locked=True)
        ).first()
        if free is None:  # an advance (or another sender) holds the row: no bump, no wait
            add_wake(conn, workflow_id, row.queue, f"sig{sid}")
            return True
        seq = conn.execute(
            update(workflows).where(workflows.c.id == row.id)
            .values(wake_seq=workflows.c.wake_seq + 1).returning(workflows.c.wake_seq)
        ).scalar_one()
        add_wake(conn, workflow_id, row.queue, f"s{seq}")
    return True


def _traceparent_column() -> dict[str, str]:
    """``{"traceparent": ...}`` of the ``signal <name>`` span storing the row (the advance's
    ``receive signal`` span links to it), else nothing: a store not yet upgraded to the column
    (new code during a rolling deploy) stores signals as before while tracing is off."""
    tp = tracing.current_traceparent()
    return {"traceparent": tp} if tp else {}


def _refuse_unsignallable(workflow_id: str, name: str, row: Any) -> Any:
    """``row`` (id, state, queue, ...) if it is a workflow that may still consume a signal.

    Raises:
        WorkflowNotFound: ``row`` is None.
        WorkflowConflict: the workflow has ended, or its state is malformed.
    """
    if row is None:
        raise WorkflowNotFound(f"no workflow {workflow_id!r} (see `workflows list`)")
    if row.state in TERMINAL_STATES:
        raise WorkflowConflict(
            f"workflow {workflow_id!r} is {row.state}: signal {name!r} would never be "
            "consumed; nothing was written"
        )
    if row.state not in WORKFLOW_STATES:  # raising rolls everything back
        raise WorkflowConflict(
            f"signal {name!r} not stored (it would never be consumed; nothing was "
            f"written): {state_problem(workflow_id, row.state)}")
    return row


def _signal_locking(conn: Connection, workflow_id: str, name: str, data: Any,
                    key: str | None) -> bool:
    """:func:`signal` on SQLite and MySQL/MariaDB: bump ``wake_seq`` first, holding the
    workflow row (the same lock order as the advance: no deadlock). A key already stored
    for this workflow returns False before the bump (a web retry of the same signal costs
    the workflow no replay; two racing first sends of one key may still both bump:
    harmless)."""
    if key is not None:
        stored = conn.execute(
            select(workflow_signals.c.name, workflow_signals.c.payload)
            .join(workflows, workflows.c.id == workflow_signals.c.workflow_pk)
            .where(workflows.c.workflow_id == workflow_id, workflow_signals.c.dedup_key == key)
            .limit(1)
        ).first()
        if stored is not None:
            return signal_keys.repeated(workflow_id, key, stored, name, data)
    now = db_now(conn)
    row = _refuse_unsignallable(workflow_id, name, first(update_returning(
        conn,
        update(workflows)
        .where(workflows.c.workflow_id == workflow_id)
        .values(wake_seq=workflows.c.wake_seq + 1),
        workflows,
        [workflows.c.id, workflows.c.state, workflows.c.queue, workflows.c.wake_seq],
    )))
    inserted = insert_one_ignored(conn, insert_ignore(conn, workflow_signals).values(
        workflow_pk=row.id, name=name, payload=data, dedup_key=key, created_at=now,
        **_traceparent_column(),
    ), workflow_signals)
    if not inserted:  # a racing sender of the key committed first (or an older schema)
        return signal_keys.stored_key(conn, row.id, workflow_id, name, data, str(key))
    add_wake(conn, workflow_id, row.queue, f"s{row.wake_seq}")
    return True


def lock_for_end(conn: Connection, pk: int) -> None:
    """Take workflow ``pk``'s row ``FOR UPDATE`` (PostgreSQL; a no-op elsewhere), first in a
    transaction that ends the workflow (completed / failed / cancelled).

    It conflicts with the ``FOR KEY SHARE`` a :func:`signal` holds until it commits, and
    with nothing an advance takes (``FOR NO KEY UPDATE``): a signal commits either before
    the end (stored while the workflow ran) or after it, reading the ended state and
    refusing; never stored on an ended workflow."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(workflows.c.id).where(workflows.c.id == pk).with_for_update())


def resume(store: Store, workflow_id: str) -> dict[str, Any]:
    """Unblock a ``blocked`` workflow (after the code was fixed): ``waiting`` + a wake.

    Also kicks a ``pending`` / ``waiting`` workflow that is overdue (a timer or signal
    timeout past its ``fire_at``, a wake it has not consumed, or a ``wait_signal`` whose
    signal sits unconsumed in the inbox): one more wake, nothing
    else changes (the advance is fenced and replays; the sweep would send it within
    ``reliable_beat_redispatch_seconds`` too).

    Returns the row as :func:`get_workflow` does.

    Raises:
        WorkflowNotFound: no such workflow.
        WorkflowConflict: it is neither blocked nor overdue (the message says what it
            waits for).
    """
    if _kick_overdue(store, workflow_id):
        return get_workflow(store, workflow_id)
    with store.begin() as conn:
        now = db_now(conn)
        row = first(update_returning(
            conn,
            update(workflows)
            .where(workflows.c.workflow_id == workflow_id, workflows.c.state == "blocked")
            .values(state="waiting", block_reason=None, wake_seq=workflows.c.wake_seq + 1,
                    advances=0, updated_at=now),
            workflows, [workflows.c.queue, workflows.c.wake_seq],
        ))
        if row is None:
            state = conn.execute(
                select(workflows.c.state).where(workflows.c.workflow_id == workflow_id)
            ).scalar()
            if state is None:
                raise WorkflowNotFound(f"no workflow {workflow_id!r}")
            if state in ("pending", "waiting"):
                raise WorkflowConflict(
                    f"workflow {workflow_id!r} is {state} and not overdue (no timer past "
                    "due, no unconsumed wake): it waits for an activity, a signal or a "
                    "timer to come; `reliable-beat workflows show` lists its events")
            raise WorkflowConflict(f"workflow {workflow_id!r} is {state}, not blocked")
        add_wake(conn, workflow_id, row.queue, f"resume{row.wake_seq}")
    return get_workflow(store, workflow_id)


def _kick_overdue(store: Store, workflow_id: str) -> bool:
    """``resume`` of a pending / waiting workflow: add a wake if it is overdue."""
    with store.begin() as conn:
        now = db_now(conn)
        row = conn.execute(
            select(workflows.c.id, workflows.c.state, workflows.c.run_no,
                   workflows.c.wake_seq, workflows.c.claimed_wake_seq)
            .where(workflows.c.workflow_id == workflow_id)
        ).first()
        if row is None or row.state not in ("pending", "waiting"):
            return False
        due = conn.execute(
            select(func.count()).select_from(workflow_events).where(
                workflow_events.c.workflow_pk == row.id,
                workflow_events.c.run_no == row.run_no,
                workflow_events.c.state == "scheduled",
                workflow_events.c.fire_at.is_not(None),
                workflow_events.c.fire_at <= now)
        ).scalar_one()
        if not due and not (row.state == "pending" or row.wake_seq > row.claimed_wake_seq):
            # a signal whose wake_seq bump was skipped (PostgreSQL) and whose wake's advance
            # failed: its wait_signal is scheduled while a signal of that name sits unread
            ev, sg = workflow_events.c, workflow_signals.c
            due = conn.execute(
                select(func.count()).select_from(workflow_events.join(
                    workflow_signals, and_(sg.workflow_pk == ev.workflow_pk,
                                           sg.name == ev.name)))
                .where(ev.workflow_pk == row.id, ev.run_no == row.run_no,
                       ev.kind == "signal", ev.state == "scheduled",
                       sg.consumed_seq.is_(None))
            ).scalar_one()
        if not due and not (row.state == "pending" or row.wake_seq > row.claimed_wake_seq):
            return False
        bumped = first(update_returning(
            conn,
            update(workflows)
            .where(workflows.c.id == row.id, workflows.c.state.in_(("pending", "waiting")))
            .values(wake_seq=workflows.c.wake_seq + 1),
            workflows, [workflows.c.queue, workflows.c.wake_seq],
            lock_by_primary_key=True,  # MariaDB: lock the one row, not via the state index
        ))
        if bumped is None:
            return False
        log.warning("workflow %s is %s and overdue: kicked by resume (wake %s)",
                    workflow_id, row.state, bumped.wake_seq)
        add_wake(conn, workflow_id, bumped.queue, f"kick{bumped.wake_seq}")
    return True



def finish(store: Store, claimed: Claimed, **values: Any) -> str:
    """Record the end (completed / failed / blocked), fenced. Returns the state or 'fenced'."""
    with store.begin() as conn:
        if values.get("state") in TERMINAL_STATES:
            lock_for_end(conn, claimed.pk)  # first: decides the race with a signal()
        now = db_now(conn)
        if values.get("state") in TERMINAL_STATES:
            values["finished_at"] = now
        done = conn.execute(
            update(workflows)
            .where(workflows.c.id == claimed.pk, workflows.c.fence_token == claimed.fence_token)
            .values(leased_by=None, lease_expires_at=None, updated_at=now, **values)
        ).rowcount
        if done == 1 and values.get("state") in TERMINAL_STATES:
            drop_wakes(conn, claimed.workflow_id)
        if done == 1:  # a child's end tells its parent in the same transaction
            notify_parent(conn, claimed.pk, str(values.get("state")), values.get("result"),
                          values.get("error"))
    if done != 1:
        return "fenced"
    return str(values["state"])


def block(store: Store, claimed: Claimed, reason: str) -> str:
    """Park the workflow ``blocked`` with ``reason``, fenced; writes no event."""
    log.error("workflow %s blocked: %s", claimed.workflow_id, reason)
    return finish(store, claimed, state="blocked", block_reason=reason[:4000])



def child_outcome(state: str, result: Any, error: Any) -> tuple[str, Any, Any]:
    """The parent's ``child`` event (state, result, error) for a child that ended ``state``."""
    if state == "completed":
        return "completed", result, None
    if state == "cancelled":
        return "failed", None, {"type": "cancelled", "message": "the child was cancelled"}
    err = error or {}
    return "failed", None, {"type": err.get("type"), "message": err.get("message")}


def notify_parent(conn: Connection, child_pk: int, state: str, result: Any = None,
                  error: Any = None) -> bool:
    """In the child's terminal transaction: complete the parent's ``child`` event and wake it.

    A no-op for a workflow without a parent, a parent that has moved to another run, or an
    event no longer ``scheduled``. Returns True if the parent was told.
    """
    if state not in ENDED:
        return False
    link = conn.execute(
        select(workflows.c.parent_pk, workflows.c.parent_run_no, workflows.c.parent_seq)
        .where(workflows.c.id == child_pk)
    ).first()
    if link is None or link.parent_pk is None:
        return False
    told = update_returning(
        conn,
        update(workflows)
        .where(workflows.c.id == link.parent_pk, workflows.c.run_no == link.parent_run_no)
        .values(wake_seq=workflows.c.wake_seq + 1),
        workflows, [workflows.c.workflow_id, workflows.c.queue],
    )
    if not told:
        return False
    parent = told[0]
    ev_state, ev_result, ev_error = child_outcome(state, result, error)
    done = conn.execute(
        update(workflow_events)
        .where(workflow_events.c.workflow_pk == link.parent_pk,
               workflow_events.c.run_no == link.parent_run_no,
               workflow_events.c.seq == link.parent_seq,
               workflow_events.c.kind == CHILD_KIND,
               workflow_events.c.state == "scheduled")
        .values(state=ev_state, result=ev_result, error=ev_error, completed_at=db_now(conn))
    ).rowcount
    if done != 1:
        return False
    add_wake(conn, parent.workflow_id, parent.queue,
             f"{link.parent_run_no}c{link.parent_seq}")
    crashes.crash_point("child.notify.in")
    return True
