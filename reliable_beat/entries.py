"""Entries: the config sync and the runtime API.

An *entry* is a named recurring definition (Celery's word): a task, its arguments, publish
options, a schedule, and per-entry policies (:class:`EntryDefinition`, parsed from a
``beat_schedule`` item in :mod:`reliable_beat.definitions`, which also lists the per-entry
settings). Entries live in ``reliable_beat_entries``; the beat never holds them all in
memory. :func:`sync_schedule_group` makes a schedule group's stored config entries match
its ``beat_schedule``; :func:`save_runtime_entry`, :func:`pause`, :func:`resume`,
:func:`remove`, :func:`get_entry` and :func:`list_entries` are the runtime API.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import and_, select, text, type_coerce, update
from sqlalchemy.engine import Connection
from sqlalchemy.types import NullType

from reliable_beat import schedules as sch
from reliable_beat import values as rb_values
from reliable_beat.db.dialects import Store, update_returning
from reliable_beat.db.migrate import VERSION_TABLE
from reliable_beat.db.tables import MYSQL_DIALECTS, entries, runs
from reliable_beat.definitions import (
    ENTRY_OPTION_KEYS,
    EntryDefinition,
    definition_from_celery,
    is_task_elsewhere,
)
from reliable_beat.definitions import PUBLISH_OPTION_KEYS as PUBLISH_OPTION_KEYS
from reliable_beat.definitions import (
    definitions_from_beat_schedule as definitions_from_beat_schedule,
)
from reliable_beat.errors import ConfigurationError, EntryNotFoundError
from reliable_beat.groups import (
    DEFAULT_GROUP,
    SyncResult,
    config_state,
    group_config_hash,
    record_config,
    shared_groups,
    ungrouped_entries,
)
from reliable_beat.redaction import get_logger
from reliable_beat.rows import (
    decode_row,
    decode_value,
    entry_checker,
    next_fire_problem,
    raw_columns,
    repaired_next_fire,
)

__all__ = [
    "ENTRY_OPTION_KEYS",
    "EntryDefinition",
    "definition_from_celery",
    "get_entry",
    "is_task_elsewhere",
    "list_entries",
    "notify_entries_changed",
    "park_reason",
    "pause",
    "remove",
    "resume",
    "save_runtime_entry",
    "sync_config_entries",
    "sync_schedule_group",
]

log = get_logger(__name__)

NOTIFY_CHANNEL = "reliable_beat_entries"


def park_reason(task: str) -> str:
    """The ``quarantine_reason`` of a config entry parked because the syncing beat's app does
    not register its ``task`` (see :func:`sync_schedule_group`)."""
    return (f"task {task!r} is not registered in this beat's app, so no worker would run its "
            "triggers: parked, not fired. Fix: correct the task name in beat_schedule, or "
            "import the module that defines it in the app (Celery: `imports` / `include` / "
            "autodiscover_tasks; Dramatiq: the broker module); if only workers of another "
            "code base register it, set options['reliable_beat']['task_elsewhere'] = True on "
            "the entry. The next beat start fires it again")


def notify_entries_changed(conn: Connection, store: Store) -> None:
    """Wake sleeping beats (PostgreSQL ``NOTIFY``, delivered at commit); no-op elsewhere."""
    if store.dialect == "postgresql":
        conn.execute(text(f"NOTIFY {NOTIFY_CHANNEL}"))


def _lock_for_sync(conn: Connection, store: Store) -> None:
    if store.dialect == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(7262656175)"))
    elif store.dialect in MYSQL_DIALECTS:
        # No transaction-level advisory lock on MySQL/MariaDB (GET_LOCK outlives the
        # commit): lock the schema's one version row instead, released at commit.
        conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE} FOR UPDATE"))


_UPSERT_COLUMNS = (entries.c.id, entries.c.config_hash, entries.c.schedule, entries.c.enabled,
                   entries.c.origin, entries.c.last_fire_at, entries.c.next_fire_at,
                   entries.c.paused, entries.c.schedule_group,
                   # what the claim's check reads (a row changed by SQL is rewritten, see
                   # _stored_malformed)
                   entries.c.task, entries.c.args, entries.c.kwargs, entries.c.options,
                   entries.c.timezone, entries.c.misfire_policy, entries.c.overlap_policy,
                   entries.c.misfire_grace_seconds, entries.c.catch_up_limit,
                   entries.c.catch_up_window_seconds, entries.c.start_at, entries.c.end_at,
                   entries.c.quarantine_reason, entries.c.created_at)
#: Names per statement when a sync reads its entries (bounded IN lists: MariaDB turns long
#: ones into a join, every server has a parameter limit).
_SYNC_CHUNK = 500


def _upsert_select(conn: Connection) -> Any:
    sqlite = conn.dialect.name == "sqlite"  # elsewhere the server enforces column types
    return select(entries.c.name, *(type_coerce(c, NullType()).label(c.name) if sqlite else c
                                    for c in _UPSERT_COLUMNS))


def _decode_for_upsert(conn: Connection, raw: Any) -> Any:
    """One stored row as :func:`_upsert` compares it. Read value by value: a stored value
    that cannot be decoded (SQLite: invalid JSON text, a non-instant) reads as None, so a
    malformed row is simply rewritten from the definition (see :mod:`reliable_beat.rows`)."""
    sqlite = conn.dialect.name == "sqlite"
    values: dict[str, Any] = {"name": raw._mapping["name"]}
    for c in _UPSERT_COLUMNS:
        try:
            value = raw._mapping[c.name]
            values[c.name] = decode_value(c, value, conn.dialect) if sqlite else value
        except Exception:
            values[c.name] = None
    if not isinstance(values["schedule"], dict):
        values["schedule"] = None
    for instant in ("last_fire_at", "next_fire_at"):
        if not isinstance(values[instant], datetime):
            values[instant] = None
    return SimpleNamespace(**values)


def _stored_malformed(row: Any) -> bool:
    """True when a stored row a claim can take (enabled, a next slot) fails the claim's check
    (:func:`reliable_beat.rows.check_entry`: a row changed by SQL, its ``config_hash`` left
    as it was). A sync then rewrites it from its definition, even when the config is current,
    instead of leaving it for a beat to quarantine when it comes due (its slot lost)."""
    if not row.enabled or row.next_fire_at is None:
        return False
    problems = entry_checker()(vars(row))
    if problems:
        log.warning("entry %r: its stored row is malformed (%s); rewriting it from its "
                    "definition", row.name, "; ".join(problems[:3]))
    return bool(problems)


def _next_fire_repair(row: Any, now: datetime, *, lifting_quarantine: bool = False
                      ) -> tuple[bool, datetime | None]:
    """``(True, the value its schedule gives)`` when an active stored row (enabled,
    unpaused, unquarantined; or quarantined, when the caller lifts the quarantine) has a
    ``next_fire_at`` its schedule cannot have put there
    (:func:`reliable_beat.rows.next_fire_problem`: NULL while the schedule has a next slot,
    or far beyond it); else ``(False, None)``. The value is the schedule's first slot after
    the last one (:func:`reliable_beat.rows.repaired_next_fire`): slots missed meanwhile go
    through the misfire policy at the next tick."""
    quarantined = row.quarantine_reason is not None
    if row.paused or (quarantined and not lifting_quarantine) or (
            not row.enabled and not quarantined):
        return False, None
    instants = (row.next_fire_at, row.last_fire_at, row.start_at, row.end_at)
    if not all(v is None or isinstance(v, datetime) for v in instants):
        return False, None
    try:
        schedule = sch.schedule_from_spec(row.schedule)
        created = row.created_at if isinstance(row.created_at, datetime) else None
        problem = next_fire_problem(schedule, next_fire_at=row.next_fire_at,
                                    last_fire_at=row.last_fire_at, start_at=row.start_at,
                                    end_at=row.end_at, now=now, created_at=created)
    except Exception:  # a malformed row: the row check's business
        return False, None
    if problem is None:
        return False, None
    repaired = repaired_next_fire(schedule, last_fire_at=row.last_fire_at,
                                  start_at=row.start_at, end_at=row.end_at, now=now,
                                  created_at=created)
    log.warning("entry %r: %s; recomputed from its schedule: next_fire_at=%s", row.name,
                problem, repaired.isoformat() if repaired else None)
    return True, repaired


def _read_for_upsert(conn: Connection, name: str) -> Any:
    """The stored columns :func:`_upsert` compares, or None (the row locked: this sync
    rewrites it)."""
    raw = conn.execute(
        _upsert_select(conn).where(entries.c.name == name).with_for_update()
    ).first()
    return None if raw is None else _decode_for_upsert(conn, raw)


def _read_many_for_upsert(conn: Connection, names: Sequence[str]) -> dict[str, Any]:
    """:func:`_read_for_upsert` for many names: name -> stored row (absent: no row), read
    and locked :data:`_SYNC_CHUNK` names per statement, in name order."""
    out: dict[str, Any] = {}
    ordered = sorted(set(names))
    for i in range(0, len(ordered), _SYNC_CHUNK):
        chunk = ordered[i:i + _SYNC_CHUNK]
        for raw in conn.execute(
            _upsert_select(conn).where(entries.c.name.in_(chunk))
            .order_by(entries.c.name).with_for_update()
        ):
            out[raw._mapping["name"]] = _decode_for_upsert(conn, raw)
    return out


#: :func:`_upsert`'s ``row`` when the caller has not read it
_UNREAD: Any = object()


def _upsert(
    conn: Connection, store: Store, definition: EntryDefinition, now: datetime,
    group: str | None = None, after: datetime | None = None, *, row: Any = _UNREAD,
    inserts: list[dict[str, Any]] | None = None, park: str | None = None,
) -> str:
    """Insert or update one entry. Returns ``inserted``, ``updated``, ``unchanged``,
    ``adopted`` (a config entry of no group, or disabled in another group, now ``group``'s) or
    ``conflict`` (an enabled config entry of another group: left as it is).

    ``after``: a new entry's first slot is after this instant too (a renamed entry continues
    where its old name stopped). ``row``: the stored row as :func:`_read_many_for_upsert`
    read it (None: there is none); not given, it is read here. ``inserts``: a new row's values
    are appended there for the caller to insert in one statement, instead of inserted here.
    ``park``: write the entry disabled with this ``quarantine_reason`` (its task is not
    registered in the syncing beat's app, :func:`park_reason`); it does not fire."""
    if row is _UNREAD:
        row = _read_for_upsert(conn, definition.name)
    values = definition.row_values()
    if definition.origin == "config" or group is not None:
        values["schedule_group"] = group
    if row is None:
        values.update(
            next_fire_at=definition.first_fire_at(max(now, after) if after else now,
                                                  one_off_fired_through=after),
            created_at=now, updated_at=now, enabled=park is None, paused=False,
            quarantine_reason=park, quarantined_at=now if park else None,
        )
        if inserts is not None:
            inserts.append(values)
        else:
            conn.execute(entries.insert().values(**values))
        return "inserted"
    adopted = False
    if definition.origin == "config" and row.schedule_group != group:
        if row.schedule_group is not None and row.enabled:
            return "conflict"
        adopted = True
    regrouped = definition.origin != "config" and group is not None and (
        row.schedule_group != group)
    # the rewrite below lifts a quarantine: one the beat's sweep put on an inconsistent
    # next_fire_at is repaired from the last slot, as `entries resume` does
    bad_next, repaired = _next_fire_repair(row, now, lifting_quarantine=park is None)
    if (row.config_hash == values["config_hash"] and row.enabled and park is None
            and not (adopted or regrouped) and not _stored_malformed(row) and not bad_next):
        return "unchanged"
    if (park is not None and row.config_hash == values["config_hash"] and not row.enabled
            and row.quarantine_reason == park and not (adopted or regrouped)):
        return "unchanged"  # parked before for the same reason: keep when it was parked
    if definition.schedule.kind == "interval" and not getattr(
        definition, "_explicit_anchor", False
    ):
        old = row.schedule or {}
        new = values["schedule"]
        if old.get("kind") == "interval" and old.get("every_seconds") == new.get("every_seconds"):
            values["schedule"] = dict(new, anchor=old["anchor"])  # keep the grid
            definition = replace(definition, schedule=sch.schedule_from_spec(values["schedule"]))
    same_schedule = row.schedule == values["schedule"]
    if same_schedule and bad_next:
        next_fire_at = repaired  # the stored one could never fire (a row changed by SQL)
    elif same_schedule and row.enabled and row.next_fire_at is not None:
        next_fire_at = row.next_fire_at
    else:
        base = max(now, row.last_fire_at) if row.last_fire_at else now
        # a one-off whose instant changed is due even if the new instant is past; one merely
        # re-enabled keeps its old rule (a slot passed while disabled is not fired)
        next_fire_at = (definition.first_fire_at(base, one_off_fired_through=row.last_fire_at)
                        if not same_schedule else definition.first_fire_at(base))
    # Rewriting the entry from its definition also lifts a quarantine (reliable_beat.rows).
    values.update(next_fire_at=next_fire_at, updated_at=now, enabled=park is None,
                  disabled_at=None, quarantine_reason=park,
                  quarantined_at=now if park else None)
    del values["name"]
    conn.execute(update(entries).where(entries.c.id == row.id).values(**values))
    return "adopted" if adopted else "updated"


def sync_schedule_group(
    store: Store,
    definitions: Iterable[EntryDefinition],
    *,
    group: str = DEFAULT_GROUP,
    owner: str | None = None,
    force: bool = False,
    unregistered: Mapping[str, str] | None = None,
) -> SyncResult:
    """Make the stored config entries of schedule group ``group`` match ``beat_schedule``, in
    one transaction, unless this config is an older one of the group.

    The config's digest (:func:`~reliable_beat.groups.group_config_hash`) decides
    (see :mod:`reliable_beat.groups`): the group's *current* config changes nothing; a *new*
    one is synced and becomes current; an *older* one (synced before, then superseded: an
    old pod of a rolling deploy) is not synced unless ``force``.

    A sync inserts new entries, updates changed ones (a changed schedule recomputes
    ``next_fire_at`` on the new grid) and disables (never deletes: their history stays) the
    config entries **of this group** that are gone from the config. Config entries of other
    groups and runtime entries are never touched; a name that is an enabled config entry of
    another group is reported in ``conflicts`` and left to that group; a config entry with no
    group (stored before groups existed) or disabled in another group is adopted. Safe when
    several beats sync at once (PostgreSQL advisory lock; MySQL/MariaDB: the row of
    ``reliable_beat_alembic_version`` locked; SQLite write lock).

    Args:
        group: the schedule group (the Celery app's main name, or
            ``reliable_beat_schedule_group``).
        owner: who syncs (recorded with the config; for the logs).
        force: sync even an older config (``reliable-beat schedule sync --force``).
        unregistered: entry name -> task, for the entries whose task the syncing beat's app
            does not register (and that do not say ``task_elsewhere``): each is **parked**,
            written disabled with :func:`park_reason` as its ``quarantine_reason`` (not fired;
            ``status``: QUARANTINED), as the claim quarantines a malformed row. A later sync
            whose app registers the task (or whose entry says ``task_elsewhere``) lifts it.
            None (the caller did not check, e.g. ``schedule sync`` from a CLI that loaded
            the app but not its task modules): an entry parked for the same task stays so.

    Raises:
        ConfigurationError: a config entry has the name of an existing runtime entry.
    """
    defs = list(definitions)
    result = SyncResult(group=group, config_hash=group_config_hash(defs))
    with store.begin() as conn:
        _lock_for_sync(conn, store)
        now = store.now(conn)
        state, superseded_at = config_state(conn, group, result.config_hash)
        if state == "older" and not force:
            result.outcome, result.superseded_at = "older", superseded_at
            _note_ungrouped(conn, group, result)
            return result
        result.outcome = "forced" if state == "older" else state
        _note_ungrouped(conn, group, result)
        names = [d.name for d in defs]
        if state == "new" and not force:
            reason = _refuse_new_config(conn, group, names)
            if reason:
                result.outcome, result.refused = "refused", reason
                return result
        clash = conn.execute(
            select(entries.c.name).where(
                entries.c.name.in_(names), entries.c.origin == "runtime"
            )
        ).scalars().all() if names else []
        if clash:
            raise ConfigurationError(
                f"beat_schedule entries {sorted(clash)} clash with runtime entries of the same "
                "name; rename them or remove the runtime entries (`reliable-beat entries remove`)"
            )
        # Disable first (UPDATE ... RETURNING waits for a beat's claim holding the row, so
        # last_fire_at is the committed one), then insert / update.
        stale = update(entries).where(
            and_(entries.c.origin == "config", entries.c.enabled.is_(True),
                 entries.c.schedule_group == group)
        )
        if names:
            stale = stale.where(entries.c.name.not_in(names))
        gone = sorted(update_returning(
            conn, stale.values(enabled=False, disabled_at=now, updated_at=now), entries,
            (entries.c.name, entries.c.config_hash, entries.c.last_fire_at,
             entries.c.schedule),
        ), key=lambda r: r.name)
        result.disabled = [r.name for r in gone]
        renamed = _renames(conn, defs, gone)
        # One read (and lock) per chunk of names and one multi-row insert of the new ones,
        # not a round trip per entry: 5,000 entries took 34 s to change nothing on a loaded
        # machine, holding the sync lock every other beat of the group waits for.
        stored = _read_many_for_upsert(conn, names)
        inserts: list[dict[str, Any]] = []
        seen: set[str] = set()
        for d in defs:
            d.origin = "config"
            after = None
            old = renamed.get(d.name)
            if old is not None:
                result.renamed[d.name] = old.name
                after = old.last_fire_at
                if d.schedule.kind == "interval" and not getattr(d, "_explicit_anchor", False):
                    d = replace(d, schedule=sch.schedule_from_spec(old.schedule))
            row = stored.get(d.name)
            if d.name in seen:  # the same name twice: the first may be an insert pending
                _insert_entries(conn, inserts)
                inserts.clear()
                row = _UNREAD
            seen.add(d.name)
            if unregistered is not None:
                park = park_reason(d.task) if d.name in unregistered else None
            else:  # registration not checked (`schedule sync`): a park for this task stays
                park = (row.quarantine_reason if row is not None and row is not _UNREAD
                        and row.quarantine_reason == park_reason(d.task) else None)
            outcome = _upsert(conn, store, d, now, group, after, row=row, inserts=inserts,
                              park=park)
            if park is not None and outcome != "conflict":
                result.parked.append(d.name)
            if outcome == "unchanged":
                result.unchanged += 1
            elif outcome == "conflict":
                other = conn.execute(
                    select(entries.c.schedule_group).where(entries.c.name == d.name)
                ).scalar_one()
                result.conflicts[d.name] = other
            else:
                getattr(result, outcome).append(d.name)
        _insert_entries(conn, inserts)
        record_config(conn, group=group, config_hash=result.config_hash, names=names, now=now,
                      owner=owner)
        if result.changed:
            notify_entries_changed(conn, store)
    return result


def _insert_entries(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert new entry rows, one executemany per set of columns (SQLAlchemy sends each as
    multi-row ``INSERT ... VALUES`` batches)."""
    by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for values in rows:
        by_columns.setdefault(tuple(sorted(values)), []).append(values)
    for batch in by_columns.values():
        for i in range(0, len(batch), _SYNC_CHUNK):
            conn.execute(entries.insert(), batch[i:i + _SYNC_CHUNK])


def _refuse_new_config(conn: Connection, group: str, names: list[str]) -> str | None:
    """Why a never-seen config must not replace the group's entries by itself, or None.

    Two shapes are far more often a mistake than a decision: an empty ``beat_schedule`` (a
    settings module that did not load) and a config sharing no entry name with the group's
    enabled config entries (two apps with the same main name, hence one group). Either would
    disable every entry of the group; ``--force`` (or ``schedule retire``) says it is meant.
    """
    current = list(conn.execute(
        select(entries.c.name).where(
            entries.c.origin == "config", entries.c.schedule_group == group,
            entries.c.enabled.is_(True),
        ).order_by(entries.c.name)
    ).scalars())
    if not current:
        return None
    shown = ", ".join(current[:10]) + (", ..." if len(current) > 10 else "")
    if not names:
        return (f"this beat's beat_schedule is empty, but schedule group {group!r} has "
                f"{len(current)} enabled config entries ({shown}); not disabling them. A "
                "settings module that did not load? To disable them on purpose: "
                f"`reliable-beat schedule retire {group}`")
    if not set(names) & set(current):
        return (f"this beat's beat_schedule shares no entry with schedule group {group!r}'s "
                f"enabled config entries ({shown}): two apps with the same main name? Give "
                "one of them its own `reliable_beat_schedule_group`. If this config replaces "
                "the whole schedule on purpose: `reliable-beat -A APP schedule sync --force`")
    return None


def _renames(
    conn: Connection, defs: list[EntryDefinition], gone: list[Any]
) -> dict[str, Any]:
    """New name -> the disabled row it renames: a definition with no stored row whose
    definition (everything but the name) is that of exactly one entry this sync disables,
    and no other new definition has it too."""
    if not gone:
        return {}
    by_hash: dict[str, list[Any]] = {}
    for row in gone:
        by_hash.setdefault(row.config_hash, []).append(row)
    existing = set(conn.execute(
        select(entries.c.name).where(entries.c.name.in_([d.name for d in defs]))
    ).scalars()) if defs else set()
    new = [d for d in defs if d.name not in existing]
    hashes = [d.config_hash() for d in new]
    out: dict[str, Any] = {}
    for d, h in zip(new, hashes, strict=True):
        if len(by_hash.get(h, [])) == 1 and hashes.count(h) == 1:
            out[d.name] = by_hash[h][0]
    return out


def sync_config_entries(
    store: Store, definitions: Iterable[EntryDefinition], *, group: str = DEFAULT_GROUP,
) -> dict[str, int]:
    """:func:`sync_schedule_group` returning only the counts.

    Returns:
        Counts: ``{"inserted": n, "updated": n, "unchanged": n, "disabled": n}``.

    Raises:
        ConfigurationError: a config entry has the name of an existing runtime entry.
    """
    return sync_schedule_group(store, definitions, group=group).counts


def _note_ungrouped(conn: Connection, group: str, result: SyncResult) -> None:
    """Fill ``result.ungrouped`` when groups other than ``group`` share the store."""
    groups = sorted(set(shared_groups(conn)) | {group})
    if len(groups) > 1:
        result.ungrouped, result.groups = ungrouped_entries(conn), groups


def save_runtime_entry(
    store: Store, definition: EntryDefinition, *, create: bool, schedule_group: str | None = None,
    form: bool = False,
) -> str:
    """Add (``create=True``) or update a runtime entry.

    ``form``: the entry comes from a form (the Django admin): refusals name its fields and
    pages, not the command line's options.

    ``schedule_group``: the schedule group whose beats fire it (the app whose broker and
    workers take its triggers: ``reliable-beat -A proj entries add`` gives ``proj``'s group).
    ``None``: a new entry has no group (every beat on the store may fire it: right for a
    store of one app); an update keeps the entry's group.

    Raises:
        ConfigurationError: adding a name that exists, or updating a config entry; adding
            an entry with no group to a store that several schedule groups share (every
            group's beats would fire it, each through its own app's broker: name the group).
        EntryNotFoundError: updating a name that does not exist.
    """
    definition.origin = "runtime"
    rb_values.check_entry_name(definition.name)
    with store.begin() as conn:
        now = store.now(conn)
        row = conn.execute(
            select(entries.c.origin).where(entries.c.name == definition.name)
        ).first()
        if create and row is not None:
            raise ConfigurationError(
                f"entry {definition.name!r} already exists; "
                + ("choose another name, or edit that entry from its page in the entries "
                   "list" if form else "use `entries update` to change it"))
        if not create and row is None:
            raise EntryNotFoundError(f"no entry named {definition.name!r}")
        if row is not None and row.origin == "config":
            raise ConfigurationError(
                f"entry {definition.name!r} comes from beat_schedule; change it there"
            )
        if create and schedule_group is None:
            groups = shared_groups(conn)
            if len(groups) > 1:
                raise ConfigurationError(
                    f"entry {definition.name!r} has no schedule group, and the schedule groups "
                    f"{', '.join(repr(g) for g in groups)} share this store: the beats of every "
                    "group would fire it, each through its own app's broker. "
                    + ("Fill in the group field with the schedule group whose workers run it."
                       if form else "Name the app whose workers run it: `reliable-beat -A "
                       "proj entries add ...` or `--group GROUP`."))
        outcome = _upsert(conn, store, definition, now, group=schedule_group)
        notify_entries_changed(conn, store)
    return outcome


class _Row(SimpleNamespace):
    """A decoded entries row with ``._mapping`` like a SQLAlchemy row."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(**values)
        self._mapping = values


def _require(conn: Connection, name: str) -> Any:
    raw = conn.execute(
        select(*raw_columns(entries, conn.dialect)).where(entries.c.name == name)
    ).first()
    row = None if raw is None else _Row(decode_row(entries, dict(raw._mapping), conn.dialect)[0])
    if row is None:
        raise EntryNotFoundError(
            f"no entry named {name!r} (see `reliable-beat entries list`)"
        )
    return row


def get_entry(store: Store, name: str) -> dict[str, Any]:
    """The stored entry as a dict of its columns.

    Raises:
        EntryNotFoundError: no such entry.
    """
    with store.engine.connect() as conn:
        return dict(_require(conn, name)._mapping)  # a malformed value is kept raw


def list_entries(store: Store, *, include_disabled: bool = False) -> list[dict[str, Any]]:
    """All entries (one query, ordered by name), each with its last run's state."""
    last_state = (
        select(runs.c.state)
        .where(runs.c.entry_name == entries.c.name, runs.c.fire_at == entries.c.last_fire_at)
        .correlate(entries)
        .scalar_subquery()
    )
    stmt = select(entries, last_state.label("last_state")).order_by(entries.c.name)
    if not include_disabled:
        stmt = stmt.where(entries.c.enabled.is_(True))
    with store.engine.connect() as conn:
        # value by value: a malformed row (see reliable_beat.rows) is listed, its
        # undecodable values as their raw text, instead of failing the whole list
        rows = conn.execute(stmt.with_only_columns(
            *raw_columns(entries, conn.dialect), last_state.label("last_state")
        )).all()
        return [
            dict(decode_row(entries, dict(r._mapping), conn.dialect)[0]) for r in rows
        ]


def pause(store: Store, name: str) -> None:
    """Pause an entry: it stops firing; its grid (``next_fire_at``) is kept.

    Raises:
        EntryNotFoundError: no such entry.
    """
    with store.begin() as conn:
        _require(conn, name)
        now = store.now(conn)
        conn.execute(
            update(entries)
            .where(entries.c.name == name, entries.c.paused.is_(False))
            .values(paused=True, paused_at=now, updated_at=now)
        )


def resume(store: Store, name: str) -> None:
    """Resume a paused entry. Slots missed while paused go through the entry's misfire policy
    on the next tick, exactly like downtime (``skip`` records them, ``fire_once`` fires the
    latest, ``catch_up`` fires them): re-enabling never fires a surprise extra run.

    A ``next_fire_at`` its schedule cannot have put there (NULL while the schedule has a next
    slot, or far beyond it: a row changed by SQL, see :mod:`reliable_beat.rows.next_fire`)
    is recomputed from the schedule: its first slot after the last one, so the slots missed
    meanwhile go through the misfire policy too.

    Raises:
        EntryNotFoundError: no such entry.
    """
    with store.begin() as conn:
        _require(conn, name)
        now = store.now(conn)
        conn.execute(
            update(entries)
            .where(entries.c.name == name)
            .values(paused=False, paused_at=None, updated_at=now)
        )
        # A quarantined entry (malformed row, see reliable_beat.rows) is enabled again: the
        # beat checks the row once more at its next claim and quarantines it again if the
        # problem is still there.
        conn.execute(
            update(entries)
            .where(entries.c.name == name, entries.c.quarantine_reason.is_not(None))
            .values(enabled=True, quarantine_reason=None, quarantined_at=None)
        )
        row = _read_for_upsert(conn, name)
        if row is not None:
            bad_next, repaired = _next_fire_repair(row, now)
            if bad_next:
                conn.execute(update(entries).where(entries.c.id == row.id)
                             .values(next_fire_at=repaired, updated_at=now))
        notify_entries_changed(conn, store)


def remove(store: Store, name: str) -> None:
    """Remove a runtime entry (its runs stay as history). Config entries are refused.

    Raises:
        EntryNotFoundError: no such entry.
        ConfigurationError: the entry comes from ``beat_schedule``.
    """
    with store.begin() as conn:
        row = _require(conn, name)
        if row.origin == "config":
            raise ConfigurationError(
                f"entry {name!r} comes from beat_schedule; remove it there (it will be disabled)"
            )
        conn.execute(entries.delete().where(entries.c.name == name))
