"""Entries as an operator edits them: parameters validated into an
:class:`~reliable_beat.entries.EntryDefinition` exactly as a beat validates a beat_schedule
entry (:func:`build_definition`, behind ``reliable-beat entries add|update`` and the Django
admin's runtime entry form), the check behind resuming a quarantined entry
(:func:`quarantine_problems`), and a schedule in words (:func:`schedule_text`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select

from reliable_beat import schedules as sch
from reliable_beat.adapters import task_function_checker
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries as entries_table
from reliable_beat.entries import EntryDefinition, definition_from_celery
from reliable_beat.errors import ConfigurationError, EntryValidationError
from reliable_beat.ops.context import OperatorContext
from reliable_beat.ops.describe import task_kind
from reliable_beat.rows import column_of, raw_columns, read_entry

__all__ = [
    "POLICY_OPTIONS",
    "build_definition",
    "parse_instant",
    "quarantine_problems",
    "schedule_text",
    "task_checker",
]

#: Options of ``add`` / ``update`` that land in ``options["reliable_beat"]``.
POLICY_OPTIONS = (
    "misfire_policy", "misfire_grace", "catch_up_limit", "overlap_policy", "dst_nonexistent",
    "dst_repeated",
)


def schedule_text(spec: dict[str, Any]) -> str:
    """A schedule spec as one short line, e.g. ``cron '0 2 * * *' Europe/Berlin``.

    A Celery ``crontab`` restricting both day fields keeps Celery's meaning (both must
    match, ``day_or`` False): the line says so, ``cron '0 22 1-7 * 6' with day-of-month AND
    day-of-week (Celery crontab) UTC``, since the bare string as ``--cron`` means either
    (POSIX)."""
    if not isinstance(spec, dict):  # a malformed (quarantined) row: show what is stored
        return f"malformed: {spec!r:.60}"
    kind = spec.get("kind")
    tz = spec.get("timezone", "UTC")
    if kind == "cron":
        expr = spec.get("expr")
        fields = expr.split() if isinstance(expr, str) else []
        if spec.get("day_or") is False and len(fields) >= 5 and "*" not in (fields[2],
                                                                            fields[4]):
            # a Celery crontab: both day fields must match; the bare string means either
            return f"cron '{expr}' with day-of-month AND day-of-week (Celery crontab) {tz}"
        return f"cron '{expr}' {tz}"
    if kind == "interval":
        return f"every {spec.get('every_seconds')}s"
    if kind == "once":
        return f"once at {spec.get('at')}"
    return json.dumps(spec)


def _option(what: str, form: bool) -> str:
    """How a problem names an input: ``--args`` on the command line, ``the args field`` in
    a form (the Django admin)."""
    return f"the {what} field" if form else f"--{what}"


def _parse_json(value: str | None, what: str, kind: type, problems: list[str], name: str,
                form: bool = False) -> Any:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        example = '[1, "a"]' if kind is list else '{"day": "mon"}'
        problems.append(f"entry {name!r}: {_option(what, form)} is not JSON ({exc.msg} at "
                        f"column {exc.colno}); e.g. "
                        + (example if form else f"--{what} '{example}'"))
        return None
    if not isinstance(parsed, kind):
        problems.append(f"entry {name!r}: {_option(what, form)} must be a JSON "
                        f"{'array' if kind is list else 'object'}, got {type(parsed).__name__}")
        return None
    return parsed


def parse_instant(value: str, what: str, problems: list[str], name: str) -> datetime | None:
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        problems.append(f"entry {name!r}: {what}={value!r} is not an ISO 8601 instant; "
                        "e.g. 2026-05-01T02:00:00+02:00")
        return None
    if at.tzinfo is None or at.utcoffset() is None:
        problems.append(f"entry {name!r}: {what}={value!r} has no UTC offset; naive times are "
                        "never guessed: add Z or +HH:MM")
        return None
    return at


def task_checker(app: Any) -> Callable[[str], bool | None] | None:
    if app is None:
        return None

    def is_idempotent(task: str) -> bool | None:
        kind = task_kind(app, task)
        return None if kind == "unknown" else kind == "idempotent"

    return is_idempotent


def build_definition(
    ctx: OperatorContext,
    name: str,
    params: dict[str, Any],
    *,
    existing: dict[str, Any] | None = None,
    form: bool = False,
) -> EntryDefinition:
    """Validate command-line options into an :class:`EntryDefinition`, like the beat does.

    Args:
        ctx: the app (optional), the store and the settings (the command line's
            :class:`~reliable_beat.cli.CliContext`, or an
            :class:`~reliable_beat.ops.context.Operator`).
        name: the entry name.
        params: the click parameters of ``add`` / ``update`` (None = not given).
        existing: for ``update``, the stored entry: values not given are kept.
        form: the values come from a form's fields (the Django admin), not options: the
            problems name fields (``the cron field``), not ``--cron``.

    Raises:
        EntryValidationError: every problem found (parsing and the beat's own validation),
            each naming the entry and the fix.
    """
    problems: list[str] = []
    raw: dict[str, Any] = {}
    rb: dict[str, Any] = {}
    options: dict[str, Any] = {}
    if existing is not None:
        raw["task"] = existing["task"]
        raw["args"] = existing["args"]
        raw["kwargs"] = existing["kwargs"]
        # A malformed stored value (a quarantined row, see reliable_beat.rows) is not
        # carried over: args / kwargs must then be given again; options start empty.
        for what, kind in (("args", list), ("kwargs", dict)):
            if not isinstance(existing[what], kind) and params.get(what) is None:
                problems.append(f"entry {name!r}: the stored {what} {existing[what]!r:.80} "
                                f"are malformed: give {_option(what, form)}")
        options = dict(existing["options"]) if isinstance(existing["options"], dict) else {}
        rb = {
            "misfire_policy": existing["misfire_policy"],
            "misfire_grace": existing["misfire_grace_seconds"],
            "catch_up_limit": existing["catch_up_limit"],
            "overlap_policy": existing["overlap_policy"],
            "timezone": existing["timezone"],
        }
        if existing["catch_up_window_seconds"] is not None:
            rb["catch_up_window"] = existing["catch_up_window_seconds"]
        for key in ("start_at", "end_at"):
            if existing[key] is not None:
                rb[key] = existing[key]
    if params.get("task") is not None:
        raw["task"] = params["task"]
    args = _parse_json(params.get("args"), "args", list, problems, name, form)
    if args is not None:
        raw["args"] = args
    kwargs = _parse_json(params.get("kwargs"), "kwargs", dict, problems, name, form)
    if kwargs is not None:
        raw["kwargs"] = kwargs
    if params.get("queue") is not None:
        options["queue"] = params["queue"]
    for key in POLICY_OPTIONS:
        if params.get(key) is not None:
            rb[key] = params[key]
    if params.get("timezone") is not None:
        rb["timezone"] = params["timezone"]
    # An entry without a zone of its own runs in the app's zone, as a beat_schedule entry
    # does (Celery's app.timezone); without -A there is no app zone: UTC.
    app_zone = ctx.app_timezone
    tz = rb.get("timezone") or app_zone

    given = [k for k in ("cron", "every", "at") if params.get(k) is not None]
    schedule_options = ("the cron, every or at field (a cron expression, an interval in "
                        "seconds or a one-off ISO 8601 instant)" if form else
                        "--cron EXPR, --every SECONDS or --at ISO-INSTANT")
    if len(given) > 1:
        if form:
            problems.append(f"entry {name!r}: fill in only one of the cron, every and at "
                            f"fields (got {', '.join(given)})")
        else:
            problems.append(f"entry {name!r}: give one of --cron, --every, --at (got "
                            f"{', '.join('--' + g for g in given)})")
    elif given == ["cron"]:
        raw["schedule"] = params["cron"]
    elif given == ["every"]:
        raw["schedule"] = params["every"]
    elif given == ["at"]:
        at = parse_instant(params["at"], "at" if form else "--at", problems, name)
        if at is not None:
            try:
                raw["schedule"] = sch.OneOffSchedule(at, sch.validate_timezone(tz))
            except ConfigurationError:
                raw["schedule"] = sch.OneOffSchedule(at)  # the zone problem is reported below
    elif existing is not None:
        stored = existing["schedule"]
        try:
            spec = dict(stored, timezone=tz)
            try:
                raw["schedule"] = sch.schedule_from_spec(spec)
            except ConfigurationError:
                raw["schedule"] = sch.schedule_from_spec(stored)
        except (ConfigurationError, TypeError, ValueError) as exc:
            # a malformed stored schedule (a quarantined row): keeping it is impossible, so
            # the update must give a new one; say so, as the quarantine message does
            problems.append(
                f"entry {name!r}: its stored schedule is unusable ({exc}); give a new one "
                f"in {schedule_options}" if form else
                f"entry {name!r}: its stored schedule is unusable ({exc}); give a new one "
                f"with {schedule_options}, e.g. "
                f"`reliable-beat entries update {name} --every 60 ...`"
            )
    else:
        problems.append(f"entry {name!r}: no schedule: "
                        + (f"fill in {schedule_options}" if form else f"give {schedule_options}"))
    if options:
        raw["options"] = dict(options, reliable_beat=rb)
    else:
        raw["options"] = {"reliable_beat": rb}

    app = ctx.app
    if (
        app is not None
        and isinstance(raw.get("task"), str)
        and task_kind(app, raw["task"]) == "unknown"
    ):
        problems.append(
            f"entry {name!r}: task {raw['task']!r} is not registered in app "
            f"{getattr(app, 'main', app)!r}; check the name (see `celery -A APP inspect "
            "registered`) or import the module that defines it"
        )
    with ctx.store.engine.connect() as conn:
        now = ctx.store.now(conn)
    definition: EntryDefinition | None = None
    try:
        definition = definition_from_celery(
            name, raw, default_timezone=app_zone, settings=ctx.settings, now=now,
            origin="runtime", is_idempotent=task_checker(app),
            task_function=task_function_checker(app),
        )
    except EntryValidationError as exc:
        problems.extend(p for p in exc.problems if p not in problems)
    if problems or definition is None:
        raise EntryValidationError(problems)
    return definition


def quarantine_problems(store: Store, name: str) -> list[str]:
    """The problems the beat would find now in the quarantined entry ``name`` (a
    :class:`~reliable_beat.db.dialects.Store`), one string each; empty when the entry is not
    quarantined or its row has been repaired (an unknown name: empty too, left to
    :func:`~reliable_beat.entries.resume` to report). ``entries resume`` and the Django
    admin's resume refuse a row that is still malformed."""
    with store.engine.connect() as conn:
        raw = conn.execute(select(*raw_columns(entries_table, conn.dialect))
                           .where(entries_table.c.name == name)).first()
        if raw is None:
            return []
        values, problems, _ = read_entry(dict(raw._mapping), conn.dialect)
    if values.get("next_fire_at") is None:
        # resume recomputes a NULL next_fire_at from the schedule (reliable_beat.rows.
        # next_fire): not a problem left for a person
        problems = [p for p in problems if column_of(p) != "next_fire_at"]
    return problems if values.get("quarantine_reason") else []
