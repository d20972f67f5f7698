"""``reliable-beat status``: what an operator needs at 02:00, in one screen (or ``--json``).

Per entry: next fire time, last slot and its run state, lag (how late the last slot was
dispatched: ``dispatched_at - fire_at``), failing (``retrying``) and dead counts. Then the
outbox backlog per destination, dead letters, and the **missed slots** check: an enabled,
unpaused entry whose ``next_fire_at`` is older than ``now - misfire_grace - margin`` means no
beat is claiming entries (none running, or all stuck). The **unserved outbox** check: pending
rows of a schedule group (a workflow's messages, an entry's triggers) due for a while with no
live relay or beat of that group (relays and beats record heartbeats in
``reliable_beat_beats``), which only that group's processes publish. ``--check`` exits 1 when
something needs a person (missed slots, dead letters, unserved rows), so the command doubles
as a probe. **MALFORMED ENTRY**: an enabled entry whose stored row fails the claim's check
(:func:`reliable_beat.rows.check_entry`), reported before it comes due (a beat would
quarantine it then, losing that slot). **NAME CONFLICT**: an entry of a group's current
beat_schedule that is an enabled config entry of another group (its sync left it alone: it
never fires for this group). **WORKFLOW ADVANCES EXPIRING** / **WORKFLOWS NOT STARTED**:
workflows whose advance's lease keeps expiring, and workflows ``pending`` past
``reliable_beat_workflow_pending_alarm_seconds`` (:mod:`reliable_beat.workflows.runaway`).

All instants are UTC and measured on the store's clock; the store URL is shown with its
password hidden.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import click
from sqlalchemy import and_, func, or_, select, true
from sqlalchemy.engine import Connection

from reliable_beat.cli import CliContext, fail, jsonable, pass_cli
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import (
    dead_letters,
    entries,
    outbox,
    runs,
    schedule_configs,
)
from reliable_beat.db.types import infinity_text
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.groups import (
    group_health,
    outbox_group,
    unpublished_triggers,
    unserved_outbox,
)
from reliable_beat.outbox import OutboxMessage
from reliable_beat.policies import MISSED_MARGIN_SECONDS
from reliable_beat.policies import is_missed as missed_slot
from reliable_beat.retry_watch import overdue_retries
from reliable_beat.rows import (
    LabelledReader,
    column_of,
    decode_labelled,
    entry_checker,
    quarantine_counts,
    raw_labelled,
)
from reliable_beat.triggers import TRIGGER_DESTINATIONS, trigger_message_id

if TYPE_CHECKING:
    from reliable_beat.redispatch import QueueDepthFn

__all__ = [
    "DEFAULT_MARGIN_SECONDS",
    "collect_status",
    "entry_checker",
    "expired_leases",
    "framework_name",
    "jsonable",
    "malformed_entries",
    "name_conflicts",
    "outbox_backlog",
    "quarantine_counts",
    "register",
    "stalled_queue_depths",
    "status",
    "undelivered_outbox",
    "waiting_retries",
]

#: Extra slack (seconds) on top of an entry's ``misfire_grace`` before a due entry counts as
#: missed (:func:`reliable_beat.policies.is_missed`).
DEFAULT_MARGIN_SECONDS = MISSED_MARGIN_SECONDS
#: ``--check`` alarms on config entries a sync disabled within this many minutes.
DEFAULT_DISABLED_WITHIN_MINUTES = 60.0
#: A beat whose heartbeat (every few seconds) is older than this counts as gone.
BEAT_ALIVE_SECONDS = 60.0
#: ``--check`` alarms on pending outbox rows due this many minutes and claimed by no relay.
DEFAULT_OUTBOX_STUCK_MINUTES = 10.0
#: ``--check`` alarms on a schedule group's pending rows due this many seconds while no live
#: relay or beat of the group runs (nothing will ever publish them).
DEFAULT_UNSERVED_SECONDS = 60.0
#: The text output of ``status`` lists at most this many entries (``--rows``), then a count.
DEFAULT_ENTRY_ROWS = 50
#: LEASE EXPIRED: a ``running`` run whose lease ended more than this many seconds ago. A live
#: holder renews every lease / 3, so its lease never ends; one that ended this long ago
#: belongs to a worker that stopped (died, frozen), not to one in the middle of a renewal.
DEFAULT_LEASE_EXPIRED_SECONDS = 30.0
#: MALFORMED ENTRY / NAME CONFLICT: at most this many names (with their problems) are shown.
MAX_SHOWN = 10
#: Triggers dispatched within this many hours are looked at for "never started by a worker".
UNSTARTED_WINDOW_HOURS = 24.0


def _utc(value: Any) -> datetime | None:
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
    from reliable_beat.relay import outbox_status

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
    return [{"destination": d, "rows": int(n), "due_since": _utc(since)}
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


def _malformed_fix(m: dict[str, Any]) -> str:
    """How to repair one MALFORMED ENTRY (a config entry: from its beat_schedule)."""
    name = m["name"]
    if m["origin"] == "config":
        return (f"a config entry: `reliable-beat -A APP schedule sync` (or a restart of a "
                f"beat of group {m['schedule_group'] or 'default'!r}) rewrites it from its "
                "beat_schedule")
    return f"`reliable-beat entries update {name} ...` with the right values"


def _malformed_problem(found: list[dict[str, Any]]) -> str:
    """The MALFORMED ENTRY line (bounded: the first :data:`MAX_SHOWN` entries)."""
    shown = "; ".join(
        f"{m['name']!r}: {', '.join(m['problems'][:3])}"
        f"{' ...' if len(m['problems']) > 3 else ''} (fix: {_malformed_fix(m)})"
        for m in found[:MAX_SHOWN])
    return (
        f"MALFORMED ENTRY: {len(found)} enabled entries have a stored row a beat cannot fire "
        f"({shown}{'; ...' if len(found) > MAX_SHOWN else ''}): a beat quarantines each when it "
        "comes due, and that slot is lost. Repair them before then (`reliable-beat entries "
        "show NAME` shows the row)."
    )


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


def collect_status(
    store: Store, *, margin_seconds: float = DEFAULT_MARGIN_SECONDS,
    disabled_within_minutes: float = DEFAULT_DISABLED_WITHIN_MINUTES,
    beat_alive_seconds: float = BEAT_ALIVE_SECONDS,
    redispatch_seconds: float = 120.0,
    outbox_stuck_minutes: float = DEFAULT_OUTBOX_STUCK_MINUTES,
    unserved_seconds: float = DEFAULT_UNSERVED_SECONDS,
    framework: str | None = None,
    retry_cap_seconds: float = 600.0,
    queue_depths: QueueDepthFn | None = None,
    lease_expired_seconds: float = DEFAULT_LEASE_EXPIRED_SECONDS,
    workflow_pending_alarm_seconds: float = 300.0,
    workflow_max_takeovers: int = 3,
) -> dict[str, Any]:
    """Read everything ``status`` shows, in a few queries on one connection.

    Args:
        store: the store.
        margin_seconds: slack added to each entry's ``misfire_grace`` before its overdue
            ``next_fire_at`` counts as a missed slot.
        disabled_within_minutes: config entries a sync disabled this recently are an alarm
            (an entry vanished from its group's ``beat_schedule``: on purpose, or a deploy
            of the wrong config?).
        beat_alive_seconds: a beat whose heartbeat is older than this counts as gone.
        redispatch_seconds: a trigger no worker started this long after it was dispatched
            (``reliable_beat_redispatch_seconds``) counts as never acknowledged.
        outbox_stuck_minutes: pending outbox rows due this many minutes and claimed by no
            relay are an alarm, per destination (see :func:`undelivered_outbox`).
        unserved_seconds: pending rows of a schedule group due this many seconds while no
            live relay or beat of that group runs are an alarm, per group (see
            :func:`reliable_beat.groups.unserved_outbox`; liveness: ``beat_alive_seconds``).
        framework: the app's framework (``"celery"``, ``"dramatiq"``, ...; see
            :func:`framework_name`), for advice in its terms; None: neutral advice.
        retry_cap_seconds: ``reliable_beat_retry_cap_seconds``: with ``redispatch_seconds``
            it says when the re-dispatch sweep re-sends a ``retrying`` run (see
            :func:`waiting_retries`).
        queue_depths: the app's broker probe (its adapter's ``queue_depths``,
            :data:`reliable_beat.redispatch.QueueDepthFn`), asked after the store's
            connection is closed about the queues of the newest unstarted trigger of each
            STALLED / NEVER STARTED / UNSTARTED entry (see :func:`stalled_queue_depths`);
            None (no ``-A``, or an adapter without one): no depths.
        lease_expired_seconds: a ``running`` run whose lease ended this long ago is an alarm
            (LEASE EXPIRED, see :func:`expired_leases`).
        workflow_pending_alarm_seconds: a workflow ``pending`` this long is an alarm
            (WORKFLOWS NOT STARTED); workflow_max_takeovers: named in the advice of WORKFLOW
            ADVANCES EXPIRING (see :mod:`reliable_beat.workflows.runaway`).

    Returns:
        ``{"store" (URL, password hidden), "store_id" (str | None: the id triggers carry,
        see :mod:`reliable_beat.identity`), "now" (UTC), "entries": [...], "missed": [names],
        "outbox": [...] (see :func:`outbox_backlog`), "dead_letters" (int, not requeued
        nor handled), "dead_letters_handled" (int: failures handled by design, e.g. a saga's
        compensated step; listed by ``dead-letters list --handled``, no alarm),
        "unstarted": {entry: count of its triggers of the last 24 h that no worker started
        within ``redispatch_seconds``, for entries with no started trigger, or with an
        unstarted one later than their first started one}, "unstarted_between": [entries
        of those whose latest unstarted trigger is older than a started one: reported as
        UNSTARTED BETWEEN STARTED, not NEVER STARTED], "unstarted_stalled": [the others
        that have a started trigger at any time (ran before, then stopped being started:
        STALLED, workers down or behind), not NEVER STARTED], "last_started_at": {entry:
        UTC datetime of its latest recorded start, for those of "unstarted" that ever
        started}, "groups": [...] (see
        :func:`~reliable_beat.groups.group_health`),
        "recently_disabled":
        [names], "unregistered": {entry: task},
        "quarantined": [{"name", "reason"}] (malformed entries, disabled),
        "malformed_entries": [{"name", "origin", "schedule_group", "problems"}] (enabled
        entries a beat's claim would quarantine when due, see :func:`malformed_entries`:
        MALFORMED ENTRY), "name_conflicts": [{"entry", "group", "owner_group",
        "synced_by", "owner_enabled"}] (see :func:`name_conflicts`: NAME CONFLICT),
        "quarantined_rows": {"entries", "outbox", "runs"} (see :func:`quarantine_counts`),
        "malformed_run_states": {"count", "keys"} (runs whose state is none the library
        writes, :func:`reliable_beat.rows.unknown_state_runs`),
        "undelivered_outbox": [{"destination", "rows", "due_since"}] (see
        :func:`undelivered_outbox`),
        "unserved_outbox": [{"group", "rows", "destinations", "due_since", "last_seen_at",
        "served_groups"}] (see :func:`reliable_beat.groups.unserved_outbox`),
        "unpublished_triggers": [{"group", "rows", "since", "publishers"}] (live publishers,
        broker not taking them; see :func:`reliable_beat.groups.unpublished_triggers`),
        "entry_counts": {status: number of entries} (every entry, disabled ones too),
        "waiting_retries": {"count", "runs": [...]} (``retrying`` runs that re-sending
        did not move on, see :func:`waiting_retries`),
        "queue_depths": [{"queue" (str | None), "ready" (int | None: messages ready in it;
        None: the broker could not tell), "entries" ([names] of the unstarted entries whose
        triggers go there), "error" (str | None: why the probe failed)}] (empty without a
        probe or an unstarted entry; see :func:`stalled_queue_depths`),
        "expired_leases": {"count", "runs": [...]} (``running`` runs whose lease ended more
        than ``lease_expired_seconds`` ago, see :func:`expired_leases`),
        "problems": [str], "warnings": [str], "ok" (bool)}``. Each entry: ``{"name", "task",
        "origin", "schedule_group", "disabled_at", "status" (active | paused | disabled |
        ended | quarantined | malformed: a value that cannot be read, or a row the claim's
        check fails, before a beat quarantines it), "next_fire_at", "last_fire_at",
        "last_state", "lag_seconds" (float | None), "overdue_seconds" (float | None),
        "missed" (bool), "failing" (retrying runs), "dead" (dead letters not requeued)}``.

    Raises:
        StoreUnavailableError: the database cannot be reached.
    """
    from reliable_beat.identity import store_id

    sid = store_id(store)
    with store.engine.connect() as conn:
        now = store.now(conn)
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
        rows = [decode_labelled(r._mapping, columns, conn.dialect) for r in raw_rows]
        malformed = malformed_entries(conn)
        conflicts = name_conflicts(conn, {r.name: (r.schedule_group, r.origin, r.enabled)
                                          for r in rows})
        failing: dict[str, int] = dict(
            conn.execute(
                select(runs.c.entry_name, func.count())
                .where(runs.c.state == "retrying", runs.c.entry_name.is_not(None))
                .group_by(runs.c.entry_name)
            ).all()
        )
        dead: dict[str, int] = dict(
            conn.execute(
                select(dead_letters.c.entry_name, func.count())
                .where(dead_letters.c.requeued_at.is_(None), dead_letters.c.kind == "run",
                       dead_letters.c.handled_at.is_(None),
                       dead_letters.c.entry_name.is_not(None))
                .group_by(dead_letters.c.entry_name)
            ).all()
        )
        # a failure handled by design (a completed saga's step: handled_at) pages no one
        dead_total, handled_total = conn.execute(
            select(func.count(dead_letters.c.id) - func.count(dead_letters.c.handled_at),
                   func.count(dead_letters.c.handled_at))
            .where(dead_letters.c.requeued_at.is_(None))
        ).one()
        backlog = outbox_backlog(conn, now)
        groups = group_health(conn, now, alive_seconds=beat_alive_seconds)
        unstarted, starts_recorded, between = _unstarted(conn, now, redispatch_seconds)
        last_started = _last_started(conn, [n for n in unstarted if n not in between])
        quarantined_rows = quarantine_counts(conn)
        from reliable_beat.rows import unknown_state_runs

        n_bad_runs, bad_runs = unknown_state_runs(conn)
        undelivered = undelivered_outbox(conn, now, outbox_stuck_minutes)
        unserved = unserved_outbox(conn, now, due_seconds=unserved_seconds,
                                   alive_seconds=beat_alive_seconds)
        unpublished = unpublished_triggers(conn, now, pending_seconds=unserved_seconds,
                                           alive_seconds=beat_alive_seconds)
        n_waiting, waiting_runs = waiting_retries(conn, now,
                                                  redispatch_seconds=redispatch_seconds,
                                                  retry_cap_seconds=retry_cap_seconds)
        waiting_triggers = (_unstarted_triggers(conn, sorted(unstarted))
                            if queue_depths is not None and unstarted else [])
        n_expired, expired_runs = expired_leases(conn, now, grace_seconds=lease_expired_seconds,
                                                 redispatch_seconds=redispatch_seconds)
    # the broker is asked with the store's connection closed (it may be slow or down)
    depths = stalled_queue_depths(queue_depths, waiting_triggers)

    out_entries: list[dict[str, Any]] = []
    missed: list[str] = []
    quarantined: list[dict[str, Any]] = []
    malformed_names = {m["name"] for m in malformed}
    for r in rows:
        status = ("quarantined" if r.quarantine_reason is not None
                  else "malformed" if r.unreadable
                  else "disabled" if not r.enabled else "paused" if r.paused
                  else "active" if r.next_fire_at is not None else "ended")
        if status == "quarantined":
            quarantined.append({"name": r.name, "reason": r.quarantine_reason})
        lag = None
        if r.last_dispatched_at is not None and r.last_fire_at is not None:
            lag = round((r.last_dispatched_at - r.last_fire_at).total_seconds(), 3)
        overdue = None
        is_missed = False
        if status == "active" and r.next_fire_at is not None and r.next_fire_at <= now:
            overdue = round((now - r.next_fire_at).total_seconds(), 3)
            is_missed = missed_slot(r.next_fire_at, r.misfire_grace_seconds, now,
                                    margin_seconds)
        if is_missed:
            missed.append(r.name)
        if r.name in malformed_names and status in ("active", "paused", "ended"):
            status = "malformed"  # readable, but the claim's check quarantines it
        out_entries.append({
            "name": r.name, "task": r.task, "origin": r.origin, "status": status,
            "schedule_group": r.schedule_group, "disabled_at": _utc(r.disabled_at),
            "next_fire_at": r.next_fire_at, "last_fire_at": r.last_fire_at,
            "last_state": r.last_state, "lag_seconds": lag, "overdue_seconds": overdue,
            "missed": is_missed, "failing": int(failing.get(r.name, 0)),
            "dead": int(dead.get(r.name, 0)),
        })
    problems: list[str] = []
    if missed:
        problems.append(
            f"MISSED SLOTS: {len(missed)} enabled entries are overdue by more than their "
            f"misfire_grace + {margin_seconds:.0f} s ({', '.join(missed[:10])}"
            f"{', ...' if len(missed) > 10 else ''}): no beat is claiming entries. Start "
            "`celery -A APP beat` (any number may run) or check the beats' logs."
        )
    if quarantined:
        problems.append(
            f"QUARANTINED: {len(quarantined)} malformed entries are disabled and do not fire "
            f"({', '.join(q['name'] for q in quarantined[:10])}"
            f"{', ...' if len(quarantined) > 10 else ''}): see the reason with `reliable-beat "
            "entries show NAME`, then fix the row (`entries update`, the beat_schedule, or SQL "
            "and `entries resume NAME`)"
        )
    if malformed:
        problems.append(_malformed_problem(malformed))
    for c in conflicts[:MAX_SHOWN]:
        problems.append(
            f"NAME CONFLICT: entry {c['entry']!r} of group {c['group']!r} (beat "
            f"{c['synced_by'] or '?'}) is owned by group {c['owner_group']!r}; rename it in "
            f"one app's beat_schedule (group {c['group']!r}'s beats never fire it: its sync "
            "leaves it to the group that owns it)" if c["owner_enabled"] else
            f"NAME CONFLICT: entry {c['entry']!r} of group {c['group']!r} (beat "
            f"{c['synced_by'] or '?'}) is a config entry of group {c['owner_group']!r}, "
            f"which disabled it: it does not fire for either. Restart a beat of group "
            f"{c['group']!r} or run `reliable-beat -A APP schedule sync` with its app: the "
            "sync adopts it"
        )
    if len(conflicts) > MAX_SHOWN:
        problems.append(f"NAME CONFLICT: ... and {len(conflicts) - MAX_SHOWN} more (`reliable-"
                        "beat status --json` lists every one under name_conflicts)")
    for u in undelivered:
        problems.append(
            f"UNDELIVERED OUTBOX: {u['rows']} pending rows for destination "
            f"{u['destination']!r} have been due for more than {outbox_stuck_minutes:g} min "
            f"(since {_fmt(u['due_since'])}) and no relay claims them: no running relay has a "
            f"handler for {u['destination']!r} (a typo in `outbox.add(..., destination)`?), "
            "no relay runs, or an earlier row of their ordering key is stuck. Fix the name "
            "(`reliable-beat outbox status`) or start a relay with that handler."
        )
    for u in unserved:
        seen = _fmt(u["last_seen_at"]) if u["last_seen_at"] else "never"
        served = ", ".join(repr(g) if g != "*" else "any (a relay without an app)"
                           for g in u["served_groups"]) or "none"
        problems.append(
            f"UNSERVED OUTBOX: group {u['group']!r}: {u['rows']} outbox rows "
            f"({', '.join(u['destinations'])}) due for more than {unserved_seconds:g} s "
            f"(since {_fmt(u['due_since'])}) and no live relay or beat of group "
            f"{u['group']!r} (last seen {seen}); only that group's relays and beats publish "
            f"them (live ones serve groups: {served}). Start `reliable-beat -A <app> relay` "
            f"for it, with the app whose schedule group is {u['group']!r} (the name in "
            "Celery('...') or reliable_beat_schedule_group; an app module run as __main__ "
            "is group 'default')."
        )
    for u in unpublished:
        problems.append(
            f"BROKER NOT TAKING TRIGGERS: group {u['group']!r}: {u['rows']} triggers are "
            f"still pending more than {unserved_seconds:g} s after they were written (oldest "
            f"since {_fmt(u['since'])}) although {u['publishers']} beats / relays of the group "
            "are alive: the Celery broker of that app refuses or hangs (each publish times "
            "out after reliable_beat_publish_timeout_seconds). Their logs name it: `celery "
            "broker URL did not answer within N s` or `N triggers not published (celery "
            "broker unavailable: ...)`. Fix the broker; nothing is lost: the triggers go "
            "out, under the same task ids, once it takes them."
        )
    if dead_total:
        problems.append(
            f"{dead_total} dead letters wait for a person: `reliable-beat dead-letters list "
            "--pending --unhandled`"
        )
    horizon = now - timedelta(minutes=disabled_within_minutes)
    recent = [e["name"] for e in out_entries if e["status"] == "disabled"
              and e["origin"] == "config" and e["disabled_at"] is not None
              and e["disabled_at"] >= horizon]
    if recent:
        problems.append(
            f"RECENTLY DISABLED: {len(recent)} config entries vanished from their group's "
            f"beat_schedule within the last {disabled_within_minutes:g} min and were disabled "
            f"({', '.join(recent[:10])}{', ...' if len(recent) > 10 else ''}). If that was not "
            "meant, deploy the config that has them (`reliable-beat status --all` shows them)."
        )
    for g in groups:
        if g["enabled_entries"] and not g["beats_alive"]:
            seen = _fmt(g["last_seen_at"]) if g["last_seen_at"] else "never"
            problems.append(
                f"NO BEAT: schedule group {g['group']!r} has {g['enabled_entries']} enabled "
                f"config entries but no live beat (last seen {seen}): nothing syncs its "
                "beat_schedule and nothing fires its entries (beats of other groups do not: "
                "they publish into their own app's broker). Start its beat, "
                f"or retire the group: `reliable-beat schedule retire {g['group']}`."
            )
        elif g.get("runtime_entries") and not g["beats_alive"]:
            seen = _fmt(g["last_seen_at"]) if g["last_seen_at"] else "never"
            problems.append(
                f"NO BEAT: schedule group {g['group']!r} has {g['runtime_entries']} enabled "
                f"runtime entries but no live beat (last seen {seen}): nothing fires them "
                "(beats of other groups do not: they publish into their own app's broker). "
                "Start a beat of the app, or move them to a group that has one: "
                "`reliable-beat entries update NAME --group GROUP`."
            )
    if n_bad_runs:
        problems.append(
            f"MALFORMED RUN ROWS: {n_bad_runs} runs have a state the library never writes "
            f"({', '.join(bad_runs)}{', ...' if n_bad_runs > len(bad_runs) else ''}): "
            "changed by SQL; nothing claims, sweeps or counts them. `reliable-beat runs show "
            "KEY` shows each: one with finished_at and a result completed (set state "
            "'succeeded' by SQL); otherwise check the task's effects, then set 'retrying' "
            "(it runs again, its key deduplicates) or 'dead'"
        )
    never = sorted(n for n in unstarted if n not in between and n not in last_started)
    if never:
        problems.append(
            f"NEVER STARTED: the triggers of {len(never)} entries were not started by any "
            f"worker within {redispatch_seconds:g} s, and no trigger of theirs ever started "
            f"({', '.join(never[:10])}{', ...' if len(never) > 10 else ''}): no worker "
            "registers the task (a typo? a removed task?) or none consumes its queue. "
            "`reliable-beat entries describe NAME` shows the task; "
            f"{_worker_advice(framework, registered=True)}.{_depth_note(depths, never)}"
        )
    stalled = sorted(n for n in unstarted if n not in between and n in last_started)
    if stalled:
        waiting = sum(unstarted[n] for n in stalled)
        ran = ", ".join(f"{n} last ran {_fmt(last_started[n])}" for n in stalled[:10])
        problems.append(
            f"STALLED: {waiting} triggers of {len(stalled)} entries that ran before "
            f"({ran}{', ...' if len(stalled) > 10 else ''}) were not started by any worker "
            f"within {redispatch_seconds:g} s: are their workers down or behind (a backlog "
            "in their queue)? (Or the task was renamed or removed since it last ran.) "
            f"{_capital(_worker_advice(framework, registered=False))}; `reliable-beat runs "
            "--entry NAME "
            "--state dispatched` lists the waiting triggers (the re-dispatch sweep re-sends "
            "them; their idempotency keys deduplicate)."
            f"{_depth_note(depths, stalled)}"
        )
    if n_waiting:
        shown = "; ".join(
            f"{w['key']}: " + (
                f"re-sent {w['resends']} times by the re-dispatch sweep, last at "
                f"{_fmt(w['retry_due_at'])}, and no worker took it up"
                if w["why"] == "resent" else
                f"retry due {_fmt(w['retry_due_at'])}"
                + ("" if w["retry_scheduled"] else " (no retry was scheduled: its attempt "
                   "was fenced out, e.g. `lease clear`)")
                + f", the re-dispatch sweep was due to re-send it at {_fmt(w['resend_at'])}"
                " and did not")
            for w in waiting_runs)
        problems.append(
            f"RETRY OVERDUE: {n_waiting} runs wait in `retrying` although their retry was due "
            f"more than {redispatch_seconds:g} s ago and re-sending did not move them on "
            f"({shown}{'; ...' if n_waiting > len(waiting_runs) else ''}). Re-sent and not "
            "taken up: are the workers of its queue down or behind, and does one register "
            "the task? Not re-sent: does a beat or relay of its app (schedule group) run, "
            "and is its queue backlogged? `reliable-beat runs show KEY` shows each."
        )
    if n_expired:
        problems.append(_lease_expired_problem(n_expired, expired_runs, lease_expired_seconds,
                                               now))
    gaps = sorted(between)
    if gaps:
        problems.append(
            f"UNSTARTED BETWEEN STARTED: {sum(unstarted[n] for n in gaps)} triggers of "
            f"{len(gaps)} entries ({', '.join(gaps[:10])}{', ...' if len(gaps) > 10 else ''}) "
            f"have no recorded start within {redispatch_seconds:g} s although later triggers "
            "of the same entries did start (their workers know the task): either they were "
            "lost (e.g. consumed by another app's worker as an unregistered task: check the "
            "entries' schedule groups), or a worker ran them but could not record the start "
            "(its log: WARNING 'could not record the start', e.g. the database was down "
            "then; it writes the start when the database answers again, unless it stopped "
            "first). `reliable-beat runs --entry NAME --state dispatched` lists them."
        )
    unregistered: dict[str, str] = {}
    for g in groups:
        unregistered.update(g["unregistered"])
    warnings: list[str] = []
    if not starts_recorded:
        warnings.append(
            "no worker has recorded starting a trigger in the last "
            f"{UNSTARTED_WINDOW_HOURS:g} h: either no worker runs, or workers run plain tasks "
            "without `reliable_beat.celery.acks` in their imports (then triggers that no "
            "worker knows cannot be told from done ones)"
        )
    for g in groups:
        if g["beats_on_other_config"]:
            warnings.append(
                f"schedule group {g['group']!r}: {g['beats_on_other_config']} of "
                f"{g['beats_alive']} live beats started with a beat_schedule other than the "
                "group's current one (old pods of a deploy in progress, or a config the beat "
                "refused: see its log; `reliable-beat schedule list`)"
            )
    if unregistered:
        warnings.append(
            f"UNREGISTERED TASKS: {len(unregistered)} config entries name a task their "
            "group's beat does not register: "
            + ", ".join(f"{k} -> {v}" for k, v in sorted(unregistered.items())[:10])
        )
    from reliable_beat.workflows.engine import workflow_health

    wf_health = workflow_health(
        store, grace=timedelta(seconds=redispatch_seconds),
        pending_after=timedelta(seconds=workflow_pending_alarm_seconds),
        max_takeovers=workflow_max_takeovers)
    problems.extend(wf_health.pop("problems"))
    return {
        "workflows": wf_health,
        "store": store.safe_url,
        "store_id": sid,
        "now": now,
        "entries": out_entries,
        "entry_counts": _count_by_status(out_entries),
        "missed": missed,
        "outbox": backlog,
        "dead_letters": int(dead_total),
        "dead_letters_handled": int(handled_total or 0),
        "groups": groups,
        "unstarted": unstarted,
        "unstarted_between": sorted(between),
        "unstarted_stalled": stalled,
        "last_started_at": last_started,
        "recently_disabled": recent,
        "unregistered": unregistered,
        "quarantined": quarantined,
        "malformed_entries": malformed,
        "name_conflicts": conflicts,
        "quarantined_rows": quarantined_rows,
        "malformed_run_states": {"count": n_bad_runs, "keys": bad_runs},
        "undelivered_outbox": undelivered,
        "unserved_outbox": unserved,
        "unpublished_triggers": unpublished,
        "waiting_retries": {"count": n_waiting, "runs": waiting_runs},
        "queue_depths": depths,
        "expired_leases": {"count": n_expired, "runs": expired_runs},
        "problems": problems,
        "warnings": warnings,
        "ok": not problems,
    }


#: ``status`` asks the broker about the queues of at most this many unstarted entries.
MAX_DEPTH_ENTRIES = 50


def _unstarted_triggers(conn: Connection, names: list[str]
                        ) -> list[tuple[str, OutboxMessage]]:
    """``[(entry, its newest unstarted trigger's outbox row)]`` for (at most
    :data:`MAX_DEPTH_ENTRIES` of) ``names``: the trigger of each entry's latest
    ``dispatched`` run without ``started_at`` (one query). Entries without such a row (the
    trigger row was purged) are left out."""

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
    keys = {str(key): str(entry) for entry, key in conn.execute(
        select(latest.c.entry_name, runs.c.idempotency_key)
        .select_from(latest.join(runs, runs.c.id == latest.c.run_id)))}
    if not keys:
        return []
    by_message = {trigger_message_id(k): e for k, e in keys.items()}
    rows = conn.execute(select(outbox).where(outbox.c.message_id.in_(sorted(by_message))))
    found = []
    for row in rows:
        try:
            found.append((by_message[row.message_id], OutboxMessage.from_row(row)))
        except Exception:  # a malformed row: no depth for it (status reports rows elsewhere)
            continue
    return sorted(found, key=lambda t: t[0])


def stalled_queue_depths(probe: QueueDepthFn | None,
                         triggers: list[tuple[str, OutboxMessage]]) -> list[dict[str, Any]]:
    """Ask the broker (``probe``) how many messages wait ready in the queues the unstarted
    entries' triggers went to: a deep queue says the workers are behind or stopped (a
    backlog), an empty one that a worker holds the messages unacknowledged or the broker
    lost them. Never raises: a failing probe is one dict with ``error`` set.

    Args:
        probe: the adapter's :data:`~reliable_beat.redispatch.QueueDepthFn`; None: no depths.
        triggers: ``[(entry, trigger outbox row)]`` (see :func:`collect_status`).

    Returns:
        ``[{"queue", "ready", "entries", "error"}]`` sorted by queue (see
        :func:`collect_status`); empty without a probe or triggers.
    """
    if probe is None or not triggers:
        return []
    try:
        seen = list(probe([m for _, m in triggers]))
        if len(seen) != len(triggers):
            raise ValueError(f"{len(seen)} depths for {len(triggers)} messages")
    except Exception as exc:  # the broker could not be asked: said, not fatal
        return [{"queue": None, "ready": None, "entries": sorted({e for e, _ in triggers}),
                 "error": f"{type(exc).__name__}: {exc}"}]
    out: dict[str, dict[str, Any]] = {}
    for (entry, _), (queue, ready) in zip(triggers, seen, strict=True):
        q = out.setdefault(str(queue), {"queue": str(queue), "ready": ready, "entries": [],
                                        "error": None})
        q["entries"].append(entry)
    return [out[k] for k in sorted(out)]


def _depth_note(depths: list[dict[str, Any]], names: list[str]) -> str:
    """`` Queue Q holds N ready messages (...)`` for the queues of ``names``, or ''."""
    wanted = set(names)
    notes = []
    for d in depths:
        if not wanted.intersection(d["entries"]):
            continue
        if d["error"] is not None:
            notes.append(f"the broker could not tell its queue depths ({d['error']})")
        elif d["ready"] is None:
            notes.append(f"the broker cannot tell how deep queue {d['queue']} is")
        elif d["ready"] > 0:
            notes.append(f"queue {d['queue']} holds {d['ready']:,} ready messages (a "
                         "backlog: its workers are behind or stopped)")
        else:
            notes.append(f"queue {d['queue']} holds 0 ready messages (not a backlog: a "
                         "worker holds them unacknowledged, or the broker lost them)")
    return (" " + _capital("; ".join(notes)) + ".") if notes else ""


def _count_by_status(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in rows:
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    return dict(sorted(counts.items()))


def _unstarted(
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
        (name, (int(n), _utc(latest))) for name, n, latest in conn.execute(
            select(runs.c.entry_name, func.count(), func.max(runs.c.dispatched_at))
            .where(recent, runs.c.state == "dispatched", runs.c.started_at.is_(None),
                   or_(runs.c.dispatched_at <= hi, runs.c.redispatches > 0))
            .group_by(runs.c.entry_name)
        ).all()
    )
    if not pending:
        return {}, True, set()
    started = {
        name: (_utc(first), _utc(last)) for name, first, last in conn.execute(
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


def _bounded_entries(info: dict[str, Any], limit: int | None
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(shown, rest)``: at most ``limit`` entries (None: all), those needing attention
    (missed, never started, failing, dead, quarantined, malformed, recently disabled)
    first, each part in name order. Linear in the number of entries."""
    rows = info["entries"]
    if limit is None or len(rows) <= limit:
        return rows, []
    unstarted = info["unstarted"]
    recent = set(info["recently_disabled"])

    def urgent(e: dict[str, Any]) -> bool:
        return bool(e["missed"] or e["failing"] or e["dead"] or e["name"] in unstarted
                    or e["status"] in ("quarantined", "malformed") or e["name"] in recent)

    first = [e for e in rows if urgent(e)]
    ordered = first + [e for e in rows if not urgent(e)]
    return ordered[:limit], ordered[limit:]
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
        row (an ad-hoc call, a workflow activity): the sweep does not re-send it)}``.
    """
    from reliable_beat.redispatch import backoff_wait

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
        key, entry, holder, ended, resends = r.key, r.entry, r.leased_by, _utc(r.ended), r.resends
        if ended is None:
            continue
        wait = backoff_wait(timedelta(seconds=redispatch_seconds),
                            resends if isinstance(resends, int) else 0)
        shown.append({
            "key": key, "entry": entry, "leased_by": holder, "lease_expires_at": ended,
            "expired_seconds": round((now - ended).total_seconds(), 3),
            "resend_at": ended + wait if trigger_message_id(str(key)) in found else None,
        })
    return total, shown


def _lease_expired_problem(count: int, shown: list[dict[str, Any]], grace_seconds: float,
                           now: datetime) -> str:
    """The LEASE EXPIRED line (bounded: the keys of the longest expired, then ``...``)."""
    keys = "; ".join(
        f"{r['key']} (held by {r['leased_by'] or '?'}, expired "
        f"{r['expired_seconds']:.0f} s ago, "
        + ("no trigger row: the sweep does not re-send it" if r["resend_at"] is None
           else f"the sweep re-sends it at about {_fmt(r['resend_at'])}"
           if r["resend_at"] > now
           else f"the sweep was due to re-send it at {_fmt(r['resend_at'])}: does any beat "
           "or relay of its group run?")
        + ")"
        for r in shown)
    return (
        f"LEASE EXPIRED: {count} running runs whose lease expired more than "
        f"{grace_seconds:g} s ago ({keys}{'; ...' if count > len(shown) else ''}): their "
        "workers stopped (killed or frozen) and no redelivery took them over. The re-dispatch "
        "sweep re-sends them at the times given, or run `reliable-beat lease clear KEY` to "
        "fence the holder out and re-send the run now (stop a frozen worker too)."
    )


def _last_started(conn: Connection, names: list[str]) -> dict[str, datetime]:
    """``{entry: its latest recorded trigger start, at any time}`` for those of ``names``
    that ever started one (the others never ran: NEVER STARTED)."""
    if not names:
        return {}
    rows = conn.execute(
        select(runs.c.entry_name, func.max(runs.c.started_at))
        .where(runs.c.entry_name.in_(names), runs.c.started_at.is_not(None))
        .group_by(runs.c.entry_name)
    ).all()
    return {name: at for name, last in rows if (at := _utc(last)) is not None}


def framework_name(app: Any) -> str | None:
    """The top-level package of ``app``'s class (``"celery"``, ``"dramatiq"`` ...), by its
    type's MRO; None when there is no app (no ``-A``)."""
    if app is None:
        return None
    for cls in type(app).__mro__:
        top = (getattr(cls, "__module__", "") or "").partition(".")[0]
        if top and top != "builtins":
            return top
    return None


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _worker_advice(framework: str | None, *, registered: bool) -> str:
    """Where to look at the workers, in the app's framework's terms."""
    if framework == "celery":
        return ("`celery -A APP inspect registered` shows what workers know" if registered
                else "`celery -A APP inspect active_queues` shows which workers consume "
                "which queues, `celery -A APP inspect active` what they run now")
    if framework == "dramatiq":
        return ("check that a `dramatiq` worker process runs with the module that declares "
                "the actor, on the actor's queue" if registered
                else "check that the `dramatiq` worker processes run and consume the actor's "
                "queue (its depth in the broker tells behind from down)")
    return ("check that a worker of the app runs with the module that declares the task"
            if registered else "check that the app's workers run and consume the task's "
            "queue (its depth in the broker tells behind from down)")


def _app_probe(app: Any) -> QueueDepthFn | None:
    """The app's broker probe for ``status`` (its adapter's optional ``queue_depths``
    hook), or None: no app, or an adapter without one."""
    if app is None:
        return None
    from reliable_beat.adapters import adapter_for

    hook = getattr(adapter_for(app), "queue_depths", None)
    if hook is None:
        return None

    def probe(messages: list[OutboxMessage]) -> list[tuple[str, int | None]]:
        assert hook is not None
        return list(hook(app, messages))

    return probe


def _depth_text(d: dict[str, Any]) -> str:
    """One queue of ``status``'s ``queues:`` line."""
    names = ", ".join(d["entries"][:5]) + (", ..." if len(d["entries"]) > 5 else "")
    if d["error"] is not None:
        return f"depth unknown ({d['error']}) for {names}"
    ready = "unknown" if d["ready"] is None else f"{d['ready']:,} ready"
    return f"{d['queue']}: {ready} (waiting triggers of {names})"


def _fmt(at: datetime | None) -> str:
    if infinity_text(at) is not None:  # PostgreSQL 'infinity' (a malformed row)
        return str(infinity_text(at))
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if at else "-"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--check", is_flag=True,
              help="Exit 1 when something needs a person (missed slots, dead letters, "
                   "undelivered outbox rows, a group's rows no live relay or beat serves, "
                   "malformed entries, entry names owned by another group, blocked "
                   "workflows, workflow advances that keep expiring, workflows pending "
                   "too long).")
@click.option("--margin", type=click.FloatRange(min=0), default=DEFAULT_MARGIN_SECONDS,
              show_default=True,
              help="Seconds beyond an entry's misfire_grace before an overdue slot is 'missed'.")
@click.option("--disabled-within", type=click.FloatRange(min=0),
              default=DEFAULT_DISABLED_WITHIN_MINUTES, show_default=True,
              help="Minutes: config entries disabled by a sync this recently are an alarm.")
@click.option("--outbox-stuck", type=click.FloatRange(min=0),
              default=DEFAULT_OUTBOX_STUCK_MINUTES, show_default=True,
              help="Minutes: pending outbox rows due this long and claimed by no relay are an "
                   "alarm (per destination).")
@click.option("--unserved-after", type=click.FloatRange(min=0),
              default=DEFAULT_UNSERVED_SECONDS, show_default=True,
              help="Seconds: a schedule group's pending outbox rows due this long while no "
                   "live relay or beat of the group runs are an alarm.")
@click.option("--all", "show_all", is_flag=True,
              help="Include disabled entries, and list every entry in the text output (not "
                   f"only the first {DEFAULT_ENTRY_ROWS} and a summary).")
@click.option("--rows", "max_rows", type=click.IntRange(min=0), default=DEFAULT_ENTRY_ROWS,
              show_default=True,
              help="Text output: list at most this many entries (those needing attention "
                   "first), then a count of the rest by status. --all lifts the bound.")
@pass_cli
def status(cli: CliContext, as_json: bool, check: bool, margin: float, show_all: bool,
           disabled_within: float, outbox_stuck: float, unserved_after: float,
           max_rows: int) -> None:
    """Entries (next fire, last slot, state, lag, failing/dead), outbox backlog, alarms.

    The text output lists at most ``--rows`` entries, those needing attention first
    (missed, never started, failing, dead, quarantined, malformed, recently disabled), then
    a count of the others by status; ``--all`` lists every one. ``--json`` always carries
    every entry (and ``entry_counts``: entries per status)."""
    try:
        info = collect_status(cli.store, margin_seconds=margin,
                              disabled_within_minutes=disabled_within,
                              redispatch_seconds=cli.settings.redispatch_seconds,
                              outbox_stuck_minutes=outbox_stuck,
                              unserved_seconds=unserved_after,
                              framework=framework_name(cli.app),
                              retry_cap_seconds=cli.settings.retry_cap_seconds,
                              queue_depths=_app_probe(cli.app),
                              workflow_pending_alarm_seconds=(
                                  cli.settings.workflow_pending_alarm_seconds),
                              workflow_max_takeovers=cli.settings.workflow_max_takeovers)
    except StoreUnavailableError as exc:
        fail(str(exc), 1, kind="store_unavailable")
    info["store_from"] = cli.settings.database_url_origin  # e.g. Django DATABASES['default']
    if not show_all:
        # Disabled config entries stay visible: a vanished entry is news.
        info["entries"] = [e for e in info["entries"]
                           if e["status"] != "disabled" or e["origin"] == "config"]
    if as_json:
        cli.echo_json(jsonable(info))
    else:
        click.echo(f"store {info['store']} (from {info['store_from']}; id "
                   f"{info['store_id'] or '-'})  now "
                   f"{_fmt(info['now'])} (store clock, UTC)")
        for problem in info["problems"]:
            click.secho(f"!! {problem}", fg="red", bold=True)
        for warning in info["warnings"]:
            click.secho(f"!  {warning}", fg="yellow")
        shown, rest = _bounded_entries(info, None if show_all else max_rows)
        header = ("ENTRY", "GROUP", "STATUS", "NEXT", "LAST SLOT", "STATE", "LAG", "FAILING",
                  "DEAD")
        table = [header] + [
            (e["name"] + (" (MISSED)" if e["missed"] else "")
             + ((" (UNSTARTED)" if e["name"] in info["unstarted_between"]
                 else " (STALLED)" if e["name"] in info["unstarted_stalled"]
                 else " (NEVER STARTED)") if e["name"] in info["unstarted"] else ""),
             e["schedule_group"] or "-",
             e["status"] + (f" {_fmt(e['disabled_at'])}" if e["disabled_at"] else ""),
             _fmt(e["next_fire_at"]), _fmt(e["last_fire_at"]), e["last_state"] or "-",
             _secs(e["lag_seconds"]), str(e["failing"]), str(e["dead"]))
            for e in shown
        ]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        for line in table:
            click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
        counts = ", ".join(f"{n} {k}" for k, n in sorted(info["entry_counts"].items()))
        if rest:
            by_status: dict[str, int] = {}
            for e in rest:
                by_status[e["status"]] = by_status.get(e["status"], 0) + 1
            click.echo(f"... and {len(rest)} more entries ("
                       + ", ".join(f"{n} {k}" for k, n in sorted(by_status.items()))
                       + "): `reliable-beat status --all` lists every one, "
                       "`reliable-beat status --json` gives them all as data")
        click.echo(f"entries: {len(shown)} shown of {sum(info['entry_counts'].values())}"
                   f" ({counts or 'none'})")
        if info["outbox"]:
            click.echo("\noutbox:")
            for o in info["outbox"]:
                # every pending row is counted once: backlog (due, or waiting for its
                # retry), scheduled (not yet due), or claimed (in a relay's hands, or held
                # by a beat for its slot: claimed ahead)
                backlog, scheduled = o.get("backlog", 0), o.get("scheduled", 0)
                claimed = max(0, o["pending"] - backlog - scheduled)
                click.echo(f"  {o['destination']}: {o['pending']} pending = {backlog} backlog "
                           f"({o['due']} due, oldest "
                           f"{_secs(o['oldest_pending_age_seconds'])}) + {scheduled} scheduled "
                           f"(not yet due) + {claimed} claimed (being published, or held for "
                           f"their slot); {o['dead']} dead")
        else:
            click.echo("\noutbox: empty")
        handled = info["dead_letters_handled"]
        click.echo(f"dead letters: {info['dead_letters']}"
                   + (f" (+ {handled} handled by design, no alarm: `reliable-beat "
                      "dead-letters list --handled`)" if handled else ""))
        wf_counts = info["workflows"]["counts"]
        if wf_counts:
            click.echo("workflows: " + ", ".join(f"{n} {k}" for k, n in sorted(
                wf_counts.items())))
        if info["queue_depths"]:
            click.echo("queues: " + "; ".join(_depth_text(d) for d in info["queue_depths"]))
        for g in info["groups"]:
            published = (f" (publishing to {', '.join(g['beat_destinations'])})"
                         if g.get("beat_destinations") else "")
            click.echo(f"schedule group {g['group']}: {g['beats_alive']} live beats"
                       f"{published}, {g.get('relays_alive', 0)} live relays, "
                       f"{g['enabled_entries']} enabled config entries, config synced "
                       f"{_fmt(g['config_synced_at'])}, last beat seen {_fmt(g['last_seen_at'])}")
    if check and not info["ok"]:
        raise SystemExit(1)


def register(group: click.Group) -> None:
    """Add ``status`` to the ``reliable-beat`` group."""
    group.add_command(status)
