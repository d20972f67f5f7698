"""The reads of ``reliable-beat status``: one function per finding, each a query or two on a
connection the caller holds (:func:`reliable_beat.ops.status.collect_status` holds one for
all of them).

Values are read value by value where a row may be malformed (:mod:`reliable_beat.rows`): a
malformed row is shown as such or left to its own check, never fails the whole status.
Instants come back as UTC datetimes (:func:`as_utc`), measured on the store's clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import and_, func, or_, select, true
from sqlalchemy.engine import Connection

from reliable_beat import unsent
from reliable_beat.db.tables import (
    dead_letters,
    entries,
    outbox,
    runs,
    schedule_configs,
)
from reliable_beat.groups import outbox_group
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redispatch import backoff_wait
from reliable_beat.relay import outbox_status
from reliable_beat.retry_watch import overdue_retries
from reliable_beat.rows import (
    LabelledReader,
    column_of,
    decode_labelled,
    entry_checker,
    raw_labelled,
)
from reliable_beat.triggers import TRIGGER_DESTINATION, TRIGGER_DESTINATIONS, trigger_message_id

__all__ = [
    "MAX_DEPTH_ENTRIES",
    "UNPUBLISHED_SLOT_SECONDS",
    "UNSTARTED_WINDOW_HOURS",
    "as_utc",
    "dead_letter_totals",
    "dead_letters_by_entry",
    "expired_leases",
    "failing_by_entry",
    "last_started",
    "malformed_entries",
    "name_conflicts",
    "outbox_backlog",
    "read_entries",
    "undelivered_outbox",
    "unpublished_slots",
    "unstarted",
    "unstarted_triggers",
    "waiting_retries",
]

#: Triggers dispatched within this many hours are looked at for "never started by a worker".
UNSTARTED_WINDOW_HOURS = 24.0


#: UNPUBLISHED SLOTS: a due slot committed and not published for this many seconds (its slot
#: and last update): the sweep delay of the beats and relays that publish them (10 s) and a
#: minute's margin, so a live sweep of the run's version has had its turn.
UNPUBLISHED_SLOT_SECONDS = 10.0 + 60.0

#: ``status`` asks the broker about the queues of at most this many unstarted entries.
MAX_DEPTH_ENTRIES = 50


def as_utc(value: Any) -> datetime | None:
    """Aggregates come back untyped on SQLite (ISO text); make them UTC datetimes."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)  # type: ignore[no-any-return]


def outbox_backlog(conn: Connection, now: datetime) -> list[dict[str, Any]]:
    """The outbox backlog per destination: :func:`reliable_beat.relay.outbox_status`.

    Args:
        conn: a connection to the store.
        now: unused (the relay's query reads the store clock itself); kept for callers.

    Returns:
        One dict per destination with pending or dead rows, sorted by destination:
        ``{"destination", "pending", "due", "scheduled", "oldest_pending_at",
        "oldest_pending_age_seconds", "dead"}`` (``scheduled``: delayed rows not yet due,
        not backlog; the age is of the backlog only).
    """
    return outbox_status(conn)


def undelivered_outbox(conn: Connection, now: datetime,
                       minutes: float) -> list[dict[str, Any]]:
    """Pending outbox rows due for more than ``minutes`` that no relay claimed, per destination.

    A relay's claim moves ``available_at`` a lease ahead and a retry moves it to the next
    attempt, so a pending row whose ``available_at`` is older than ``now - minutes`` is one no
    running relay takes: its destination has no handler in any relay (a typo such as
    ``"emial"``), no relay runs at all, or an earlier row of its ordering key is stuck.
    Rows of no schedule group only (:func:`~reliable_beat.groups.outbox_group`): a group's
    rows are the UNSERVED OUTBOX check's (:func:`~reliable_beat.groups.unserved_outbox`).

    Returns:
        ``[{"destination": str, "rows": int, "due_since": datetime (UTC)}]``, by destination.
    """
    cutoff = now - timedelta(minutes=minutes)
    stmt = (
        select(outbox.c.destination, func.count(), func.min(outbox.c.available_at))
        .where(outbox.c.state == "pending", outbox.c.available_at <= cutoff,
               # a row of a schedule group only that group's relays and beats publish:
               # UNSERVED OUTBOX reports it, naming the group (not "no handler")
               outbox_group().is_(None))
        .group_by(outbox.c.destination)
        .order_by(outbox.c.destination)
    )
    return [{"destination": d, "rows": int(n), "due_since": as_utc(since)}
            for d, n, since in conn.execute(stmt)]


#: The columns :func:`reliable_beat.rows.check_entry` reads (MALFORMED ENTRY reads only these).
_CHECKED_COLUMNS = (
    "name", "task", "args", "kwargs", "options", "schedule", "timezone", "misfire_policy",
    "overlap_policy", "misfire_grace_seconds", "catch_up_limit", "catch_up_window_seconds",
    "next_fire_at", "last_fire_at", "end_at", "start_at",
)


def malformed_entries(conn: Connection) -> list[dict[str, Any]]:
    """Enabled, unquarantined entries with a next slot whose stored row a beat's claim
    would quarantine.

    Each row is checked with :func:`reliable_beat.rows.check_entry`, the check a beat's
    claim makes when the entry comes due; so a row changed by SQL (``args='"notalist"'``, a
    schedule ``{"every": "soon"}``) is found before it costs its slot. One query reading
    only the columns the check needs; values are decoded one by one (a value SQLite cannot
    decode is a problem of its column).

    Returns:
        ``[{"name", "origin" ("config" | "runtime"), "schedule_group" (str | None),
        "problems" ([str], each naming a column and what is expected)}]``, by name.
    """
    columns = {c: entries.c[c]
               for c in (*_CHECKED_COLUMNS, "config_hash", "origin", "schedule_group")}
    check = entry_checker()
    reader = LabelledReader(columns, conn.dialect)  # equal JSON values decoded once
    found: list[dict[str, Any]] = []
    for raw in conn.execute(
        select(*reader.select())
        # what a claim can take: enabled, not quarantined, a next slot (an ended entry's
        # NULL next_fire_at is no problem: nothing claims it)
        .where(entries.c.enabled.is_(True), entries.c.quarantine_reason.is_(None),
               entries.c.next_fire_at.is_not(None))
        .order_by(entries.c.name)
    ):
        r = reader.decode(raw._mapping)
        values = {c: getattr(r, c) for c in (*_CHECKED_COLUMNS, "config_hash")}
        problems = [f"{c}: unreadable value" for c in sorted(r.unreadable)]
        problems += [p for p in check(values) if column_of(p) not in r.unreadable]
        if problems:
            found.append({"name": r.name, "origin": r.origin,
                          "schedule_group": r.schedule_group, "problems": problems})
    return found


def name_conflicts(conn: Connection, stored: Mapping[str, tuple[Any, Any, Any]]
                   ) -> list[dict[str, Any]]:
    """Entries a group's current beat_schedule has that are enabled config entries of
    another group (its sync left them to that group: they never fire for this one).

    Args:
        conn: a connection to the store.
        stored: entry name -> ``(schedule_group, origin, enabled)`` of every stored entry.

    Returns:
        ``[{"entry", "group" (whose config has it), "owner_group" (the group that owns it),
        "synced_by" (str | None: the beat that synced the group's config), "owner_enabled"
        (bool: enabled there; False: the owner disabled it since, and ``group`` adopts it
        at its next sync, a beat restart or ``schedule sync``)}]``, by group then entry.
    """
    found: list[dict[str, Any]] = []
    columns = {"group": schedule_configs.c.schedule_group,
               "names": schedule_configs.c.entry_names,
               "synced_by": schedule_configs.c.synced_by}
    for raw in conn.execute(
        select(*raw_labelled(columns, conn.dialect))
        .where(schedule_configs.c.superseded_at.is_(None))
        .order_by(schedule_configs.c.schedule_group)
    ):
        cfg = decode_labelled(dict(raw._mapping), columns, conn.dialect)
        if not isinstance(cfg.names, list):
            continue
        for name in sorted({n for n in cfg.names if isinstance(n, str)}):
            owner_group, origin, enabled = stored.get(name, (None, None, None))
            if (origin == "config" and owner_group is not None
                    and owner_group != cfg.group):
                found.append({"entry": name, "group": cfg.group, "owner_group": owner_group,
                              "synced_by": cfg.synced_by, "owner_enabled": enabled is True})
    return found


def _last_slot_run(dialect: Any) -> tuple[Any, Any, Any]:
    """``(state, dispatched_at, FROM clause)``: each entry's last slot's run, one probe of
    the UNIQUE(entry_name, fire_at) index per entry (a ``LATERAL`` subquery on PostgreSQL,
    correlated scalar subqueries elsewhere). A plain outer join lets PostgreSQL's planner
    hash the whole runs table: 1.3 s at 20,000 entries and a million runs, against under
    0.1 s for the probes."""
    where = (runs.c.entry_name == entries.c.name, runs.c.fire_at == entries.c.last_fire_at)
    if dialect.name == "postgresql":
        last = (select(runs.c.state, runs.c.dispatched_at).where(*where).limit(1)
                .lateral("last_run"))
        return last.c.state, last.c.dispatched_at, entries.outerjoin(last, true())
    state, dispatched_at = (select(c).where(*where).correlate(entries).scalar_subquery()
                            for c in (runs.c.state, runs.c.dispatched_at))
    return state, dispatched_at, entries


def read_entries(conn: Connection) -> list[Any]:
    """Every entry with its last slot's run, by name, decoded value by value
    (:func:`reliable_beat.rows.decode_labelled`: a malformed row is shown as such, never
    fails the whole status): rows with ``name``, ``task``, ``origin``, ``enabled``,
    ``paused``, ``next_fire_at``, ``last_fire_at``, ``misfire_grace_seconds``,
    ``quarantine_reason``, ``schedule_group``, ``disabled_at``, ``last_state``,
    ``last_dispatched_at`` and ``unreadable`` (the columns that could not be decoded)."""
    last_state, last_dispatched_at, from_clause = _last_slot_run(conn.dialect)
    columns = {
        "name": entries.c.name, "task": entries.c.task, "origin": entries.c.origin,
        "enabled": entries.c.enabled, "paused": entries.c.paused,
        "next_fire_at": entries.c.next_fire_at, "last_fire_at": entries.c.last_fire_at,
        "misfire_grace_seconds": entries.c.misfire_grace_seconds,
        "quarantine_reason": entries.c.quarantine_reason,
        "schedule_group": entries.c.schedule_group, "disabled_at": entries.c.disabled_at,
        "last_state": last_state, "last_dispatched_at": last_dispatched_at,
    }
    raw_rows = conn.execute(
        select(*raw_labelled(columns, conn.dialect)).select_from(from_clause)
        .order_by(entries.c.name)
    ).all()
    # value by value (reliable_beat.rows): a malformed row is shown as such, never fails
    # the whole status
    return [decode_labelled(r._mapping, columns, conn.dialect) for r in raw_rows]


def failing_by_entry(conn: Connection) -> dict[str, int]:
    """``{entry: its runs in retrying}``."""
    return dict(
        conn.execute(
            select(runs.c.entry_name, func.count())
            .where(runs.c.state == "retrying", runs.c.entry_name.is_not(None))
            .group_by(runs.c.entry_name)
        ).all()
    )


def dead_letters_by_entry(conn: Connection) -> dict[str, int]:
    """``{entry: its run dead letters neither requeued nor handled}``."""
    return dict(
        conn.execute(
            select(dead_letters.c.entry_name, func.count())
            .where(dead_letters.c.requeued_at.is_(None), dead_letters.c.kind == "run",
                   dead_letters.c.handled_at.is_(None),
                   dead_letters.c.entry_name.is_not(None))
            .group_by(dead_letters.c.entry_name)
        ).all()
    )


def dead_letter_totals(conn: Connection) -> tuple[Any, Any]:
    """``(dead letters waiting for a person, dead letters handled by design)``, neither
    requeued. A failure handled by design (a completed saga's step: ``handled_at``) pages
    no one."""
    dead_total, handled_total = conn.execute(
        select(func.count(dead_letters.c.id) - func.count(dead_letters.c.handled_at),
               func.count(dead_letters.c.handled_at))
        .where(dead_letters.c.requeued_at.is_(None))
    ).one()
    return dead_total, handled_total


def unstarted_triggers(conn: Connection, names: list[str]
                       ) -> list[tuple[str, OutboxMessage]]:
    """``[(entry, its newest unstarted trigger's outbox row)]`` for (at most
    :data:`MAX_DEPTH_ENTRIES` of) ``names``: the trigger of each entry's latest
    ``dispatched`` run without ``started_at`` (one query); for a run whose trigger has no
    row (published by the beat's fast path, or purged) its message as a re-send builds it
    (:func:`reliable_beat.unsent.run_messages`: the entry's options, so its queue)."""
    names = names[:MAX_DEPTH_ENTRIES]
    if not names:
        return []
    latest = (
        select(runs.c.entry_name, func.max(runs.c.id).label("run_id"))
        .where(runs.c.entry_name.in_(names), runs.c.state == "dispatched",
               runs.c.started_at.is_(None))
        .group_by(runs.c.entry_name)
        .subquery()
    )
    keys = {str(key): (str(entry), int(run_id)) for entry, key, run_id in conn.execute(
        select(latest.c.entry_name, runs.c.idempotency_key, runs.c.id)
        .select_from(latest.join(runs, runs.c.id == latest.c.run_id)))}
    if not keys:
        return []
    by_message = {trigger_message_id(k): e for k, (e, _) in keys.items()}
    rows = conn.execute(select(outbox).where(outbox.c.message_id.in_(sorted(by_message))))
    found = []
    seen = set()
    for row in rows:
        seen.add(row.message_id)
        try:
            found.append((by_message[row.message_id], OutboxMessage.from_row(row)))
        except Exception:  # a malformed row: no depth for it (status reports rows elsewhere)
            continue
    bare = [run_id for k, (_, run_id) in keys.items() if trigger_message_id(k) not in seen]
    if bare:
        try:
            run_rows = conn.execute(select(runs).where(runs.c.id.in_(bare))).all()
            found += [(by_message[m.message_id], m) for m in unsent.run_messages(
                conn, run_rows, TRIGGER_DESTINATION)]
        except Exception:  # a malformed run: no depth for it (status reports it elsewhere)
            pass
    return sorted(found, key=lambda t: t[0])


def unstarted(
    conn: Connection, now: datetime, redispatch_seconds: float
) -> tuple[dict[str, int], bool, set[str]]:
    """Entries whose triggers no worker started: ``({entry: unstarted count}, whether any
    start was recorded in the window, {the entries of those with a started trigger later
    than their latest unstarted one})``.

    A trigger counts when it is ``dispatched``, was dispatched between the window's start
    and ``now - redispatch_seconds`` (or was re-dispatched already: the sweep re-sends it
    and moves its ``dispatched_at`` to then, yet it waited that long), and has no
    ``started_at`` (an ``IdempotentTask``'s
    claim sets it; :mod:`reliable_beat.celery.acks` sets it for plain tasks). An entry is
    reported when it has no started trigger in the window, or when such a trigger is later
    than its first started one (its workers can start it, yet some triggers went unstarted:
    lost, e.g. consumed by another app's worker as an unregistered task), and only when some
    start was recorded in the window at all (the workers do record starts). Unstarted
    triggers older than the first started one (a task name fixed since) are not reported.
    An entry whose latest unstarted trigger is older than its latest started one is in the
    third element: its workers do know the task, so "no worker registers it" is not the
    advice (lost triggers, or starts a worker could not record: the database was down).
    """
    lo = now - timedelta(hours=UNSTARTED_WINDOW_HOURS)
    hi = now - timedelta(seconds=redispatch_seconds)
    recent = and_(runs.c.entry_name.is_not(None), runs.c.dispatched_at >= lo)
    pending = dict(
        (name, (int(n), as_utc(latest))) for name, n, latest in conn.execute(
            select(runs.c.entry_name, func.count(), func.max(runs.c.dispatched_at))
            .where(recent, runs.c.state == "dispatched", runs.c.started_at.is_(None),
                   or_(runs.c.dispatched_at <= hi, runs.c.redispatches > 0))
            .group_by(runs.c.entry_name)
        ).all()
    )
    if not pending:
        return {}, True, set()
    started = {
        name: (as_utc(first), as_utc(last)) for name, first, last in conn.execute(
            select(runs.c.entry_name, func.min(runs.c.dispatched_at),
                   func.max(runs.c.dispatched_at))
            .where(recent, runs.c.started_at.is_not(None),
                   runs.c.entry_name.in_(list(pending)))
            .group_by(runs.c.entry_name)
        ).all()
    }
    if not started and conn.execute(
        select(runs.c.id).where(recent, runs.c.started_at.is_not(None)).limit(1)
    ).first() is None:
        return {}, False, set()  # no worker records starts: cannot tell; status warns instead
    out: dict[str, int] = {}
    between: set[str] = set()
    for name, (count, latest) in pending.items():
        first, last = started.get(name, (None, None))
        if first is None or (latest is not None and latest > first):
            out[name] = count
            if last is not None and latest is not None and latest < last:
                between.add(name)
    return out, True, between


def waiting_retries(conn: Connection, now: datetime, *, redispatch_seconds: float,
                    retry_cap_seconds: float, limit: int = 10) -> tuple[int, list[dict[str, Any]]]:
    """``retrying`` runs the re-dispatch sweep's re-sends did not move on (RETRY OVERDUE):
    :func:`reliable_beat.retry_watch.overdue_retries`."""
    return overdue_retries(conn, now, redispatch_seconds=redispatch_seconds,
                           retry_cap_seconds=retry_cap_seconds, limit=limit)


def expired_leases(conn: Connection, now: datetime, *, grace_seconds: float,
                   redispatch_seconds: float, limit: int = 10
                   ) -> tuple[int, list[dict[str, Any]]]:
    """``running`` runs whose lease ended more than ``grace_seconds`` ago: stuck.

    A live holder renews its lease every ``lease / 3`` (a renewal that waits on a lock
    tries again at the next one), so its lease never ends; a lease that ended
    ``grace_seconds`` ago belongs to a worker that stopped (killed, frozen, its host gone)
    whose message did not come back to another worker (a redelivery would have taken the
    run over). The re-dispatch sweep re-sends such a run's trigger once its lease ended
    ``redispatch_seconds * 2**k`` ago (k: its re-sends, capped; it then moves
    ``lease_expires_at`` to its clock, so a run it re-sent drops out of this list for
    ``grace_seconds``); ``reliable-beat lease clear KEY`` re-sends it at once.

    Args:
        conn: a connection to the store.
        now: the store's clock (UTC).
        grace_seconds: how long past its end a lease must be.
        redispatch_seconds: ``reliable_beat_redispatch_seconds`` (for ``resend_at``).
        limit: how many runs to return (the longest expired first).

    Returns:
        ``(count, runs)``: how many, and the ``limit`` longest expired as ``{"key",
        "entry", "leased_by", "lease_expires_at" (UTC), "expired_seconds" (float),
        "resend_at" (UTC datetime of the sweep's next re-send; None: the run has no trigger
        row and no entry (an ad-hoc call, a workflow activity): the sweep does not re-send
        it)}``.
    """
    stuck = and_(runs.c.state == "running",
                 runs.c.lease_expires_at < now - timedelta(seconds=grace_seconds))
    total = int(conn.execute(select(func.count()).select_from(runs).where(stuck)).scalar_one())
    if not total:
        return 0, []
    columns = {"key": runs.c.idempotency_key, "entry": runs.c.entry_name,
               "leased_by": runs.c.leased_by, "ended": runs.c.lease_expires_at,
               "resends": runs.c.redispatches}
    # value by value (reliable_beat.rows): a malformed row (MALFORMED RUN ROWS, quarantine)
    # is left to its own check, never fails the whole status
    rows = [decode_labelled(dict(r._mapping), columns, conn.dialect) for r in conn.execute(
        select(*raw_labelled(columns, conn.dialect))
        .where(stuck).order_by(runs.c.lease_expires_at, runs.c.id).limit(limit)
    ).all()]
    found = {m for (m,) in conn.execute(
        select(outbox.c.message_id).where(
            outbox.c.message_id.in_([trigger_message_id(str(r.key)) for r in rows]),
            outbox.c.destination.in_(sorted(TRIGGER_DESTINATIONS))))}
    shown = []
    for r in rows:
        if r.unreadable or not isinstance(r.ended, datetime):
            continue
        key, entry, holder, resends = r.key, r.entry, r.leased_by, r.resends
        ended = as_utc(r.ended)
        if ended is None:
            continue
        wait = backoff_wait(timedelta(seconds=redispatch_seconds),
                            resends if isinstance(resends, int) else 0)
        shown.append({
            "key": key, "entry": entry, "leased_by": holder, "lease_expires_at": ended,
            "expired_seconds": round((now - ended).total_seconds(), 3),
            # the sweep re-sends a run with a trigger row, and a periodic run without one
            "resend_at": ended + wait if trigger_message_id(str(key)) in found or (
                entry and not str(key).startswith("wf:")) else None,
        })
    return total, shown


def last_started(conn: Connection, names: list[str]) -> dict[str, datetime]:
    """``{entry: its latest recorded trigger start, at any time}`` for those of ``names``
    that ever started one (the others never ran: NEVER STARTED)."""
    if not names:
        return {}
    rows = conn.execute(
        select(runs.c.entry_name, func.max(runs.c.started_at))
        .where(runs.c.entry_name.in_(names), runs.c.started_at.is_not(None))
        .group_by(runs.c.entry_name)
    ).all()
    return {name: at for name, last in rows if (at := as_utc(last)) is not None}




def unpublished_slots(conn: Connection, now: datetime,
                      seconds: float = UNPUBLISHED_SLOT_SECONDS) -> dict[str, Any]:
    """Due slots a beat committed and never published, and no sweep published since: runs
    ``scheduled`` by the schedule (trigger ``schedule`` / ``catch_up``, an entry named) with no
    trigger row (``trigger:<key>``) whose slot and last update are more than ``seconds`` old
    (the runs :func:`reliable_beat.unsent.materialise_unsent` would take). Only a beat or a
    relay with the app, of a version that writes rows for them, publishes them. Two queries
    on the runs' state index.

    Returns:
        ``{"count": int, "oldest_key": str | None, "oldest_fire_at": datetime | None}``.
    """
    cutoff = now - timedelta(seconds=seconds)
    where = (runs.c.state == "scheduled", runs.c.entry_name.is_not(None),
             runs.c.trigger.in_(unsent.SWEPT_TRIGGERS), runs.c.fire_at <= cutoff,
             runs.c.updated_at <= cutoff, ~unsent.has_trigger_row())
    count = int(conn.execute(select(func.count()).select_from(runs).where(*where)).scalar()
                or 0)
    if not count:
        return {"count": 0, "oldest_key": None, "oldest_fire_at": None}
    oldest = conn.execute(select(runs.c.idempotency_key, runs.c.fire_at).where(*where)
                          .order_by(runs.c.fire_at, runs.c.id).limit(1)).first()
    return {"count": count, "oldest_key": oldest.idempotency_key if oldest else None,
            "oldest_fire_at": as_utc(oldest.fire_at) if oldest else None}
