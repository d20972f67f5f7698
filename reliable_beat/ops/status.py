"""The status of a store: what an operator needs at 02:00 (``reliable-beat status``, the
dashboard's alarms, in one collection: :func:`collect_status`).

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
quarantine it then, losing that slot). **NEXT FIRE INCONSISTENT**: an active entry whose
``next_fire_at`` its schedule cannot have put there (NULL while it has a next slot, or far
beyond its next slot: :mod:`reliable_beat.rows.next_fire`); no beat would claim it.
**NAME CONFLICT**: an entry of a group's current
beat_schedule that is an enabled config entry of another group (its sync left it alone: it
never fires for this group). **WORKFLOW ADVANCES EXPIRING** / **WORKFLOWS NOT STARTED**:
workflows whose advance's lease keeps expiring, and workflows ``pending`` past
``reliable_beat_workflow_pending_alarm_seconds`` (:mod:`reliable_beat.workflows.runaway`).

All instants are UTC and measured on the store's clock; the store URL is shown with its
password hidden. The reads are :mod:`reliable_beat.ops.reads`, the verdicts (problems and
warnings) :mod:`reliable_beat.ops.checks`; :mod:`reliable_beat.cli.status` renders them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from reliable_beat.adapters import adapter_for
from reliable_beat.db.dialects import Store
from reliable_beat.groups import group_health, unpublished_triggers, unserved_outbox
from reliable_beat.identity import store_id
from reliable_beat.ops import checks, reads
from reliable_beat.ops.reads import as_utc
from reliable_beat.outbox import OutboxMessage
from reliable_beat.policies import MISSED_MARGIN_SECONDS
from reliable_beat.policies import is_missed as missed_slot
from reliable_beat.rows import inconsistent_next_fire, quarantine_counts, unknown_state_runs
from reliable_beat.workflows.engine import workflow_health

if TYPE_CHECKING:
    from reliable_beat.redispatch import QueueDepthFn

__all__ = [
    "BEAT_ALIVE_SECONDS",
    "DEFAULT_DISABLED_WITHIN_MINUTES",
    "DEFAULT_LEASE_EXPIRED_SECONDS",
    "DEFAULT_MARGIN_SECONDS",
    "DEFAULT_OUTBOX_STUCK_MINUTES",
    "DEFAULT_UNSERVED_SECONDS",
    "collect_status",
    "framework_name",
    "queue_depth_probe",
    "stalled_queue_depths",
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
#: LEASE EXPIRED: a ``running`` run whose lease ended more than this many seconds ago. A live
#: holder renews every lease / 3, so its lease never ends; one that ended this long ago
#: belongs to a worker that stopped (died, frozen), not to one in the middle of a renewal.
DEFAULT_LEASE_EXPIRED_SECONDS = 30.0


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
            relay are an alarm, per destination (see
            :func:`~reliable_beat.ops.reads.undelivered_outbox`).
        unserved_seconds: pending rows of a schedule group due this many seconds while no
            live relay or beat of that group runs are an alarm, per group (see
            :func:`reliable_beat.groups.unserved_outbox`; liveness: ``beat_alive_seconds``).
        framework: the app's framework (``"celery"``, ``"dramatiq"``, ...; see
            :func:`framework_name`), for advice in its terms; None: neutral advice.
        retry_cap_seconds: ``reliable_beat_retry_cap_seconds``: with ``redispatch_seconds``
            it says when the re-dispatch sweep re-sends a ``retrying`` run (see
            :func:`~reliable_beat.ops.reads.waiting_retries`).
        queue_depths: the app's broker probe (its adapter's ``queue_depths``,
            :data:`reliable_beat.redispatch.QueueDepthFn`), asked after the store's
            connection is closed about the queues of the newest unstarted trigger of each
            STALLED / NEVER STARTED / UNSTARTED entry (see :func:`stalled_queue_depths`);
            None (no ``-A``, or an adapter without one): no depths.
        lease_expired_seconds: a ``running`` run whose lease ended this long ago is an alarm
            (LEASE EXPIRED, see :func:`~reliable_beat.ops.reads.expired_leases`).
        workflow_pending_alarm_seconds: a workflow ``pending`` this long is an alarm
            (WORKFLOWS NOT STARTED); workflow_max_takeovers: named in the advice of WORKFLOW
            ADVANCES EXPIRING (see :mod:`reliable_beat.workflows.runaway`).

    Returns:
        ``{"store" (URL, password hidden), "store_id" (str | None: the id triggers carry,
        see :mod:`reliable_beat.identity`), "now" (UTC), "entries": [...], "missed": [names],
        "outbox": [...] (see :func:`~reliable_beat.ops.reads.outbox_backlog`),
        "dead_letters" (int, not requeued nor handled), "dead_letters_handled" (int:
        failures handled by design, e.g. a saga's compensated step; listed by
        ``dead-letters list --handled``, no alarm),
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
        entries a beat's claim would quarantine when due, see
        :func:`~reliable_beat.ops.reads.malformed_entries`: MALFORMED ENTRY),
        "inconsistent_next_fire": [{"name", "id", "origin", "schedule_group",
        "next_fire_at", "problem", "fix"}] (active entries whose ``next_fire_at`` their
        schedule cannot have put there: NULL while it has a next slot, or far beyond it,
        see :func:`reliable_beat.rows.inconsistent_next_fire`: NEXT FIRE INCONSISTENT; their
        status is ``malformed``),
        "name_conflicts": [{"entry", "group", "owner_group", "synced_by", "owner_enabled"}]
        (see :func:`~reliable_beat.ops.reads.name_conflicts`: NAME CONFLICT),
        "quarantined_rows": {"entries", "outbox", "runs"} (see
        :func:`~reliable_beat.rows.quarantine_counts`),
        "malformed_run_states": {"count", "keys"} (runs whose state is none the library
        writes, :func:`reliable_beat.rows.unknown_state_runs`),
        "undelivered_outbox": [{"destination", "rows", "due_since"}] (see
        :func:`~reliable_beat.ops.reads.undelivered_outbox`),
        "unserved_outbox": [{"group", "rows", "destinations", "due_since", "last_seen_at",
        "served_groups"}] (see :func:`reliable_beat.groups.unserved_outbox`),
        "unpublished_slots": {"count", "oldest_key", "oldest_fire_at"} (due slots committed
        and never published: :func:`reliable_beat.ops.reads.unpublished_slots`),
        "unpublished_triggers": [{"group", "rows", "since", "publishers"}] (live publishers,
        broker not taking them; see :func:`reliable_beat.groups.unpublished_triggers`),
        "entry_counts": {status: number of entries} (every entry, disabled ones too),
        "waiting_retries": {"count", "runs": [...]} (``retrying`` runs that re-sending
        did not move on, see :func:`~reliable_beat.ops.reads.waiting_retries`),
        "queue_depths": [{"queue" (str | None), "ready" (int | None: messages ready in it;
        None: the broker could not tell), "entries" ([names] of the unstarted entries whose
        triggers go there), "error" (str | None: why the probe failed)}] (empty without a
        probe or an unstarted entry; see :func:`stalled_queue_depths`),
        "expired_leases": {"count", "runs": [...]} (``running`` runs whose lease ended more
        than ``lease_expired_seconds`` ago, see :func:`~reliable_beat.ops.reads.expired_leases`),
        "problems": [str], "warnings": [str], "ok" (bool)}``. Each entry: ``{"name", "task",
        "origin", "schedule_group", "disabled_at", "status" (active | paused | disabled |
        ended | quarantined | malformed: a value that cannot be read, or a row the claim's
        check fails, before a beat quarantines it), "next_fire_at", "last_fire_at",
        "last_state", "lag_seconds" (float | None), "overdue_seconds" (float | None),
        "missed" (bool), "failing" (retrying runs), "dead" (dead letters not requeued)}``.

    Raises:
        StoreUnavailableError: the database cannot be reached.
    """

    sid = store_id(store)
    found = _read(store, beat_alive_seconds=beat_alive_seconds,
                  redispatch_seconds=redispatch_seconds,
                  outbox_stuck_minutes=outbox_stuck_minutes, unserved_seconds=unserved_seconds,
                  retry_cap_seconds=retry_cap_seconds,
                  lease_expired_seconds=lease_expired_seconds,
                  probe_queues=queue_depths is not None)
    # the broker is asked with the store's connection closed (it may be slow or down)
    depths = stalled_queue_depths(queue_depths, found.waiting_triggers)
    now = found.now
    out_entries, missed, quarantined = _entry_statuses(
        found.rows, found.malformed + found.next_fire, now, margin_seconds, found.failing,
        found.dead)
    unstarted, between, last_started = found.unstarted, found.between, found.last_started
    info: dict[str, Any] = {
        "store": store.safe_url,
        "store_id": sid,
        "now": now,
        "entries": out_entries,
        "entry_counts": _count_by_status(out_entries),
        "missed": missed,
        "outbox": found.backlog,
        "dead_letters": int(found.dead_total),
        "dead_letters_handled": int(found.handled_total or 0),
        "groups": found.groups,
        "unstarted": unstarted,
        "unstarted_between": sorted(between),
        "unstarted_stalled": sorted(n for n in unstarted
                                    if n not in between and n in last_started),
        "last_started_at": last_started,
        "recently_disabled": _recently_disabled(out_entries, now, disabled_within_minutes),
        "unregistered": _unregistered(found.groups),
        "quarantined": quarantined,
        "malformed_entries": found.malformed,
        "inconsistent_next_fire": found.next_fire,
        "name_conflicts": found.conflicts,
        "quarantined_rows": found.quarantined_rows,
        "malformed_run_states": {"count": found.n_bad_runs, "keys": found.bad_runs},
        "undelivered_outbox": found.undelivered,
        "unserved_outbox": found.unserved,
        "unpublished_triggers": found.unpublished,
        "waiting_retries": {"count": found.n_waiting, "runs": found.waiting_runs},
        "queue_depths": depths,
        "expired_leases": {"count": found.n_expired, "runs": found.expired_runs},
        "unpublished_slots": found.unpublished_slots,
    }
    problems = checks.problems_of(
        info, margin_seconds=margin_seconds, outbox_stuck_minutes=outbox_stuck_minutes,
        unserved_seconds=unserved_seconds, disabled_within_minutes=disabled_within_minutes,
        redispatch_seconds=redispatch_seconds, lease_expired_seconds=lease_expired_seconds,
        framework=framework)
    warnings = checks.warnings_of(info, starts_recorded=found.starts_recorded)
    wf_health = workflow_health(
        store, grace=timedelta(seconds=redispatch_seconds),
        pending_after=timedelta(seconds=workflow_pending_alarm_seconds),
        max_takeovers=workflow_max_takeovers)
    problems.extend(wf_health.pop("problems"))
    return {"workflows": wf_health, **info, "problems": problems, "warnings": warnings,
            "ok": not problems}


@dataclass
class _Found:
    """What :func:`_read` found on its one connection (see :mod:`reliable_beat.ops.reads`)."""

    now: datetime
    rows: list[Any]
    malformed: list[dict[str, Any]]
    next_fire: list[dict[str, Any]]
    conflicts: list[dict[str, Any]]
    failing: dict[str, int]
    dead: dict[str, int]
    dead_total: Any
    handled_total: Any
    backlog: list[dict[str, Any]]
    groups: list[dict[str, Any]]
    unstarted: dict[str, int]
    starts_recorded: bool
    between: set[str]
    last_started: dict[str, datetime]
    quarantined_rows: dict[str, int]
    n_bad_runs: int
    bad_runs: list[str]
    undelivered: list[dict[str, Any]]
    unserved: list[dict[str, Any]]
    unpublished: list[dict[str, Any]]
    n_waiting: int
    waiting_runs: list[dict[str, Any]]
    waiting_triggers: list[tuple[str, OutboxMessage]]
    n_expired: int
    expired_runs: list[dict[str, Any]]
    unpublished_slots: dict[str, Any]


def _read(store: Store, *, beat_alive_seconds: float, redispatch_seconds: float,
          outbox_stuck_minutes: float, unserved_seconds: float, retry_cap_seconds: float,
          lease_expired_seconds: float, probe_queues: bool) -> _Found:
    """Every read of the status, in a few queries on one connection (the arguments: see
    :func:`collect_status`; ``probe_queues``: read the unstarted entries' newest triggers for
    the broker probe)."""
    with store.engine.connect() as conn:
        now = store.now(conn)
        rows = reads.read_entries(conn)
        malformed = reads.malformed_entries(conn)
        next_fire = inconsistent_next_fire(conn, now)
        conflicts = reads.name_conflicts(conn, {r.name: (r.schedule_group, r.origin, r.enabled)
                                                for r in rows})
        failing = reads.failing_by_entry(conn)
        dead = reads.dead_letters_by_entry(conn)
        dead_total, handled_total = reads.dead_letter_totals(conn)
        backlog = reads.outbox_backlog(conn, now)
        groups = group_health(conn, now, alive_seconds=beat_alive_seconds)
        unstarted, starts_recorded, between = reads.unstarted(conn, now, redispatch_seconds)
        last_started = reads.last_started(conn, [n for n in unstarted if n not in between])
        quarantined_rows = quarantine_counts(conn)
        n_bad_runs, bad_runs = unknown_state_runs(conn)
        undelivered = reads.undelivered_outbox(conn, now, outbox_stuck_minutes)
        unserved = unserved_outbox(conn, now, due_seconds=unserved_seconds,
                                   alive_seconds=beat_alive_seconds)
        unpublished = unpublished_triggers(conn, now, pending_seconds=unserved_seconds,
                                           alive_seconds=beat_alive_seconds)
        n_waiting, waiting_runs = reads.waiting_retries(conn, now,
                                                        redispatch_seconds=redispatch_seconds,
                                                        retry_cap_seconds=retry_cap_seconds)
        waiting_triggers = (reads.unstarted_triggers(conn, sorted(unstarted))
                            if probe_queues and unstarted else [])
        n_expired, expired_runs = reads.expired_leases(
            conn, now, grace_seconds=lease_expired_seconds,
            redispatch_seconds=redispatch_seconds)
        slots = reads.unpublished_slots(conn, now)
    return _Found(
        now=now, rows=rows, malformed=malformed, next_fire=next_fire, conflicts=conflicts,
        failing=failing, dead=dead, dead_total=dead_total, handled_total=handled_total,
        backlog=backlog,
        groups=groups, unstarted=unstarted, starts_recorded=starts_recorded, between=between,
        last_started=last_started, quarantined_rows=quarantined_rows, n_bad_runs=n_bad_runs,
        bad_runs=bad_runs, undelivered=undelivered, unserved=unserved,
        unpublished=unpublished, n_waiting=n_waiting, waiting_runs=waiting_runs,
        waiting_triggers=waiting_triggers, n_expired=n_expired, expired_runs=expired_runs,
        unpublished_slots=slots)


def _entry_statuses(rows: list[Any], malformed: list[dict[str, Any]], now: datetime,
                    margin_seconds: float, failing: dict[str, int], dead: dict[str, int],
                    ) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]]]:
    """``(entries, missed names, quarantined)``: each entry's row of the status (see
    :func:`collect_status`), with its status, lag and missed check."""
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
            "schedule_group": r.schedule_group, "disabled_at": as_utc(r.disabled_at),
            "next_fire_at": r.next_fire_at, "last_fire_at": r.last_fire_at,
            "last_state": r.last_state, "lag_seconds": lag, "overdue_seconds": overdue,
            "missed": is_missed, "failing": int(failing.get(r.name, 0)),
            "dead": int(dead.get(r.name, 0)),
        })
    return out_entries, missed, quarantined


def _recently_disabled(out_entries: list[dict[str, Any]], now: datetime,
                       disabled_within_minutes: float) -> list[str]:
    """Config entries a sync disabled within the last ``disabled_within_minutes``."""
    horizon = now - timedelta(minutes=disabled_within_minutes)
    recent = [e["name"] for e in out_entries if e["status"] == "disabled"
              and e["origin"] == "config" and e["disabled_at"] is not None
              and e["disabled_at"] >= horizon]
    return recent


def _unregistered(groups: list[dict[str, Any]]) -> dict[str, str]:
    """``{config entry: task}`` of the tasks their group's beat does not register."""
    unregistered: dict[str, str] = {}
    for g in groups:
        unregistered.update(g["unregistered"])
    return unregistered


def _count_by_status(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in rows:
        counts[e["status"]] = counts.get(e["status"], 0) + 1
    return dict(sorted(counts.items()))


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


def queue_depth_probe(app: Any) -> QueueDepthFn | None:
    """The app's broker probe for ``status`` (its adapter's optional ``queue_depths``
    hook), or None: no app, or an adapter without one."""
    if app is None:
        return None
    hook = getattr(adapter_for(app), "queue_depths", None)
    if hook is None:
        return None

    def probe(messages: list[OutboxMessage]) -> list[tuple[str, int | None]]:
        assert hook is not None
        return list(hook(app, messages))

    return probe
