"""Triggers without an outbox row: the beat's due-now fast path, and the sweep behind it.

A trigger a beat publishes right after its claim commits (its slot was due at the claim)
needs no outbox row: its run row (state ``scheduled``) is its record. The fast path marks
the outcome on the run (:func:`reliable_beat.outbox_queue.mark_sent` /
:func:`~reliable_beat.outbox_queue.mark_expired` take such a trigger as its run id negated)
and writes the outbox row only when the publish failed (:func:`write_trigger_rows`: the broker
was down), so the relay and the beats' sweeps take over as for any row.

What is left is a beat that died (SIGKILL) or stalled between its commit and its publish:
its runs stay ``scheduled`` with no trigger row. :func:`materialise_unsent` finds them (state
``scheduled``, a periodic trigger, slot and last update more than a sweep delay ago, no
trigger row) and writes their trigger rows, built exactly as the tick builds them, in one
transaction; the outbox sweep of the same caller then publishes them (at least once, under
the run's one message id). A beat's loop calls it at every sweep, and so does a relay that
knows its app's schedule group and trigger destination.

A beat that was only paused races that sweep for its own runs: before it publishes late it
takes the runs back (:func:`take_back_runs`: ``UPDATE ... WHERE state = 'scheduled' AND
updated_at = <the claim's now>``); the sweep moves ``updated_at`` too, so whichever commits
first wins and the other sees it.

:func:`run_messages` builds the message of a run from its run row and its entry's options
(queue, routing key, priority, headers, expires): the trigger a re-send or a lease clear
publishes for a run that has no trigger row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from sqlalchemy import literal, select, true, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from reliable_beat import rows as rows_mod
from reliable_beat.db.dialects import Store, update_returning
from reliable_beat.db.tables import beats, entries, outbox, runs
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.groups import entry_outside_group
from reliable_beat.identity import store_id_in
from reliable_beat.messages import OutboxMessage
from reliable_beat.outbox_queue import _ids_clause
from reliable_beat.redaction import get_logger
from reliable_beat.slots import SlotText
from reliable_beat.triggers import (
    TRIGGER_DESTINATION,
    TRIGGER_DESTINATIONS,
    build_trigger_payload,
    trigger_message_id,
    trigger_outbox_row,
)

__all__ = [
    "SWEPT_TRIGGERS",
    "entry_options",
    "group_trigger_destination",
    "hand_back",
    "has_trigger_row",
    "materialise_unsent",
    "run_messages",
    "take_back",
    "take_back_runs",
    "write_run_trigger",
    "write_trigger_rows",
]

log = get_logger("reliable_beat.unsent")

#: The run triggers a beat fires from the schedule (``reliable_beat.planner``): the only
#: runs a beat's fast path leaves without a trigger row.
SWEPT_TRIGGERS = ("schedule", "catch_up")


def entry_options(conn: Connection, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The ``options`` of the named entries, read without writing anything: an entry whose
    options cannot be read or are malformed (the beat quarantines it at its next claim) is
    absent, like an entry that is gone; its runs are sent with options ``{}``."""
    return _entry_options(conn, names)[0]


def _entry_options(conn: Connection, names: Iterable[str]
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``(options by entry, why by entry)``: :func:`entry_options`, and for each named entry
    whose options are not usable, why (``entry deleted`` / ``options malformed: ...``)."""
    wanted = sorted({n for n in names if isinstance(n, str)})
    if not wanted:
        return {}, {}
    out: dict[str, dict[str, Any]] = {}
    why: dict[str, str] = {}
    for raw in conn.execute(select(*rows_mod.raw_columns(entries, conn.dialect))
                            .where(entries.c.name.in_(wanted))).all():
        values, problems = rows_mod.decode_row(entries, dict(raw._mapping), conn.dialect)
        options, name = values.get("options"), values.get("name")
        if not isinstance(name, str):
            continue
        bad = [p for p in problems if rows_mod.column_of(p) == "options"]
        if not bad:
            bad = list(rows_mod.check_options(options))
        if not bad and isinstance(options, dict):
            out[name] = dict(options)
        else:
            why[name] = "options malformed: " + "; ".join(
                str(p) for p in (bad or [f"options={rows_mod.raw_repr(options)}: expected "
                                         "a JSON object"])[:3])
    for name in wanted:
        if name not in out and name not in why:
            why[name] = "entry deleted"
    return out, why


def _run_options(conn: Connection, rows: Sequence[Any], action: str
                 ) -> dict[str, dict[str, Any]]:
    """The entry options of ``rows`` (runs) by entry name; an ERROR per run of an entry that
    is gone or whose options are malformed: its trigger goes with the task's default routing
    (queue, priority), not the entry's. ``action``: what is done with the runs (the log's
    verb)."""
    options, why = _entry_options(conn, [r.entry_name for r in rows if r.entry_name])
    for r in rows:
        reason = why.get(r.entry_name) if r.entry_name else None
        if reason is not None:
            log.error("run %s of entry %r is %s with the task's default routing (its default "
                      "queue, no priority, headers or expires of the entry): %s. Fix: "
                      "restore the entry (or fix its options: `reliable-beat entries show "
                      "%s`) so later sends go where its triggers go", r.idempotency_key,
                      r.entry_name, action, reason, r.entry_name)
    return options


def _payload(row: Any, options: dict[str, Any], destination: str, sid: str | None,
             slot_text: SlotText | None = None) -> dict[str, Any]:
    return build_trigger_payload(
        task=row.task, args=list(row.args or []), kwargs=dict(row.kwargs or {}),
        options=options, key=row.idempotency_key, entry=row.entry_name, fire_at=row.fire_at,
        trigger=row.trigger or "adhoc", store_id=sid, slot_text=slot_text,
        destination=destination)


def run_messages(conn: Connection, rows: Sequence[Any], destination: str, *,
                 sid: str | None = None) -> list[OutboxMessage]:
    """The messages re-sending runs that have no trigger row, built from their run rows
    (task, arguments, key, slot) in the trigger payload shape of ``destination``; a run of an
    entry (``entry_name`` set) with the entry's current options (queue, routing key,
    priority, headers, expires), so a re-send goes where the trigger went; a run of no entry
    (an ad-hoc call) or of an entry gone with options ``{}`` (the task's default queue).
    Never stored: each message's ``id`` is its run's id negated (no outbox row has it).
    ``sid``: the store's id for the ``reliable_beat_store`` header (None: left out)."""
    options = _run_options(conn, rows, "re-sent")
    return [
        OutboxMessage(id=-int(r.id), message_id=trigger_message_id(r.idempotency_key),
                      destination=destination,
                      payload=_payload(r, options.get(r.entry_name or "", {}), destination, sid),
                      run_id=int(r.id), state="sent")
        for r in rows
    ]


def has_trigger_row() -> Any:
    """SQL: the run has a trigger outbox row (``trigger:<key>``, a trigger destination)."""
    return (
        select(outbox.c.id)
        .where(outbox.c.message_id == literal(trigger_message_id("")) + runs.c.idempotency_key,
               outbox.c.destination.in_(sorted(TRIGGER_DESTINATIONS)))
        .exists()
    )


def _read_runs(conn: Connection, raws: Sequence[Any], now: datetime) -> list[Any]:
    """The selected runs decoded value by value; a malformed one (task, arguments, key,
    slot) is dead-lettered (reason ``malformed``, :func:`reliable_beat.rows.dead_letter_run`)
    and left out: one bad row never stops the sweep of the others."""
    usable = []
    for raw in raws:
        values, problems = rows_mod.decode_row(runs, dict(raw._mapping), conn.dialect)
        unreadable = {rows_mod.column_of(p) for p in problems}
        checks = rows_mod.check_run_call(values.get("task"), values.get("args"),
                                         values.get("kwargs"))
        for col in ("idempotency_key", "entry_name", "trigger"):
            if not isinstance(values.get(col), str) or not values.get(col):
                checks.append(f"{col}={rows_mod.raw_repr(values.get(col))}: "
                              "expected a non-empty string")
        problems += [p for p in checks if rows_mod.column_of(p) not in unreadable]
        if problems:
            rows_mod.dead_letter_run(conn, values, problems, now,
                                     guard=runs.c.state == "scheduled")
            continue
        usable.append(SimpleNamespace(**values))
    return usable


def materialise_unsent(
    store: Store, conn: Connection, *, now: datetime, sweep_delay: timedelta,
    destination: str, schedule_group: str | None, limit: int,
) -> int:
    """Write the trigger rows of due slots whose beat never published them (it died or
    stalled between its commit and its publish); joins the caller's transaction.

    Takes (``FOR UPDATE SKIP LOCKED``, at most ``limit``, oldest first) the runs ``scheduled``
    by the schedule (trigger ``schedule`` / ``catch_up``, an entry named) whose slot and last
    update are both more than ``sweep_delay`` before ``now`` and that have no trigger row
    (runs of beats that write one, held and manual triggers are never taken), of an entry of
    ``schedule_group``, of no group, or gone (:func:`~reliable_beat.groups.
    entry_outside_group`; None: any). Each gets its trigger row (destination
    ``destination``, payload as the tick builds it with the entry's current options,
    ``available_at = now``, unclaimed) and ``updated_at = now`` (a beat that wakes and takes
    its runs back sees it: :func:`take_back_runs`). Logged at WARNING when any.

    Returns:
        How many runs got their trigger row.
    """
    cutoff = now - sweep_delay
    sel = (
        select(*rows_mod.raw_columns(runs, conn.dialect))
        .where(runs.c.state == "scheduled",
               runs.c.entry_name.is_not(None),
               runs.c.trigger.in_(SWEPT_TRIGGERS),
               runs.c.fire_at <= cutoff,
               runs.c.updated_at <= cutoff,
               ~has_trigger_row(),
               true() if schedule_group is None
               else ~entry_outside_group(runs.c.entry_name, schedule_group))
        .order_by(runs.c.id)
        .limit(limit)
    )
    found = _read_runs(conn, conn.execute(store.for_update_skip_locked(sel)).all(), now)
    if not found:
        return 0
    sid = store_id_in(conn, store)
    options = _run_options(conn, found, "published by the unsent sweep")
    slot_text = SlotText()
    _insert_rows(store, conn, [
        trigger_outbox_row(r.idempotency_key, int(r.id),
                           _payload(r, options.get(r.entry_name, {}), destination, sid,
                                    slot_text),
                           now, available_at=now, claimed_by=None, destination=destination)
        for r in found
    ])
    conn.execute(update(runs).where(_ids_clause(conn, runs.c.id, [int(r.id) for r in found]),
                                    runs.c.state == "scheduled")
                 .values(updated_at=now))
    log.warning("%d due slots were committed by a beat that never published them (it died "
                "or stalled between its claim and its publish): their triggers are written "
                "to the outbox and published by the sweep now: %s", len(found),
                ", ".join(r.idempotency_key for r in found[:5]))
    return len(found)


def _insert_rows(store: Store, conn: Connection, rows: list[dict[str, Any]]) -> int:
    """``INSERT ... ON CONFLICT (message_id) DO NOTHING`` of trigger rows (all given the same
    keys: ``traceparent`` only when one of them has it, so a store not yet upgraded takes
    rows written untraced). Returns how many were inserted."""
    if not rows:
        return 0
    if any("traceparent" in r for r in rows):
        for r in rows:
            r.setdefault("traceparent", None)
    result = conn.execute(store.insert_ignore(outbox), rows)
    count = result.rowcount
    return len(rows) if count is None or count < 0 else int(count)


def write_trigger_rows(store: Store, conn: Connection, messages: Sequence[OutboxMessage],
                       now: datetime) -> int:
    """Write the trigger rows of row-less triggers the fast path could not publish (the
    broker was down): pending, due at ``now``, unclaimed, with the payload and trace context
    the message carried, so the relay and the beats' sweeps publish them as any other row.
    A row that exists already is left alone. Joins the caller's transaction.

    Returns:
        How many rows were written.
    """
    return _insert_rows(store, conn, [
        trigger_outbox_row(m.message_id.removeprefix(trigger_message_id("")), int(m.run_id),
                           dict(m.payload), now, available_at=now, claimed_by=None,
                           destination=m.destination, traceparent=m.traceparent)
        for m in messages if m.run_id is not None
    ])


def group_trigger_destination(conn: Connection, entry_name: str) -> str:
    """The trigger destination the beats of ``entry_name``'s schedule group publish (each beat
    records its own; the most recently seen first), ``celery`` when none is recorded."""
    group = select(entries.c.schedule_group).where(entries.c.name == entry_name)
    for dests in conn.execute(
        select(beats.c.destinations)
        .where(beats.c.role == "beat", beats.c.schedule_group == group.scalar_subquery())
        .order_by(beats.c.seen_at.desc()).limit(5)
    ).scalars():
        for name in dests if isinstance(dests, list) else []:
            if name in TRIGGER_DESTINATIONS:
                return str(name)
    return TRIGGER_DESTINATION


def write_run_trigger(store: Store, conn: Connection, run_id: int, now: datetime) -> bool:
    """Write the trigger row (pending, due at ``now``) of a periodic run whose trigger was
    published without one (the beat's fast path), built from the run row and its entry's
    options as :func:`materialise_unsent` builds it, to the trigger destination of the
    entry's group (:func:`group_trigger_destination`). Joins the caller's transaction.

    Returns:
        True when the run is a periodic run (an entry named, not a workflow activity's) and
        its row was written (or existed); False otherwise (an ad-hoc call's run: nothing).
    """
    row = conn.execute(select(runs).where(runs.c.id == run_id)).first()
    if row is None or not row.entry_name or str(row.idempotency_key).startswith("wf:"):
        return False
    destination = group_trigger_destination(conn, row.entry_name)
    write_trigger_rows(store, conn, run_messages(conn, [row], destination,
                                                 sid=store_id_in(conn, store)), now)
    return True


def hand_back(store: Store, conn: Connection, failed: Sequence[int],
              messages: Sequence[OutboxMessage], now: datetime) -> None:
    """Hand triggers a publish could not send (the broker was down) to the relay and the
    sweeps, due at ``now``: a trigger row (id >= 0) is released (``available_at = now``,
    unclaimed); a row-less trigger (its run's id negated) gets its row written
    (:func:`write_trigger_rows`). Joins the caller's transaction."""
    rows = [int(i) for i in failed if i >= 0]
    if rows:
        conn.execute(update(outbox).where(outbox.c.id.in_(rows), outbox.c.state == "pending")
                     .values(available_at=now, claimed_by=None))
    rowless = {int(i) for i in failed if i < 0}
    if rowless:
        write_trigger_rows(store, conn, [m for m in messages if m.id in rowless], now)


def take_back(conn: Connection, run_ids: Sequence[int], *, claimed_at: datetime,
              now: datetime) -> set[int]:
    """The runs of ``run_ids`` still ``scheduled`` and untouched since their claim
    (``updated_at = claimed_at``), re-stamped ``updated_at = now`` so that no sweep takes
    them for another sweep delay; the others were materialised by a sweep meanwhile
    (:func:`materialise_unsent` moved their ``updated_at``) or settled. One ``UPDATE``, by
    primary key; joins the caller's transaction.

    Its row locks and the sweep's ``SKIP LOCKED`` claim exclude each other, and each checks
    its condition on the row as the other committed it, so whichever commits first wins and
    the other leaves the run alone."""
    if not run_ids:
        return set()
    return {int(r.id) for r in update_returning(
        conn,
        update(runs).where(_ids_clause(conn, runs.c.id, sorted(int(i) for i in run_ids)),
                           runs.c.state == "scheduled", runs.c.updated_at == claimed_at)
        .values(updated_at=now),
        runs, (runs.c.id,), lock_by_primary_key=True)}


def take_back_runs(store: Store, run_ids: Sequence[int], claimed_at: datetime | None
                   ) -> set[int]:
    """:func:`take_back` in its own short transaction (the beat's late fast path); empty
    when there is nothing to take or the database is unavailable (logged; a sweep sends
    them)."""
    if not run_ids or claimed_at is None:
        return set()
    try:
        with store.begin() as conn:
            return take_back(conn, run_ids, claimed_at=claimed_at, now=store.now(conn))
    except (StoreUnavailableError, DBAPIError) as exc:
        log.error("could not take back %d late triggers (%s); a sweep sends them",
                  len(run_ids), exc)
        return set()
