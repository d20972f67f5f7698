"""What the dashboard's pages read: indexed, paginated queries on the store.

Each function takes a connection (or the store) and returns plain dicts; the pages render
them. Nothing here writes. At size (tens of thousands of entries, millions of runs) every
list is one page (``LIMIT``) of an indexed order, and counts are of the filtered entries
only; the runs list pages by keyset (``created_at``, ``id``), never by offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import and_, func, or_, select
from sqlalchemy.engine import Connection

from reliable_beat import schedules as sch
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import (
    attempts,
    beats,
    dead_letters,
    entries,
    operator_actions,
    outbox,
    runs,
    workflows,
)
from reliable_beat.relay import outbox_status
from reliable_beat.rows import decode_row, display_rows, raw_columns
from reliable_beat.workflows.engine import workflow_counts

__all__ = [
    "ENTRY_STATES",
    "EntryFilter",
    "audit_rows",
    "dead_letter_page",
    "entry_page",
    "heartbeats",
    "outbox_rows",
    "run_page",
    "workers",
    "workflow_page",
]

#: The last-run states the entries page filters on (``outcome``).
ENTRY_STATES = ("succeeded", "dead", "retrying", "running", "dispatched", "skipped",
                "buffered", "scheduled", "none")
#: A process whose heartbeat is older than this is shown as gone.
ALIVE_SECONDS = 60.0


@dataclass(frozen=True)
class EntryFilter:
    """The entries page's filters (each optional)."""

    group: str | None = None
    task: str | None = None
    outcome: str | None = None  # the last slot run's state, or "none" (no run yet)
    name: str | None = None  # a substring of the name

    def where(self, last: Any) -> list[Any]:
        out: list[Any] = []
        if self.group:
            out.append(entries.c.schedule_group == self.group)
        if self.task:
            out.append(entries.c.task == self.task)
        if self.name:
            out.append(entries.c.name.contains(self.name, autoescape=True))
        if self.outcome == "none":
            out.append(last.c.state.is_(None))
        elif self.outcome:
            out.append(last.c.state == self.outcome)
        return out


def entry_page(conn: Connection, flt: EntryFilter, *, page: int, per_page: int
               ) -> tuple[list[dict[str, Any]], int]:
    """One page of entries by name, with their last slot run's state, and the number of
    entries that match the filter."""
    last = runs.alias("last_run")
    joined = entries.outerjoin(last, and_(last.c.entry_name == entries.c.name,
                                          last.c.fire_at == entries.c.last_fire_at))
    cond = flt.where(last)
    count_from = joined if flt.outcome else entries
    total = conn.execute(select(func.count()).select_from(count_from).where(*cond)).scalar_one()
    offset = max(page - 1, 0) * per_page
    shown = [*raw_columns(entries, conn.dialect), last.c.state.label("last_state"),
             last.c.dispatched_at.label("last_dispatched_at")]
    if flt.outcome:  # the filter is on the last run: join, then page
        stmt = (select(*shown).select_from(joined).where(*cond).order_by(entries.c.name)
                .offset(offset).limit(per_page))
    else:  # page the entries by name first (the index), then join only the page's runs
        ids = (select(entries.c.id).where(*cond).order_by(entries.c.name)
               .offset(offset).limit(per_page).subquery("page"))
        stmt = (select(*shown)
                .select_from(ids.join(entries, entries.c.id == ids.c.id).outerjoin(
                    last, and_(last.c.entry_name == entries.c.name,
                               last.c.fire_at == entries.c.last_fire_at)))
                .order_by(entries.c.name))
    rows = []
    for r in conn.execute(stmt).mappings():
        row, _bad = decode_row(entries, dict(r), conn.dialect)
        row = dict(row)
        row["last_state"] = r["last_state"]
        row["last_dispatched_at"] = r["last_dispatched_at"]
        rows.append(row)
    return rows, int(total)


def entry_groups(conn: Connection) -> list[str]:
    """The schedule groups of the entries (for the filter's choices)."""
    return [g for (g,) in conn.execute(
        select(entries.c.schedule_group).where(entries.c.schedule_group.is_not(None))
        .group_by(entries.c.schedule_group).order_by(entries.c.schedule_group))]


def heartbeats(conn: Connection, now: datetime) -> list[dict[str, Any]]:
    """Beats and relays that have not stopped, newest heartbeat first, with their ages."""
    rows = conn.execute(
        select(beats.c.owner, beats.c.role, beats.c.schedule_group, beats.c.started_at,
               beats.c.seen_at, beats.c.destinations)
        .where(beats.c.stopped_at.is_(None)).order_by(beats.c.seen_at.desc()).limit(200)
    ).mappings().all()
    out = []
    for r in rows:
        age = (now - r["seen_at"]).total_seconds()
        out.append({**dict(r), "age_seconds": age, "alive": age <= ALIVE_SECONDS})
    return out


def workers(conn: Connection, now: datetime, *, recent: int = 2000) -> list[dict[str, Any]]:
    """Workers seen in the last ``recent`` attempts (the primary key's end: no scan), with
    the age of their latest attempt start. Workers record no heartbeat of their own: an
    attempt is their sign of life."""
    last_id = conn.execute(select(func.max(attempts.c.id))).scalar()
    if last_id is None:
        return []
    rows = conn.execute(
        select(attempts.c.worker, func.max(attempts.c.started_at).label("seen_at"),
               func.count().label("attempts"))
        .where(attempts.c.id > last_id - recent, attempts.c.worker.is_not(None))
        .group_by(attempts.c.worker)
    ).mappings().all()
    out = []
    for r in rows:
        seen = r["seen_at"]
        if isinstance(seen, str):  # an aggregate comes back untyped on SQLite
            seen = datetime.fromisoformat(seen.replace("Z", "+00:00"))
        out.append({"worker": r["worker"], "seen_at": seen, "attempts": int(r["attempts"]),
                    "age_seconds": (now - seen).total_seconds() if seen else None})
    out.sort(key=lambda w: w["age_seconds"] if w["age_seconds"] is not None else 1e18)
    return out


def overview(conn: Connection, now: datetime) -> dict[str, Any]:
    """The overview's cheap parts (the alarms come from the status collection)."""
    return {
        "heartbeats": heartbeats(conn, now),
        "workers": workers(conn, now),
        "outbox": outbox_status(conn),
        "workflows": workflow_counts(conn),
        "entries": int(conn.execute(select(func.count()).select_from(entries)).scalar_one()),
    }


def run_page(conn: Connection, *, entry: str | None, state: str | None,
             before: tuple[datetime, int] | None, per_page: int) -> list[dict[str, Any]]:
    """Runs newest first (``created_at``, ``id``), one page after the keyset ``before``."""
    stmt = select(runs).order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(per_page)
    if entry:
        stmt = stmt.where(runs.c.entry_name == entry)
    if state:
        stmt = stmt.where(runs.c.state == state)
    if before is not None:
        at, rid = before
        stmt = stmt.where(or_(runs.c.created_at < at,
                              and_(runs.c.created_at == at, runs.c.id < rid)))
    return display_rows(conn, stmt, runs)


def run_detail(conn: Connection, key: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """One run by key and its attempts (oldest first)."""
    found = display_rows(conn, select(runs).where(runs.c.idempotency_key == key), runs)
    if not found:
        return None, []
    tries = display_rows(conn, select(attempts).where(attempts.c.run_id == found[0]["id"])
                         .order_by(attempts.c.id), attempts)
    return found[0], tries


def dead_letter_page(conn: Connection, *, pending: bool, before: int | None,
                     per_page: int) -> list[dict[str, Any]]:
    stmt = select(dead_letters).order_by(dead_letters.c.id.desc()).limit(per_page)
    if pending:
        stmt = stmt.where(dead_letters.c.requeued_at.is_(None))
    if before is not None:
        stmt = stmt.where(dead_letters.c.id < before)
    return display_rows(conn, stmt, dead_letters)


def workflow_page(conn: Connection, *, state: str | None, name: str | None,
                  before: int | None, per_page: int) -> list[dict[str, Any]]:
    stmt = (select(workflows.c.id, workflows.c.workflow_id, workflows.c.name,
                   workflows.c.state, workflows.c.run_no, workflows.c.history_len,
                   workflows.c.block_reason, workflows.c.created_at, workflows.c.updated_at,
                   workflows.c.entry_name)
            .order_by(workflows.c.id.desc()).limit(per_page))
    if state:
        stmt = stmt.where(workflows.c.state == state)
    if name:
        stmt = stmt.where(workflows.c.name == name)
    if before is not None:
        stmt = stmt.where(workflows.c.id < before)
    return [dict(r) for r in conn.execute(stmt).mappings()]


def outbox_rows(conn: Connection, *, state: str, destination: str | None,
                per_page: int) -> list[dict[str, Any]]:
    """Pending (oldest due first) or dead (newest first) outbox rows."""
    stmt = select(outbox).where(outbox.c.state == state).limit(per_page)
    stmt = stmt.order_by(outbox.c.available_at if state == "pending" else outbox.c.id.desc())
    if destination:
        stmt = stmt.where(outbox.c.destination == destination)
    return display_rows(conn, stmt, outbox)


def entry_runs(conn: Connection, name: str, per_page: int) -> list[dict[str, Any]]:
    """An entry's latest runs (slots and manual triggers), newest first."""
    stmt = (select(runs).where(runs.c.entry_name == name)
            .order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(per_page))
    return display_rows(conn, stmt, runs)


def audit_rows(store: Store, *, limit: int = 100, target: str | None = None
               ) -> list[dict[str, Any]]:
    """The latest operator actions, newest first."""
    stmt = select(operator_actions).order_by(operator_actions.c.id.desc()).limit(limit)
    if target is not None:
        stmt = stmt.where(operator_actions.c.target == target)
    with store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(stmt).mappings()]


def next_fires(schedule_spec: Any, zone: str, after: datetime, n: int
               ) -> list[dict[str, Any]]:
    """The next ``n`` slots of a schedule, each with its wall time in ``zone`` and whether the
    zone's UTC offset changed since the slot before (a DST transition between them)."""
    schedule = sch.schedule_from_spec(schedule_spec)
    tz = ZoneInfo(zone or "UTC")
    out: list[dict[str, Any]] = []
    at: datetime | None = after
    prev_offset: timedelta | None = after.astimezone(tz).utcoffset()
    for _ in range(n):
        assert at is not None
        at = schedule.next_after(at)
        if at is None:
            break
        local = at.astimezone(tz)
        offset = local.utcoffset()
        out.append({"at": at, "local": local, "zone": local.tzname(),
                    "dst_change": prev_offset is not None and offset != prev_offset})
        prev_offset = offset
    return out
