"""Import entries from RedBeat and django-celery-beat, so a move to reliable_beat keeps every
entry and runs no slot twice at the cutover.

Both readers return :class:`ForeignEntry` values in ``beat_schedule`` form, and
:func:`import_entries` validates them exactly as the beat validates ``beat_schedule``
(:func:`reliable_beat.entries.definition_from_celery`), then writes them as **runtime**
entries in one transaction: all of them or, if any is invalid, none (unless
``skip_invalid``).

The cutover rule: an entry whose old scheduler recorded a ``last_run_at`` starts at the first
slot strictly after it. The slot the old scheduler already sent is not sent again, and a slot
that fell between the old beat's stop and the import is due at once and goes through the
entry's misfire policy, like any downtime. Interval entries keep their cadence: the grid is
anchored at the old ``last_run_at`` (whole seconds).

Sources:

* RedBeat (https://github.com/sibson/redbeat): one Redis hash per entry at
  ``<redbeat_key_prefix><name>`` with a ``definition`` (JSON, RedBeat's own encoding, read with
  its own decoder) and a ``meta`` (``last_run_at``).
* django-celery-beat (https://django-celery-beat.readthedocs.io/): the ``PeriodicTask`` table
  and its ``CrontabSchedule`` / ``IntervalSchedule`` / ``ClockedSchedule`` rows, read with
  SQLAlchemy Core (Django is not needed). ``start_time`` becomes ``start_at``, ``expires``
  becomes ``end_at``, ``expire_seconds`` the message expiry, a clocked or ``one_off`` task a
  one-off entry. Solar schedules are refused (no stable slots), as in ``beat_schedule``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa
from sqlalchemy import select, update

from reliable_beat import schedules as sch
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries
from reliable_beat.entries import (
    EntryDefinition,
    _upsert,
    definition_from_celery,
    notify_entries_changed,
)
from reliable_beat.errors import (
    ConfigurationError,
    EntryValidationError,
    StoreUnavailableError,
)
from reliable_beat.redaction import redact_text, redact_url
from reliable_beat.settings import Settings

__all__ = [
    "ForeignEntry",
    "ImportOutcome",
    "import_entries",
    "read_django_celery_beat",
    "read_redbeat",
]

#: Celery's own housekeeping entry, which both RedBeat and django-celery-beat persist; the
#: app's beat installs it by itself, so importing it would run it twice.
CELERY_BUILTIN_ENTRIES = frozenset({"celery.backend_cleanup"})


@dataclass
class ForeignEntry:
    """One entry read from another scheduler, in ``beat_schedule`` form.

    Attributes:
        name: the entry name.
        raw: a ``beat_schedule`` item (``task``, ``schedule`` as a Celery schedule object or a
            :class:`~reliable_beat.schedules.Schedule`, ``args``, ``kwargs``, ``options`` with
            ``options["reliable_beat"]``).
        enabled: False imports the entry paused.
        last_run_at: UTC-aware instant the old scheduler last sent it, or None.
        problems: why it cannot be imported as it stands (each names the entry and the fix).
        source: where it was read (for messages), e.g. ``redbeat:nightly``.
    """

    name: str
    raw: dict[str, Any]
    enabled: bool = True
    last_run_at: datetime | None = None
    problems: list[str] = field(default_factory=list)
    source: str = ""


@dataclass
class ImportOutcome:
    """What :func:`import_entries` did with one entry.

    Attributes:
        name: the entry name.
        action: ``imported``, ``exists`` (a reliable_beat entry of that name is kept as it
            is), ``skipped`` (Celery's built-in entry, or invalid with ``skip_invalid``).
        detail: a human sentence.
        next_fire_at: the first slot reliable_beat will fire (UTC), for ``imported``.
        paused: imported paused (it was disabled in the old scheduler).
    """

    name: str
    action: str
    detail: str = ""
    next_fire_at: datetime | None = None
    paused: bool = False


def _utc(value: datetime | None, naive_zone: str) -> datetime | None:
    if value is None:
        return None
    if value.tzinfo is None or value.utcoffset() is None:
        value = value.replace(tzinfo=ZoneInfo(naive_zone))
    return value.astimezone(timezone.utc)


# -- RedBeat ------------------------------------------------------------------------------


def read_redbeat(redis_url: str, *, key_prefix: str = "redbeat:") -> list[ForeignEntry]:
    """Read every RedBeat entry stored under ``key_prefix`` in the Redis at ``redis_url``.

    Args:
        redis_url: RedBeat's ``redbeat_redis_url`` (e.g. ``redis://host:6379/1``).
        key_prefix: RedBeat's ``redbeat_key_prefix`` (default ``redbeat:``).

    Returns:
        The entries sorted by name. Read-only: nothing in Redis changes.

    Raises:
        ConfigurationError: ``celery-redbeat`` (and ``redis``) are not installed.
        StoreUnavailableError: the Redis cannot be reached.
    """
    try:
        import redis
        from redbeat.decoder import RedBeatJSONDecoder  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "reading RedBeat entries needs celery-redbeat: pip install 'reliable-beat[redbeat]'"
        ) from exc
    try:
        client = redis.Redis.from_url(redis_url)
    except (ValueError, TypeError):  # its text quotes pieces of the URL: not chained
        raise ConfigurationError(
            f"RedBeat's Redis URL {_safe(redis_url)!r} cannot be parsed; expected "
            "redis://[:password@]host[:port]/db (percent-encode '@', ':' and '/' in a password)"
        ) from None
    reserved = {f"{key_prefix}:schedule", f"{key_prefix}:statics", f"{key_prefix}:lock"}
    found: list[ForeignEntry] = []
    try:
        keys = sorted(
            k.decode() for k in client.scan_iter(match=_glob_escape(key_prefix) + "*", count=500)
        )
        for key in keys:
            if key in reserved or client.type(key) != b"hash":
                continue
            definition, meta = client.hmget(key, ["definition", "meta"])
            if not definition:
                continue
            found.append(_from_redbeat(key, key_prefix, definition, meta, RedBeatJSONDecoder))
    except redis.RedisError as exc:
        raise StoreUnavailableError(
            f"RedBeat's Redis at {_safe(redis_url)}: {redact_text(exc)}") from exc
    finally:
        client.close()
    return sorted(found, key=lambda e: e.name)


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def _safe(url: str) -> str:
    return redact_url(url)


def _from_redbeat(
    key: str, prefix: str, definition: bytes | str, meta: bytes | str | None,
    decoder: type[json.JSONDecoder],
) -> ForeignEntry:
    fallback = key[len(prefix):]
    try:
        d = json.loads(definition, cls=decoder)
        m = json.loads(meta, cls=decoder) if meta else {}
    except (ValueError, TypeError) as exc:
        return ForeignEntry(
            fallback, {}, problems=[f"entry {fallback!r}: unreadable RedBeat definition at "
                                    f"{key!r} ({exc}); fix or delete the key"], source=key)
    name = str(d.get("name") or fallback)
    entry = ForeignEntry(name, {}, enabled=bool(d.get("enabled", True)), source=key)
    schedule = d.get("schedule")
    if type(schedule).__name__ == "rrule":
        entry.problems.append(
            f"entry {name!r}: RedBeat rrule schedules have no reliable_beat equivalent; "
            "re-create it with a cron expression or an interval (`reliable-beat entries add`)")
    if type(schedule).__name__ == "schedule":  # an interval: keep its cadence
        schedule = timedelta(seconds=schedule.run_every.total_seconds())
    options = dict(d.get("options") or {})
    entry.raw = {
        "task": d.get("task"),
        "schedule": schedule,
        "args": list(d.get("args") or []),
        "kwargs": dict(d.get("kwargs") or {}),
        "options": options,
    }
    last = m.get("last_run_at") if isinstance(m, dict) else None
    entry.last_run_at = _utc(last, "UTC") if isinstance(last, datetime) else None
    if isinstance(schedule, timedelta) and entry.last_run_at is not None:
        options["reliable_beat"] = {"anchor": entry.last_run_at.replace(microsecond=0)}
    return entry


# -- django-celery-beat -------------------------------------------------------------------

_meta = sa.MetaData()
_dcb_task = sa.Table(
    "django_celery_beat_periodictask", _meta,
    sa.Column("id", sa.Integer), sa.Column("name", sa.String), sa.Column("task", sa.String),
    sa.Column("interval_id", sa.Integer), sa.Column("crontab_id", sa.Integer),
    sa.Column("solar_id", sa.Integer), sa.Column("clocked_id", sa.Integer),
    sa.Column("args", sa.Text), sa.Column("kwargs", sa.Text), sa.Column("queue", sa.String),
    sa.Column("exchange", sa.String), sa.Column("routing_key", sa.String),
    sa.Column("headers", sa.Text), sa.Column("priority", sa.Integer),
    sa.Column("expires", sa.DateTime), sa.Column("expire_seconds", sa.Integer),
    sa.Column("one_off", sa.Boolean), sa.Column("start_time", sa.DateTime),
    sa.Column("enabled", sa.Boolean), sa.Column("last_run_at", sa.DateTime),
)
_dcb_cron = sa.Table(
    "django_celery_beat_crontabschedule", _meta,
    sa.Column("id", sa.Integer), sa.Column("minute", sa.String), sa.Column("hour", sa.String),
    sa.Column("day_of_week", sa.String), sa.Column("day_of_month", sa.String),
    sa.Column("month_of_year", sa.String), sa.Column("timezone", sa.String),
)
_dcb_interval = sa.Table(
    "django_celery_beat_intervalschedule", _meta,
    sa.Column("id", sa.Integer), sa.Column("every", sa.Integer), sa.Column("period", sa.String),
)
_dcb_clocked = sa.Table(
    "django_celery_beat_clockedschedule", _meta,
    sa.Column("id", sa.Integer), sa.Column("clocked_time", sa.DateTime),
)
_PERIOD_SECONDS = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}


def read_django_celery_beat(
    database_url: str, *, naive_timezone: str = "UTC"
) -> list[ForeignEntry]:
    """Read every ``PeriodicTask`` of django-celery-beat from the database at ``database_url``.

    Args:
        database_url: the Django database as a SQLAlchemy URL (e.g.
            ``postgresql+psycopg://user:pw@host/app``).
        naive_timezone: IANA zone for timestamps stored without one (Django ``USE_TZ=False``
            stores local time in ``TIME_ZONE``): pass that ``TIME_ZONE``.

    Returns:
        The entries sorted by name. Read-only: nothing in the database changes.

    Raises:
        ConfigurationError: the django-celery-beat tables are not there (wrong database?).
        StoreUnavailableError: the database cannot be reached.
    """
    sch.validate_timezone(naive_timezone)
    try:
        engine = sa.create_engine(database_url, hide_parameters=True)
    except Exception:  # its text may quote pieces of the URL: not chained
        raise ConfigurationError(
            f"the django-celery-beat database URL {_safe(database_url)!r} is not a "
            "SQLAlchemy URL (percent-encode '@', ':' and '/' in a password)"
        ) from None
    j = (
        _dcb_task.outerjoin(_dcb_cron, _dcb_cron.c.id == _dcb_task.c.crontab_id)
        .outerjoin(_dcb_interval, _dcb_interval.c.id == _dcb_task.c.interval_id)
        .outerjoin(_dcb_clocked, _dcb_clocked.c.id == _dcb_task.c.clocked_id)
    )
    stmt = select(
        _dcb_task,
        _dcb_cron.c.minute, _dcb_cron.c.hour, _dcb_cron.c.day_of_week,
        _dcb_cron.c.day_of_month, _dcb_cron.c.month_of_year,
        _dcb_cron.c.timezone.label("cron_timezone"),
        _dcb_interval.c.every, _dcb_interval.c.period, _dcb_clocked.c.clocked_time,
    ).select_from(j).order_by(_dcb_task.c.name)
    try:
        with engine.connect() as conn:
            rows = list(conn.execute(stmt))
    except sa.exc.ProgrammingError as exc:
        raise ConfigurationError(
            f"no django-celery-beat tables at {_safe(database_url)} ({exc.orig}); pass the "
            "Django project's database URL (run its `manage.py migrate django_celery_beat`)"
        ) from exc
    except sa.exc.OperationalError as exc:
        msg = str(exc.orig)
        if "no such table" in msg:
            raise ConfigurationError(
                f"no django-celery-beat tables at {_safe(database_url)} ({msg})") from exc
        raise StoreUnavailableError(f"database at {_safe(database_url)}: {msg}") from exc
    finally:
        engine.dispose()
    return [_from_django(r._mapping, naive_timezone) for r in rows]


def _from_django(r: Any, naive_zone: str) -> ForeignEntry:
    from celery.schedules import crontab

    name = r["name"]
    entry = ForeignEntry(name, {}, enabled=bool(r["enabled"]),
                         last_run_at=_utc(r["last_run_at"], naive_zone),
                         source=f"django_celery_beat_periodictask id={r['id']}")

    def bad(msg: str) -> None:
        entry.problems.append(f"entry {name!r}: {msg}")

    rb: dict[str, Any] = {}
    schedule: Any = None
    if r["solar_id"] is not None:
        bad("solar schedules are not supported (their instants move every day, so there are "
            "no stable slots); re-create it with a cron expression in the zone you need")
    elif r["clocked_id"] is not None:
        at = _utc(r["clocked_time"], naive_zone)
        schedule = sch.OneOffSchedule(at) if at is not None else None
    elif r["crontab_id"] is not None:
        rb["timezone"] = str(r["cron_timezone"] or "UTC")
        try:
            schedule = crontab(minute=r["minute"], hour=r["hour"], day_of_week=r["day_of_week"],
                               day_of_month=r["day_of_month"],
                               month_of_year=r["month_of_year"])
        except (ValueError, TypeError) as exc:
            bad(f"crontab {r['minute']} {r['hour']} {r['day_of_month']} {r['month_of_year']} "
                f"{r['day_of_week']} is invalid ({exc}); fix it in the Django admin")
    elif r["interval_id"] is not None:
        unit = _PERIOD_SECONDS.get(str(r["period"]))
        if unit is None:
            bad(f"interval period {r['period']!r} is not supported: slots are whole seconds")
        else:
            schedule = timedelta(seconds=int(r["every"]) * unit)
            if entry.last_run_at is not None:  # keep the old cadence: the grid runs through it
                rb["anchor"] = entry.last_run_at.replace(microsecond=0)
    else:
        bad("has no schedule (interval, crontab, solar or clocked); give it one or delete it")
    if r["one_off"] and schedule is not None and r["clocked_id"] is None:
        if entry.last_run_at is not None:
            entry.enabled = False  # it ran already: Celery disables a one_off after one run
        start = _utc(r["start_time"], naive_zone)
        base = max(x for x in (datetime.now(timezone.utc), start) if x is not None)
        try:
            first = sch.from_celery(schedule, timezone=rb.get("timezone", "UTC"),
                                    anchor=base.replace(microsecond=0), entry=name)
            at = first.next_after(base - timedelta(microseconds=1))
            schedule = sch.OneOffSchedule(at) if at is not None else schedule
            rb.pop("anchor", None)
        except ConfigurationError as exc:
            bad(str(exc).replace(f"entry {name!r}: ", ""))
    options: dict[str, Any] = {}
    for key in ("queue", "exchange", "routing_key"):
        if r[key]:
            options[key] = r[key]
    if r["priority"] is not None:
        options["priority"] = int(r["priority"])
    if r["expire_seconds"]:
        options["expires"] = int(r["expire_seconds"])
    args = _json_field(r["args"], "args", list, bad)
    kwargs = _json_field(r["kwargs"], "kwargs", dict, bad)
    headers = _json_field(r["headers"], "headers", dict, bad)
    if headers:
        options["headers"] = headers
    if r["start_time"] is not None:
        rb["start_at"] = _utc(r["start_time"], naive_zone)
    if r["expires"] is not None:
        rb["end_at"] = _utc(r["expires"], naive_zone)
    options["reliable_beat"] = rb
    entry.raw = {"task": r["task"], "schedule": schedule, "args": args or [],
                 "kwargs": kwargs or {}, "options": options}
    return entry


def _json_field(text: str | None, what: str, kind: type, bad: Callable[[str], None]) -> Any:
    if text in (None, ""):
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        bad(f"{what} is not JSON ({exc}); fix it in the Django admin")
        return None
    if value is not None and not isinstance(value, kind):
        bad(f"{what} must be a JSON {kind.__name__}, got {type(value).__name__}")
        return None
    return value


# -- the import -----------------------------------------------------------------------------


def import_entries(
    store: Store,
    foreign: Iterable[ForeignEntry],
    *,
    settings: Settings,
    default_timezone: str = "UTC",
    is_idempotent: Callable[[str], bool | None] | None = None,
    is_registered: Callable[[str], bool] | None = None,
    skip_invalid: bool = False,
    dry_run: bool = False,
    schedule_group: str | None = None,
) -> list[ImportOutcome]:
    """Validate ``foreign`` entries and write them as runtime entries, in one transaction.

    Args:
        store: the reliable_beat store.
        foreign: entries from :func:`read_redbeat` / :func:`read_django_celery_beat`.
        settings: policy defaults for the imported entries (misfire, overlap, grace).
        default_timezone: the zone of schedules that carry none (Celery's ``timezone``).
        is_idempotent / is_registered: task checks against the app (None: not checked).
        skip_invalid: import the valid entries and report the rest as ``skipped``.
        dry_run: validate and compute everything, write nothing.
        schedule_group: the schedule group of the imported entries (the app whose beats fire
            them and whose workers take their triggers); None: no group (any beat).

    Returns:
        One :class:`ImportOutcome` per entry, in input order.

    Raises:
        EntryValidationError: some entries are invalid (all problems listed, each naming the
            entry and the fix) and ``skip_invalid`` is False; nothing was written.
        StoreUnavailableError: the store cannot be reached.
    """
    items = list(foreign)
    with store.engine.connect() as conn:
        now = store.now(conn)
    outcomes: list[ImportOutcome] = []
    planned: list[tuple[ForeignEntry, EntryDefinition]] = []
    problems: list[str] = []
    for item in items:
        if item.name in CELERY_BUILTIN_ENTRIES:
            outcomes.append(ImportOutcome(item.name, "skipped",
                                          "Celery's built-in entry: the app's beat adds it"))
            continue
        found = list(item.problems)
        task = item.raw.get("task")
        if is_registered is not None and isinstance(task, str) and not is_registered(task):
            found.append(f"entry {item.name!r}: task {task!r} is not registered in the app; "
                         "import the module that defines it (or pass the right -A APP)")
        definition = None
        if not item.problems:
            try:
                definition = definition_from_celery(
                    item.name, item.raw, default_timezone=default_timezone, settings=settings,
                    now=now, origin="runtime", is_idempotent=is_idempotent)
            except EntryValidationError as exc:
                found.extend(p for p in exc.problems if p not in found)
        if found or definition is None:
            problems.extend(found)
            outcomes.append(ImportOutcome(item.name, "skipped", "; ".join(found)))
            continue
        planned.append((item, definition))
        outcomes.append(ImportOutcome(item.name, "imported"))
    if problems and not skip_invalid:
        error = EntryValidationError(problems)
        error.args = (f"{error.args[0]}\nnothing was imported; fix these, or pass "
                      "--skip-invalid to import the others",)
        raise error
    by_name = {o.name: o for o in outcomes}
    with store.engine.connect() as conn:
        tx = conn.begin()
        try:
            existing = set(conn.execute(
                select(entries.c.name).where(entries.c.name.in_([i.name for i, _ in planned]))
            ).scalars()) if planned else set()
            for item, definition in planned:
                outcome = by_name[item.name]
                if item.name in existing:
                    outcome.action = "exists"
                    outcome.detail = "a reliable_beat entry of this name exists; left as it is"
                    continue
                _upsert(conn, store, definition, now, group=schedule_group)
                next_fire_at = _cutover_slot(definition, item.last_run_at, now)
                values: dict[str, Any] = {"next_fire_at": next_fire_at}
                if not item.enabled:
                    values.update(paused=True, paused_at=now)
                conn.execute(update(entries).where(entries.c.name == item.name).values(**values))
                outcome.next_fire_at = next_fire_at
                outcome.paused = not item.enabled
                outcome.detail = (
                    f"from {item.source}" + (f", last run {item.last_run_at:%Y-%m-%dT%H:%M:%SZ}"
                                             if item.last_run_at else ", never ran"))
            notify_entries_changed(conn, store)
            if dry_run:
                tx.rollback()
            else:
                tx.commit()
        except BaseException:
            if tx.is_active:
                tx.rollback()
            raise
    return outcomes


def _cutover_slot(
    definition: EntryDefinition, last_run_at: datetime | None, now: datetime
) -> datetime | None:
    """The first slot to fire: strictly after the old scheduler's last run (so a slot missed
    at the cutover is due at once and meets the misfire policy), else strictly after now.
    A one-off (a clocked task) whose instant passed without a run is due at once too (the old
    beat would have run it at its next start)."""
    after = last_run_at if last_run_at is not None and last_run_at < now else now
    return definition.first_fire_at(after, one_off_fired_through=last_run_at)


def summary(outcomes: Sequence[ImportOutcome]) -> dict[str, int]:
    """Counts by action, e.g. ``{"imported": 3, "exists": 1, "skipped": 0}``."""
    counts = {"imported": 0, "exists": 0, "skipped": 0}
    for o in outcomes:
        counts[o.action] = counts.get(o.action, 0) + 1
    return counts

