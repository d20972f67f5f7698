"""Schedule groups: which beats own which config entries, config versions, beat heartbeats.

Several Celery apps (or the old and the new pods of a rolling deploy) may share one store.
Each config entry (from a ``beat_schedule``) belongs to a **schedule group**: by default the
Celery app's main name, or ``reliable_beat_schedule_group``. A beat's start-up sync only ever
touches the config entries of its own group, so two apps with different schedules never
disable each other's entries.

Within a group, the config a beat brings is identified by a digest of every entry
(:func:`group_config_hash`). The store remembers every config a group has synced
(``reliable_beat_schedule_configs``): the one not superseded is *current*. A beat whose config

* is the current one syncs nothing (quiet: nothing changed);
* was never seen is *new*: it is synced, logged once with what changed, and becomes current;
* was synced before and then superseded is *older* (an old pod restarting during a rolling
  deploy): it is **not** synced; the beat fires the group's current entries like any other.
  Only ``reliable-beat schedule sync --force`` (e.g. after a rollback) makes it current again.

So old and new pods never flap the stored schedule, and the change is logged once.

Each beat also keeps a row in ``reliable_beat_beats`` (owner id, group, the config it came
with, a heartbeat every few seconds, the config entries whose task its app does not
register), so ``reliable-beat status`` can tell a group with no live beat. Relays keep one
too (``role = 'relay'``, migration 0011_relaywatch: :func:`record_relay`), so ``status`` can
tell a group whose outbox rows no live relay or beat publishes (:func:`unserved_outbox`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, case, delete, func, or_, select, true, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import beats, entries, outbox, runs, schedule_configs
from reliable_beat.rows import decode_labelled, raw_labelled
from reliable_beat.triggers import TRIGGER_DESTINATION, TRIGGER_DESTINATIONS

if TYPE_CHECKING:
    from reliable_beat.definitions import EntryDefinition

__all__ = [
    "DEFAULT_GROUP",
    "SyncResult",
    "beat_heartbeat",
    "beat_stopped",
    "entry_outside_group",
    "group_config_hash",
    "group_health",
    "live_publishers",
    "log_sync_result",
    "record_beat",
    "record_relay",
    "relay_forget",
    "relay_heartbeat",
    "relay_row_owner",
    "relay_stopped",
    "run_in_group",
    "schedule_group_of",
    "shared_groups",
    "ungrouped_entries",
    "unpublished_triggers",
    "unserved_outbox",
]

#: The group of config entries synced without a name (no app, e.g. direct API use).
DEFAULT_GROUP = "default"
#: Rows of beats not seen for this long are deleted by the heartbeat of a beat of their group.
BEAT_ROW_RETENTION = timedelta(days=7)


def group_config_hash(definitions: Iterable[EntryDefinition]) -> str:
    """A digest of a whole ``beat_schedule`` as synced: every entry's name and its
    :meth:`~reliable_beat.definitions.EntryDefinition.config_hash` (order-independent)."""
    body = sorted((d.name, d.config_hash()) for d in definitions)
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()


@dataclass
class SyncResult:
    """What a config sync did.

    Attributes:
        group: the schedule group synced.
        config_hash: digest of the config the beat brought (:func:`group_config_hash`).
        outcome: ``new`` (never seen: synced, now current), ``current`` (already current:
            nothing to change), ``older`` (seen before and superseded: not synced),
            ``forced`` (an older config made current by ``--force``), ``refused`` (a new
            config that would disable every entry of the group: empty, or sharing no entry
            name with it; not synced, see ``refused``).
        inserted / updated / disabled / adopted: entry names. ``adopted``: config entries
            stored without a group (before groups existed) or disabled in another group,
            taken over by this group.
        unchanged: how many entries were already as configured.
        conflicts: entry name -> the other group that owns it (enabled there): not synced.
        renamed: new name -> old name, for an inserted entry defined exactly as one this sync
            disabled: it continues the old name's grid (its first slot is after the old
            name's last), so a rename neither repeats nor skips a slot.
        refused: for ``refused``, why (names the group, its entries and the fix).
        superseded_at: for ``older``, when this config was replaced (UTC).
        parked: config entries written disabled because the syncing beat's app does not
            register their task (:func:`reliable_beat.entries.park_reason`).
        ungrouped: when several schedule groups share the store, the enabled entries with no
            group (every group's beats may fire them, each through its own app's broker);
            empty otherwise. Logged as a warning naming them and the fix.
        groups: the schedule groups sharing the store, when ``ungrouped`` is not empty.
    """

    group: str
    config_hash: str
    outcome: str = "current"
    inserted: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: int = 0
    disabled: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    conflicts: dict[str, str] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)
    refused: str | None = None
    superseded_at: datetime | None = None
    ungrouped: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    parked: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        """``{"inserted", "updated", "unchanged", "disabled"}`` counts."""
        return {"inserted": len(self.inserted), "updated": len(self.updated),
                "unchanged": self.unchanged, "disabled": len(self.disabled)}

    @property
    def changed(self) -> bool:
        """True when any stored entry changed."""
        return bool(self.inserted or self.updated or self.disabled or self.adopted)


def shared_groups(conn: Connection) -> list[str]:
    """The schedule groups known to the store (a synced config or a beat's row), sorted."""
    known = select(schedule_configs.c.schedule_group).union(
        select(beats.c.schedule_group).where(beats.c.role == "beat"))
    return sorted({g for g in conn.execute(known).scalars() if g is not None})


def ungrouped_entries(conn: Connection, limit: int = 50) -> list[str]:
    """Names of enabled entries with no schedule group (at most ``limit``), sorted."""
    return list(conn.execute(
        select(entries.c.name)
        .where(entries.c.schedule_group.is_(None), entries.c.enabled == true())
        .order_by(entries.c.name).limit(limit)
    ).scalars())


def record_config(
    conn: Connection, *, group: str, config_hash: str, names: list[str], now: datetime,
    owner: str | None,
) -> None:
    """Make ``config_hash`` the group's current config (joins the caller's transaction)."""
    conn.execute(
        update(schedule_configs)
        .where(schedule_configs.c.schedule_group == group,
               schedule_configs.c.superseded_at.is_(None),
               schedule_configs.c.config_hash != config_hash)
        .values(superseded_at=now)
    )
    found = conn.execute(
        update(schedule_configs)
        .where(schedule_configs.c.schedule_group == group,
               schedule_configs.c.config_hash == config_hash)
        .values(superseded_at=None, synced_at=now, synced_by=owner, entry_names=sorted(names))
    ).rowcount
    if not found:
        conn.execute(schedule_configs.insert().values(
            schedule_group=group, config_hash=config_hash, entry_names=sorted(names),
            first_synced_at=now, synced_at=now, synced_by=owner, superseded_at=None,
        ))


def config_state(conn: Connection, group: str, config_hash: str) -> tuple[str, datetime | None]:
    """``("current" | "new" | "older", superseded_at)`` of a config within its group."""
    row = conn.execute(
        select(schedule_configs.c.superseded_at).where(
            schedule_configs.c.schedule_group == group,
            schedule_configs.c.config_hash == config_hash,
        )
    ).first()
    if row is None:
        return "new", None
    if row.superseded_at is None:
        return "current", None
    return "older", row.superseded_at


def record_beat(
    store: Store, *, owner: str, group: str, config_hash: str | None,
    unregistered: Mapping[str, str], destinations: Iterable[str] | None = None,
) -> None:
    """Insert or refresh this beat's row (at start, after its sync).

    Args:
        owner: the beat's owner id (``host:pid`` by default).
        group: its schedule group.
        config_hash: the config it brought.
        unregistered: config entry name -> task name, for entries of its group whose task
            its app does not register (``status`` reports them).
        destinations: the outbox destinations its sweep publishes (its publisher's:
            ``celery`` for a Celery beat, ``dramatiq`` for a Dramatiq one), recorded as a
            relay's are, so ``status`` can tell which broker a beat serves; None: not known
            (a row written before; counted as serving every trigger destination).
    """
    with store.begin() as conn:
        now = store.now(conn)
        values = {"schedule_group": group, "config_hash": config_hash, "seen_at": now,
                  "started_at": now, "stopped_at": None, "unregistered": dict(unregistered),
                  "destinations": None if destinations is None else sorted(set(destinations))}
        if not conn.execute(update(beats).where(beats.c.owner == owner).values(**values)).rowcount:
            conn.execute(beats.insert().values(owner=owner, **values))


def beat_heartbeat(store: Store, owner: str, group: str) -> None:
    """Refresh this beat's ``seen_at`` and delete its group's rows of beats gone for a week
    (bounded: at most 100 rows a call). Safe from several processes."""
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(beats).where(beats.c.owner == owner).values(seen_at=now))
        old = select(beats.c.owner).where(
            beats.c.schedule_group == group, beats.c.seen_at < now - BEAT_ROW_RETENTION
        ).limit(100)
        owners = list(conn.execute(old).scalars())
        if owners:
            conn.execute(delete(beats).where(beats.c.owner.in_(owners)))


def beat_stopped(store: Store, owner: str) -> None:
    """Mark this beat stopped (graceful exit)."""
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(beats).where(beats.c.owner == owner).values(
            stopped_at=now, seen_at=now))


def relay_row_owner(owner: str, group: str | None) -> str:
    """The ``owner`` key of a relay's row in ``reliable_beat_beats``:
    ``relay:<group or *>:<owner id>`` (at most 200 characters). One process may run a beat
    (row key: its owner id) and relays of several apps; each keeps a row of its own."""
    return f"relay:{group if group is not None else '*'}:{owner}"[:200]


def record_relay(
    store: Store, *, owner: str, group: str | None, destinations: Iterable[str]
) -> str:
    """Insert or refresh a relay's heartbeat row (``role = 'relay'``); returns its key.

    Args:
        owner: the relay's owner id (``claimed_by`` of its claims; ``host:pid`` by default).
        group: the schedule group whose rows it claims (its app's); None: a relay without an
            app, which claims the rows of every group for its destinations.
        destinations: its handlers' destinations (the rows it can deliver).

    Returns:
        The row's key (:func:`relay_row_owner`), for :func:`relay_heartbeat` and
        :func:`relay_stopped`. Own short transaction; safe from several processes (two
        relays of one process and group share the row).
    """
    key = relay_row_owner(owner, group)
    values: dict[str, Any] = {
        "schedule_group": group, "role": "relay", "config_hash": None,
        "destinations": sorted(set(destinations)), "unregistered": {}, "stopped_at": None}
    for attempt in (1, 2):
        try:
            with store.begin() as conn:
                now = store.now(conn)
                values.update(seen_at=now, started_at=now)
                if not conn.execute(
                        update(beats).where(beats.c.owner == key).values(**values)).rowcount:
                    conn.execute(beats.insert().values(owner=key, **values))
            break
        except IntegrityError:  # another relay of this process inserted it meanwhile
            if attempt == 2:
                raise
    return key


def relay_heartbeat(store: Store, key: str) -> bool:
    """Refresh a relay's ``seen_at`` (row ``key`` from :func:`record_relay`) and delete rows
    of relays gone for a week (bounded: at most 100 a call).

    Returns:
        False when the row is gone (deleted by hand): record it again.
    """
    with store.begin() as conn:
        now = store.now(conn)
        found = conn.execute(update(beats).where(beats.c.owner == key)
                             .values(seen_at=now, stopped_at=None)).rowcount
        old = select(beats.c.owner).where(
            beats.c.role == "relay", beats.c.seen_at < now - BEAT_ROW_RETENTION).limit(100)
        owners = list(conn.execute(old).scalars())
        if owners:
            conn.execute(delete(beats).where(beats.c.owner.in_(owners)))
    return bool(found)


def relay_stopped(store: Store, key: str) -> None:
    """Mark a relay's row stopped (graceful exit): ``status`` no longer counts it as live."""
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(beats).where(beats.c.owner == key).values(
            stopped_at=now, seen_at=now))


def relay_forget(store: Store, key: str) -> None:
    """Delete a relay's row (a one-shot run, ``relay --once``, at exit): nothing of a run
    that is over ages into ``status``'s "last seen". Own short transaction."""
    with store.begin() as conn:
        conn.execute(delete(beats).where(beats.c.owner == key, beats.c.role == "relay"))


def live_publishers(
    conn: Connection, now: datetime, *, alive_seconds: float
) -> list[dict[str, Any]]:
    """The beats and relays whose heartbeat is at most ``alive_seconds`` old and that did
    not stop, sorted by key.

    Returns:
        ``[{"owner" (row key), "role" ("beat" | "relay"), "schedule_group" (str | None: a
        relay without an app), "destinations" (list[str] | None: a relay's handlers, a
        beat's publisher's destination; None: a beat row written before beats recorded
        it),
        "seen_at" (UTC)}]``.
    """
    horizon = now - timedelta(seconds=alive_seconds)
    out: list[dict[str, Any]] = []
    for r in _beat_rows(conn, ("owner", "role", "schedule_group", "destinations", "seen_at"),
                        beats.c.stopped_at.is_(None), beats.c.seen_at >= horizon):
        seen = _readable_instant(r.seen_at)
        if seen is None or seen < horizon:  # SQLite compares text: garbage sorts after digits
            continue
        out.append({"owner": r.owner, "role": r.role, "schedule_group": r.schedule_group,
                    "destinations": (list(r.destinations) if isinstance(r.destinations, list)
                                     else None),
                    "seen_at": seen})
    return sorted(out, key=lambda p: str(p["owner"]))


def _beat_rows(conn: Connection, names: Iterable[str], *where: Any) -> list[Any]:
    """Rows of the beats table, the named columns decoded value by value
    (:func:`reliable_beat.rows.decode_labelled`): a value a person or another version wrote
    that cannot be read is None (an unreadable heartbeat counts as no heartbeat) instead of
    failing ``status`` and every reader of the table."""
    columns = {n: beats.c[n] for n in names}
    stmt = select(*raw_labelled(columns, conn.dialect)).where(*where)
    return [decode_labelled(dict(r._mapping), columns, conn.dialect)
            for r in conn.execute(stmt).all()]


def _readable_instant(value: Any) -> datetime | None:
    """A decoded instant as aware UTC; None when it is not one (unreadable, a JSON value, a
    PostgreSQL 'infinity' is kept: it is a datetime sentinel and compares as one)."""
    return _aware(value) if isinstance(value, datetime) else None


def _serves(process: Mapping[str, Any], group: str, destination: str) -> bool:
    """Whether a live beat / relay publishes pending rows of ``group`` to ``destination``: a
    beat sweeps its own group's triggers and workflow messages (the trigger destinations);
    a relay claims its group's rows (or every group's, without an app) for the
    destinations it has handlers for."""

    if process["role"] == "beat":
        # its recorded destinations (its publisher's); a row without any (written before
        # beats recorded them): any trigger destination
        dests = process["destinations"]
        return process["schedule_group"] == group and destination in (
            TRIGGER_DESTINATIONS if dests is None else dests)
    if process["schedule_group"] not in (group, None):
        return False
    dests = process["destinations"]
    return dests is None or destination in dests


def outbox_group() -> Any:
    """SQL: an outbox row's schedule group: its ``schedule_group`` (a workflow's messages,
    0010), else, for a trigger (destination ``celery``), its run's entry's group; NULL for a
    row of no group (any relay with the handler publishes it)."""

    entry_group = (
        select(entries.c.schedule_group)
        .select_from(runs.join(entries, entries.c.name == runs.c.entry_name))
        .where(runs.c.id == outbox.c.run_id)  # one run (its id), one entry (unique name)
        .scalar_subquery()
    )
    return func.coalesce(
        outbox.c.schedule_group,
        case((and_(outbox.c.destination == TRIGGER_DESTINATION, outbox.c.run_id.is_not(None)),
              entry_group), else_=None),
    )


def unserved_outbox(
    conn: Connection, now: datetime, *, due_seconds: float, alive_seconds: float
) -> list[dict[str, Any]]:
    """Pending outbox rows of a schedule group due for more than ``due_seconds`` that no live
    relay or beat publishes, one dict per group, sorted by group.

    A row's group is its ``schedule_group`` (a workflow's messages, 0010), else, for a trigger
    (destination ``celery``), its run's entry's group; rows with neither are published by any
    relay with the handler (``status`` reports those per destination: UNDELIVERED OUTBOX).
    Only the relays and beats of that group publish such a row (:func:`~reliable_beat.relay.
    claim_outbox_batch`), so with none alive (:func:`live_publishers`, heartbeat newer than
    ``alive_seconds``) it waits forever: an app whose relay never started, or a starter and
    a relay that disagree on the group (``Celery(__name__)`` run as ``__main__`` is group
    ``default``).

    Returns:
        ``[{"group", "rows" (int), "destinations" ([str]), "due_since" (UTC: the oldest
        ``available_at``), "last_seen_at" (UTC | None: the newest heartbeat of a beat or
        relay of the group, live or not; None: never), "served_groups" ([str]: the groups
        the live beats and relays do serve; ``"*"``: a relay without an app)}]``.
    """
    group_expr = outbox_group()
    stale = (
        select(group_expr.label("grp"), outbox.c.destination.label("destination"),
               outbox.c.available_at.label("available_at"))
        .where(outbox.c.state == "pending",
               outbox.c.available_at <= now - timedelta(seconds=due_seconds))
        .subquery()
    )
    found = conn.execute(
        select(stale.c.grp, stale.c.destination, func.count(), func.min(stale.c.available_at))
        .where(stale.c.grp.is_not(None))
        .group_by(stale.c.grp, stale.c.destination)
    ).all()
    if not found:
        return []
    live = live_publishers(conn, now, alive_seconds=alive_seconds)
    out: dict[str, dict[str, Any]] = {}
    for grp, destination, n, since in found:
        if any(_serves(p, grp, destination) for p in live):
            continue
        g = out.setdefault(grp, {"group": grp, "rows": 0, "destinations": [],
                                 "due_since": None, "last_seen_at": None})
        g["rows"] += int(n)
        g["destinations"] = sorted({*g["destinations"], destination})
        since = _instant(since)
        if since is not None and (g["due_since"] is None or since < g["due_since"]):
            g["due_since"] = since
    if not out:
        return []
    for grp, seen in conn.execute(
        select(beats.c.schedule_group, func.max(beats.c.seen_at))
        .where(beats.c.schedule_group.in_(sorted(out)))
        .group_by(beats.c.schedule_group)
    ).all():
        out[grp]["last_seen_at"] = _instant(seen)
    served = sorted({p["schedule_group"] if p["schedule_group"] is not None else "*"
                     for p in live})
    for g in out.values():
        g["served_groups"] = served
    return [out[k] for k in sorted(out)]


def unpublished_triggers(
    conn: Connection, now: datetime, *, pending_seconds: float, alive_seconds: float
) -> list[dict[str, Any]]:
    """Triggers (destination ``celery``) of a schedule group still pending more than
    ``pending_seconds`` after they were written although a live beat or relay of the group
    publishes them: the group's broker does not take them (it refuses connections, or hangs:
    each publish times out, see ``reliable_beat_publish_timeout_seconds``). The counterpart
    of :func:`unserved_outbox` (no live publisher at all); the rows wait, nothing is lost.

    Returns:
        ``[{"group", "rows" (int), "since" (UTC: the oldest row's ``created_at``),
        "publishers" (int: live beats and relays of the group)}]``, sorted by group.
    """
    group_expr = outbox_group()
    old = (
        select(group_expr.label("grp"), outbox.c.created_at.label("created_at"))
        .where(outbox.c.state == "pending", outbox.c.destination == "celery",
               # not a trigger held for a later instant; a row a relay backed off after a
               # failed publish (last_error set) is waiting on the broker too
               or_(outbox.c.available_at <= now, outbox.c.last_error.is_not(None)),
               outbox.c.created_at <= now - timedelta(seconds=pending_seconds))
        .subquery()
    )
    found = conn.execute(
        select(old.c.grp, func.count(), func.min(old.c.created_at))
        .where(old.c.grp.is_not(None)).group_by(old.c.grp)
    ).all()
    if not found:
        return []
    live = live_publishers(conn, now, alive_seconds=alive_seconds)
    out = []
    for grp, n, since in sorted(found, key=lambda f: str(f[0])):
        serving = [p for p in live if _serves(p, grp, "celery")]
        if serving:
            out.append({"group": grp, "rows": int(n), "since": _instant(since),
                        "publishers": len(serving)})
    return out


def _instant(value: Any) -> datetime | None:
    """An aggregate's instant (SQLite returns ISO text, untyped) as an aware UTC datetime."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:  # SQLite: text a person wrote (max() of text picks it first)
            return None
    return _readable_instant(value)


def group_health(
    conn: Connection, now: datetime, *, alive_seconds: float
) -> list[dict[str, Any]]:
    """One dict per schedule group known to the store (from its config entries and beats),
    sorted by name.

    Args:
        now: the store's clock (UTC).
        alive_seconds: a beat whose heartbeat is older than this counts as gone.

    Returns:
        ``{"group", "beats_alive" (int), "last_seen_at" (UTC | None), "enabled_entries" (int),
        "runtime_entries" (int: enabled runtime entries of the group, added with ``-A`` or
        ``--group``; only the group's beats fire them), "config_synced_at" (UTC | None),
        "current_config" (hash | None),
        "beats_on_other_config" (live beats that started with a config other than the
        current one: an old pod, or a refused config), "unregistered" ({entry: task}, from
        the live beats), "relays_alive" (int: live relays of the group, 0011, and those of no group,
        which serve every group),
        "relay_last_seen_at" (UTC | None), "beat_destinations" ([str]: what the live beats
        publish to, ``celery`` / ``dramatiq``, from their rows; empty when none recorded
        it)}``. ``beats_alive`` / ``last_seen_at`` count beats only (``role = 'beat'``).
    """
    horizon = now - timedelta(seconds=alive_seconds)
    groups: dict[str, dict[str, Any]] = {}

    def group(name: str) -> dict[str, Any]:
        return groups.setdefault(name, {
            "group": name, "beats_alive": 0, "last_seen_at": None, "enabled_entries": 0,
            "runtime_entries": 0,
            "config_synced_at": None, "current_config": None, "beats_on_other_config": 0,
            "unregistered": {}, "relays_alive": 0, "relay_last_seen_at": None,
            "beat_destinations": [],
        })

    for name, count in conn.execute(
        select(entries.c.schedule_group, func.count())
        .where(and_(entries.c.origin == "config", entries.c.schedule_group.is_not(None),
                    entries.c.enabled.is_(True)))
        .group_by(entries.c.schedule_group)
    ).all():
        group(name)["enabled_entries"] = int(count)
    for name, count in conn.execute(
        select(entries.c.schedule_group, func.count())
        .where(and_(entries.c.origin != "config", entries.c.schedule_group.is_not(None),
                    entries.c.enabled.is_(True)))
        .group_by(entries.c.schedule_group)
    ).all():
        group(name)["runtime_entries"] = int(count)
    cfg_columns = {"schedule_group": schedule_configs.c.schedule_group,
                   "synced_at": schedule_configs.c.synced_at,
                   "config_hash": schedule_configs.c.config_hash}
    for raw in conn.execute(
        select(*raw_labelled(cfg_columns, conn.dialect))
        .where(schedule_configs.c.superseded_at.is_(None))
    ).all():
        cfg = decode_labelled(dict(raw._mapping), cfg_columns, conn.dialect)
        group(cfg.schedule_group)["config_synced_at"] = _readable_instant(cfg.synced_at)
        group(cfg.schedule_group)["current_config"] = cfg.config_hash
    for row in _beat_rows(conn, ("schedule_group", "seen_at", "stopped_at", "unregistered",
                                 "config_hash", "destinations"), beats.c.role == "beat"):
        g = group(row.schedule_group)
        seen = _readable_instant(row.seen_at)
        if seen is None:  # an unreadable heartbeat: not alive, not a last sighting
            continue
        if g["last_seen_at"] is None or seen > g["last_seen_at"]:
            g["last_seen_at"] = seen
        if row.stopped_at is None and "stopped_at" not in row.unreadable and seen >= horizon:
            g["beats_alive"] += 1
            if g["current_config"] is not None and row.config_hash != g["current_config"]:
                g["beats_on_other_config"] += 1
            if isinstance(row.unregistered, dict):
                g["unregistered"].update(row.unregistered)
            if isinstance(row.destinations, list):
                g["beat_destinations"] = sorted({*g["beat_destinations"],
                                                 *map(str, row.destinations)})
    everywhere: list[Any] = []  # relays of no group (no app) serve every group
    for relay in _beat_rows(conn, ("schedule_group", "seen_at", "stopped_at"),
                            beats.c.role == "relay"):
        if relay.schedule_group is None:
            everywhere.append(relay)
        else:
            _count_relay(group(relay.schedule_group), relay, horizon)
    for relay in everywhere:
        for g in groups.values():
            _count_relay(g, relay, horizon)
    return [groups[k] for k in sorted(groups)]


def _count_relay(g: dict[str, Any], relay: Any, horizon: datetime) -> None:
    """Count ``relay`` (a beats row) in group health ``g``: its last sighting, and live
    when it did not stop and its heartbeat is newer than ``horizon``."""
    seen = _readable_instant(relay.seen_at)
    if seen is None:
        return
    if g["relay_last_seen_at"] is None or seen > g["relay_last_seen_at"]:
        g["relay_last_seen_at"] = seen
    if relay.stopped_at is None and "stopped_at" not in relay.unreadable and seen >= horizon:
        g["relays_alive"] += 1


def _aware(value: datetime) -> datetime:
    from datetime import timezone

    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def entry_outside_group(entry_name: Any, group: str) -> Any:
    """SQL: ``entry_name`` (a column or expression) names an entry owned by a schedule group
    other than ``group``. Entries with no group (stored before groups, or runtime entries
    without one) and deleted entries are not outside any group."""
    return (
        select(entries.c.id)
        .where(entries.c.name == entry_name, entries.c.schedule_group.is_not(None),
               entries.c.schedule_group != group)
        .exists()
    )


def run_in_group(run_id: Any, group: str | None) -> Any:
    """SQL: the run ``run_id`` (a column, e.g. ``reliable_beat_outbox.run_id``) may be
    published by a process of schedule group ``group``: no run (not a trigger), or its entry
    is of ``group``, has no group, or is gone. ``None``: every run (``true()``).

    The group is the entry's *current* one (read when the trigger is published): a trigger
    goes to the broker of the app that owns its entry, whose workers register its task."""
    if group is None:
        return true()
    return ~(
        select(runs.c.id)
        .where(runs.c.id == run_id, entry_outside_group(runs.c.entry_name, group))
        .exists()
    )


def schedule_group_of(app: Any, configured: str | None) -> str:
    """The schedule group of an app: ``configured`` (``reliable_beat_schedule_group``), else
    the app's main name (``Celery("proj")`` -> ``proj``), else :data:`DEFAULT_GROUP`."""
    if configured:
        return configured
    main = getattr(app, "main", None)
    if isinstance(main, str) and main and main != "__main__":
        return main
    return DEFAULT_GROUP


def _names(names: Iterable[str], limit: int = 20) -> str:
    items = list(names)
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def log_sync_result(log: logging.Logger, result: SyncResult, where: str) -> None:
    """Log a sync the way operators need it: one INFO line when nothing changed, what
    changed (names) once when a new config was synced, a WARNING naming disabled entries, an
    ERROR per entry owned by another group."""
    group = result.group
    short = result.config_hash[:12]
    if result.ungrouped:
        log.warning(
            "reliable_beat: entries with no schedule group: %s. The schedule groups %s share "
            "this store, so the beats of every group may fire them, each through its own app's "
            "broker (where another app's workers may not know the task). Give each one its "
            "group: `reliable-beat entries update NAME --group GROUP` (a runtime entry; a "
            "beat_schedule entry is adopted when its own app's beat starts).",
            _names(result.ungrouped), ", ".join(repr(g) for g in result.groups))
    if result.outcome == "older":
        log.info(
            "reliable_beat: schedule group %r: this beat's beat_schedule (config %s) is an older "
            "version, superseded at %s; not syncing it. This beat fires the group's current "
            "entries. (After a rollback run `reliable-beat -A APP schedule sync --force`.)",
            group, short, result.superseded_at.isoformat() if result.superseded_at else "?")
        return
    if result.outcome == "refused":
        log.error("reliable_beat: schedule group %r: not syncing beat_schedule (config %s): "
                  "%s. This beat fires the group's current entries.", group, short,
                  result.refused)
        return
    for name, other in sorted(result.conflicts.items()):
        log.error(
            "reliable_beat: entry %r of schedule group %r is an enabled config entry of group "
            "%r; left to that group, not synced. Rename it in one of the two beat_schedules, "
            "or remove it from group %r's (its beat then disables it and this group adopts it "
            "at its next start).", name, group, other, other)
    if not result.changed:
        log.info("reliable_beat: schedule group %r: beat_schedule in %s is current (config %s, "
                 "%d entries); nothing to sync", group, where, short, result.unchanged)
        return
    parts = [f"{k} {len(v)} ({_names(v)})" for k, v in (
        ("inserted", result.inserted), ("updated", result.updated),
        ("adopted", result.adopted)) if v]
    if result.renamed:
        parts.append("renamed " + ", ".join(
            f"{old} -> {new}" for new, old in sorted(result.renamed.items())))
    log.info("reliable_beat: schedule group %r: synced %s beat_schedule (config %s) into %s: "
             "%s; %d unchanged", group, result.outcome, short, where,
             "; ".join(parts) or "nothing new", result.unchanged)
    if result.disabled:
        log.warning("reliable_beat: schedule group %r: disabled %d config entries gone from its "
                    "beat_schedule: %s (their history stays; `reliable-beat status --all` "
                    "shows them)", group, len(result.disabled), _names(result.disabled))
