"""An entry's ``next_fire_at`` checked against its schedule.

The beat claims an entry when its ``next_fire_at`` comes due, so that one column decides
whether the entry ever fires again: NULL (an entry whose schedule has ended) is never
claimed, and a far-future instant is not claimed until then. A value its schedule cannot
have put there (a row changed by SQL, a restore, a hand edit) would stop the entry with no
error at all. :func:`next_fire_problem` names such a value; :func:`repaired_next_fire` is
the value the schedule gives (what ``reliable-beat entries resume`` writes);
:func:`inconsistent_next_fire` reads the entries that have one (``status``: NEXT FIRE
INCONSISTENT) and :func:`quarantine_inconsistent_next_fire` quarantines them (the beat's
periodic check), as a malformed column is quarantined.

Only enabled, unpaused, unquarantined entries are looked at (the others fire on nothing
but a person's decision). Two values are wrong:

* NULL while the schedule has a slot after the entry's last slot (its last fire, fired or
  skipped; never fired: after now), at or after ``start_at`` and not past ``end_at``. An
  ended entry (a one-off that fired, a schedule past its ``end_at``) is NULL rightly.
* Later than where the schedule puts it: after the slot *following* the schedule's next slot
  after ``max(now, last fire, start_at)``, and more than :data:`TOLERANCE` after that next
  slot. A yearly cron's next fire eleven months ahead is its next slot, no alarm; an
  every-5-s entry's next fire in 2999 is. Cron schedules are walked in their own zone, so
  DST transitions count as the schedule counts them.

An instant in the past is never a problem here: the beat claims it at once and the misfire
policy decides the missed slots.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.engine import Connection

from reliable_beat import schedules as sch
from reliable_beat.db.tables import entries
from reliable_beat.redaction import get_logger
from reliable_beat.rows.decode import LabelledReader
from reliable_beat.rows.quarantine import quarantine_entry

__all__ = [
    "TOLERANCE",
    "inconsistent_next_fire",
    "next_fire_fix",
    "next_fire_problem",
    "quarantine_inconsistent_next_fire",
    "repaired_next_fire",
]

log = get_logger("reliable_beat.rows")

#: A ``next_fire_at`` up to this far past the schedule's next slot is never a problem (a
#: beat pushes an entry it cannot plan a minute ahead; clocks of two beats differ).
TOLERANCE = timedelta(minutes=5)
_SECOND = timedelta(seconds=1)


def _after(base: datetime, start_at: datetime | None) -> datetime:
    """``base``, or just before ``start_at`` when that is later (the first slot at or after
    ``start_at``, as :meth:`reliable_beat.definitions.EntryDefinition.first_fire_at`)."""
    if start_at is not None and start_at - _SECOND > base:
        return start_at - _SECOND
    return base


def _since(schedule: sch.Schedule, last_fire_at: datetime | None,
           created_at: datetime | None, now: datetime) -> datetime:
    """The instant after which an entry's next slot lies: its last slot; never fired: a
    one-off's own instant (its only slot is still owed), else when the entry was created
    (the slots since go through the misfire policy), else ``now``."""
    if last_fire_at is not None:
        return last_fire_at
    if isinstance(schedule, sch.OneOffSchedule):
        return schedule.at - _SECOND
    if created_at is not None:
        return min(created_at, now)
    return now


def repaired_next_fire(schedule: sch.Schedule, *, last_fire_at: datetime | None,
                       start_at: datetime | None, end_at: datetime | None,
                       now: datetime, created_at: datetime | None = None) -> datetime | None:
    """The ``next_fire_at`` the schedule gives: its first slot after the entry's last slot
    (never fired: a one-off's instant; a recurring schedule's first slot after
    ``created_at``, or after ``now`` without it), at or after ``start_at``; None when that
    is past ``end_at`` or the schedule has none (the entry has ended). It may be in the
    past: the beat then claims the entry at once and its misfire policy decides the missed
    slots."""
    nxt = schedule.next_after(_after(_since(schedule, last_fire_at, created_at, now),
                                     start_at))
    if nxt is not None and end_at is not None and nxt > end_at:
        return None
    return nxt


def next_fire_problem(schedule: sch.Schedule, *, next_fire_at: datetime | None,
                      last_fire_at: datetime | None, start_at: datetime | None,
                      end_at: datetime | None, now: datetime,
                      next_after: Any = None, created_at: datetime | None = None
                      ) -> str | None:
    """What is wrong with an active entry's ``next_fire_at`` (the module's two rules), as a
    problem string naming the column (:func:`reliable_beat.rows.column_of`), or None.

    Args:
        next_after: ``(schedule, instant) -> slot``, a caching stand-in for
            ``schedule.next_after`` (many entries share a schedule and an instant).
    """
    step = next_after or (lambda s, at: s.next_after(at))
    if next_fire_at is None:
        due = repaired_next_fire(schedule, last_fire_at=last_fire_at, start_at=start_at,
                                 end_at=end_at, now=now, created_at=created_at)
        if due is None:
            return None  # ended: nothing left on its schedule
        return (f"next_fire_at=NULL: its schedule has a slot at {_iso(due)} (after its last "
                f"slot {_iso(last_fire_at)}), so the entry is not ended, but with no "
                "next_fire_at no beat ever claims it")
    ref = now if last_fire_at is None or last_fire_at < now else last_fire_at
    ref = _after(ref, start_at)
    bound = step(schedule, ref)
    if bound is None or next_fire_at <= bound + TOLERANCE:
        return None
    following = step(schedule, bound)
    if following is not None and next_fire_at <= following:
        return None
    return (f"next_fire_at={_iso(next_fire_at)}: later than its schedule can put it (its "
            f"next slot is {_iso(bound)}); no beat claims the entry before "
            f"{_iso(next_fire_at)}, so its slots until then are lost")


def next_fire_fix(name: str) -> str:
    """The repair to log and show for an entry with a :func:`next_fire_problem`."""
    return (f"run `reliable-beat entries resume {name}`: it recomputes next_fire_at from the "
            "schedule (after the last slot; slots missed meanwhile go through the misfire "
            "policy)")


def _iso(at: datetime | None) -> str:
    return "-" if at is None else at.isoformat().replace("+00:00", "Z")


_COLUMNS = ("name", "origin", "schedule_group", "schedule", "next_fire_at", "last_fire_at",
            "start_at", "end_at", "created_at")


def inconsistent_next_fire(conn: Connection, now: datetime, *,
                           groups: Iterable[str | None] | None = None
                           ) -> list[dict[str, Any]]:
    """Enabled, unpaused, unquarantined entries whose ``next_fire_at`` breaks a rule of
    :func:`next_fire_problem`.

    One query; only rows whose ``next_fire_at`` is NULL or more than :data:`TOLERANCE`
    ahead are read (no other value can break a rule). Each distinct schedule is built once
    and each ``(schedule, instant)`` step computed once, so 10,000 hourly entries cost one
    cron walk. A row whose columns cannot be read or whose schedule does not build is left
    to the malformed-row check (MALFORMED ENTRY, the claim's quarantine).

    Args:
        groups: only entries of these schedule groups (None in it: of no group); None: all.

    Returns:
        ``[{"name", "id", "origin", "schedule_group", "next_fire_at", "problem", "fix"}]``,
        by name.
    """
    columns = {c: entries.c[c] for c in _COLUMNS}
    columns["id"] = entries.c.id
    reader = LabelledReader(columns, conn.dialect)
    stmt = (select(*reader.select())
            .where(entries.c.enabled.is_(True), entries.c.paused.is_(False),
                   entries.c.quarantine_reason.is_(None),
                   or_(entries.c.next_fire_at.is_(None),
                       entries.c.next_fire_at > now + TOLERANCE))
            .order_by(entries.c.name))
    if groups is not None:
        wanted = list(groups)
        named = [g for g in wanted if g is not None]
        clauses = [entries.c.schedule_group.in_(named)] if named else []
        if None in wanted:
            clauses.append(entries.c.schedule_group.is_(None))
        stmt = stmt.where(or_(*clauses)) if clauses else stmt.where(entries.c.id.is_(None))
    built: dict[str, Any] = {}
    steps: dict[tuple[int, datetime], datetime | None] = {}

    def next_after(schedule: sch.Schedule, at: datetime) -> datetime | None:
        key = (id(schedule), at)
        if key not in steps:
            if len(steps) > 10_000:
                steps.clear()
            steps[key] = schedule.next_after(at)
        return steps[key]

    found: list[dict[str, Any]] = []
    for raw in conn.execute(stmt):
        r = reader.decode(raw._mapping)
        instants = (r.next_fire_at, r.last_fire_at, r.start_at, r.end_at)
        if r.unreadable or not isinstance(r.schedule, dict) or not all(
                v is None or isinstance(v, datetime) for v in instants):
            continue  # malformed: the row check's business
        try:
            key = json.dumps(r.schedule, sort_keys=True, default=str)
            if key not in built:
                built[key] = sch.schedule_from_spec(r.schedule)
            schedule = built[key]
            problem = next_fire_problem(
                schedule, next_fire_at=r.next_fire_at, last_fire_at=r.last_fire_at,
                start_at=r.start_at, end_at=r.end_at, now=now, next_after=next_after,
                created_at=r.created_at if isinstance(r.created_at, datetime) else None)
        except Exception:  # a spec that does not build: MALFORMED ENTRY says so
            built.setdefault(key, None)
            continue
        if problem is not None:
            found.append({"name": r.name, "id": r.id, "origin": r.origin,
                          "schedule_group": r.schedule_group, "next_fire_at": r.next_fire_at,
                          "problem": problem, "fix": next_fire_fix(r.name)})
    return found


def quarantine_inconsistent_next_fire(conn: Connection, now: datetime, *,
                                      groups: Iterable[str | None] | None = None
                                      ) -> list[str]:
    """Quarantine every entry :func:`inconsistent_next_fire` finds (disabled with the
    reason, logged at ERROR naming the entry and the fix: ``reliable-beat entries resume
    NAME`` recomputes ``next_fire_at``); joins the caller's transaction.

    Returns:
        The names quarantined.
    """
    found = inconsistent_next_fire(conn, now, groups=groups)
    for f in found:
        quarantine_entry(conn, {"id": f["id"], "name": f["name"], "origin": "runtime"},
                         [f"{f['problem']}; {f['fix']}"], now, unreadable=())
    return [f["name"] for f in found]
