"""``reliable-beat entries ...``: list, show, add, update, remove, pause, resume, trigger,
backfill, describe and import entries.

Runtime entries (``origin='runtime'``) are created and changed here; config entries come from
``beat_schedule`` and can only be paused, resumed, triggered, backfilled and described.

Exit codes: 0 done; 1 no such entry or the database is unavailable; 2 bad input (the same
message the beat gives at start, naming the entry and the fix; nothing is written).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from functools import wraps
from typing import Any, TypeVar

import click

from reliable_beat.adapters import DEFAULT_ADAPTER, load_adapter
from reliable_beat.cli import CliContext, fail, jsonable, pass_cli
from reliable_beat.db.types import infinity_text
from reliable_beat.entries import (
    get_entry,
    list_entries,
    pause,
    remove,
    resume,
    save_runtime_entry,
)
from reliable_beat.errors import (
    ConfigurationError,
    EntryNotFoundError,
    EntryValidationError,
    StoreUnavailableError,
)
from reliable_beat.groups import schedule_group_of
from reliable_beat.ops import actions as ops_actions
from reliable_beat.ops import describe as ops_describe
from reliable_beat.ops.entries import (
    build_definition,
    parse_instant,
    quarantine_problems,
    schedule_text,
    task_checker,
)
from reliable_beat.policies import MAX_CATCH_UP_LIMIT
from reliable_beat.redaction import redact_value
from reliable_beat.rows import entry_checker

__all__ = ["build_definition", "entries", "register"]

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Map library errors to exit codes: bad input 2, not found / database down 1 (printed
    by :func:`~reliable_beat.cli.fail`: text or, with ``--json``, JSON)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EntryNotFoundError as exc:
            fail(str(exc), 1, kind="not_found")
        except ConfigurationError as exc:
            fail(str(exc), 2, kind="invalid", problems=getattr(exc, "problems", None))
        except StoreUnavailableError as exc:
            fail(str(exc), 1, kind="store_unavailable")

    return wrapper  # type: ignore[return-value]


def _fmt(at: datetime | None) -> str:
    if at is not None and not isinstance(at, datetime):  # a malformed row's raw value
        return f"malformed: {at!r:.40}"
    if infinity_text(at) is not None:  # PostgreSQL 'infinity' (a malformed row)
        return f"malformed: {infinity_text(at)}"
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if at else "-"


def _done(cli: CliContext, as_json: bool, outcome: str, name: str, text: str) -> None:
    if as_json:
        cli.echo_json({"outcome": outcome, "entry": name})
    else:
        click.echo(text)


def _status(row: dict[str, Any]) -> str:
    if row.get("quarantine_reason"):
        return "quarantined"
    if not row["enabled"]:
        return "disabled"
    if row["paused"]:
        return "paused"
    return "active" if row["next_fire_at"] is not None else "ended"


def _public(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in ("id", "config_hash")}
    out["status"] = _status(row)
    return out


def _schedule_options(fn: F) -> F:
    opts = [
        click.option("--task", help="Registered Celery task name."),
        click.option("--cron", help="Cron string (croniter syntax; 6 fields = seconds LAST)."),
        click.option("--every", type=click.IntRange(min=1), help="Interval in whole seconds."),
        click.option("--at", help="One-off instant, ISO 8601 with offset (e.g. ...T02:00:00Z)."),
        click.option("--timezone", help="IANA zone the cron is evaluated in (default: the "
                     "app's timezone with -A, as for beat_schedule entries; else UTC)."),
        click.option("--args", help="Positional arguments as a JSON array."),
        click.option("--kwargs", help="Keyword arguments as a JSON object."),
        click.option("--queue", help="Queue to publish the trigger to."),
        click.option("--misfire-policy", type=click.Choice(["skip", "fire_once", "catch_up"])),
        click.option("--misfire-grace", type=click.FloatRange(min=0),
                     help="Seconds a slot may be late and still count as on time."),
        click.option("--catch-up-limit", type=click.IntRange(min=0, max=MAX_CATCH_UP_LIMIT),
                     help="Most missed slots catch_up fires."),
        click.option("--overlap-policy", type=click.Choice(["allow", "skip", "buffer_one"])),
        click.option("--dst-nonexistent", type=click.Choice(["shift", "gap_end", "skip"]),
                     help="Cron only: what a local time inside a DST gap gets."),
        click.option("--dst-repeated", type=click.Choice(["first", "last", "both"]),
                     help="Cron only: what a local time that occurs twice gets."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@click.group("entries")
def entries() -> None:
    """List, add, change, pause, trigger and backfill entries."""


#: ``--json``: the command prints its data as JSON (:meth:`CliContext.echo_json`).
_json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _entry_command(name: str) -> Callable[[F], click.Command]:
    """``entries <name> NAME [--json]``: what every one-entry command has (the argument, the
    flag, the :class:`~reliable_beat.cli.CliContext` and :func:`handle_errors`)."""

    def decorate(fn: F) -> click.Command:
        command = click.argument("name")(_json_option(pass_cli(handle_errors(fn))))
        return entries.command(name)(command)

    return decorate


def _echo_entry(cli: CliContext, as_json: bool, outcome: str, name: str,
                text: Callable[[dict[str, Any]], str]) -> None:
    """Print entry ``name`` as it is now after ``outcome``: ``{"outcome", "entry"}`` with
    ``--json``, else the line ``text(row)``."""
    row = get_entry(cli.store, name)
    if as_json:
        cli.echo_json({"outcome": outcome, "entry": _public(row)})
    else:
        click.echo(text(row))


@entries.command("list")
@_json_option
@click.option("--all", "show_all", is_flag=True, help="Include disabled entries.")
@pass_cli
@handle_errors
def list_cmd(cli: CliContext, as_json: bool, show_all: bool) -> None:
    """List entries with their schedule, the time zone it is evaluated in (ZONE), next and
    last slot (UTC) and last run state. Quarantined entries (a malformed stored value, see
    ``entries show NAME`` for the reason) are always listed; other disabled entries only
    with ``--all``."""
    every = list_entries(cli.store, include_disabled=True)
    rows = [r for r in every if show_all or r.get("enabled") is not False
            or r.get("quarantine_reason")]
    hidden = len(every) - len(rows)
    # the check a beat's claim makes (reliable_beat.rows.check_entry): a row changed by SQL
    # is marked MALFORMED now, not quarantined (its slot lost) when it comes due
    check = entry_checker()
    malformed = {r["name"]: problems for r in rows
                 if r.get("enabled") is True and not r.get("quarantine_reason")
                 and r.get("next_fire_at") is not None and (problems := check(r))}
    if as_json:
        cli.echo_json(jsonable([
            {**_public(r), **({"malformed": malformed[r["name"]]}
                              if r["name"] in malformed else {})} for r in rows]))
        return
    if not rows:
        click.echo("no entries" + (f" ({hidden} disabled: --all shows them)" if hidden else ""))
        return
    header = ("NAME", "ORIGIN", "STATUS", "SCHEDULE", "ZONE", "NEXT (UTC)", "LAST SLOT",
              "LAST STATE")
    table = [header] + [
        (r["name"], r["origin"], "MALFORMED" if r["name"] in malformed else _status(r),
         schedule_text(r["schedule"]),
         r.get("timezone") or "UTC", _fmt(r["next_fire_at"]), _fmt(r["last_fire_at"]),
         r["last_state"] or "-")
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    for line in table:
        click.echo("  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    quarantined = [r["name"] for r in rows if r.get("quarantine_reason")]
    if quarantined:
        click.echo(f"{len(quarantined)} quarantined (malformed row, not firing): "
                   f"`reliable-beat entries show NAME` gives the reason and the fix")
    for name, problems in list(malformed.items())[:10]:
        click.echo(f"MALFORMED ENTRY {name!r}: {'; '.join(problems[:3])}: a beat quarantines it "
                   f"when it comes due (that slot is lost); fix: `reliable-beat entries update "
                   f"{name} ...` (a config entry: `reliable-beat -A APP schedule sync`, or a "
                   "restart of its group's beat, rewrites it from its beat_schedule)")
    if len(malformed) > 10:
        click.echo(f"... and {len(malformed) - 10} more MALFORMED entries "
                   "(`reliable-beat status` counts them)")
    if hidden:
        click.echo(f"{hidden} disabled entries not shown: --all shows them")


@_entry_command("show")
def show_cmd(cli: CliContext, name: str, as_json: bool) -> None:
    """Show one entry's full definition and state."""
    row = _public(get_entry(cli.store, name))
    if as_json:
        cli.echo_json(jsonable(row))
        return
    for key in sorted(row):
        value = row[key]
        if isinstance(value, datetime):
            value = _fmt(value)
        elif isinstance(value, (dict, list)):
            value = json.dumps(redact_value(value), sort_keys=True)
        click.echo(f"{key:24} {value}")


@entries.command("add")
@click.argument("name")
@_schedule_options
@click.option("--group", "schedule_group", default=None, metavar="GROUP",
              help="Schedule group whose beats fire it (default with -A: the app's group, "
                   "see `schedule groups` in docs/howto.md; without -A: none, any beat).")
@_json_option
@pass_cli
@handle_errors
def add_cmd(cli: CliContext, /, name: str, as_json: bool = False,
            schedule_group: str | None = None, **params: Any) -> None:
    """Add a runtime entry NAME (validated exactly like a beat_schedule entry).

    With ``-A APP`` it belongs to the app's schedule group (only that app's beats fire it,
    into that app's broker); ``--group`` overrides."""
    if params.get("task") is None:
        raise EntryValidationError([f"entry {name!r}: --task is required"])
    definition = build_definition(cli, name, params)
    if schedule_group is None and cli.app is not None:
        schedule_group = schedule_group_of(cli.app, cli.settings.schedule_group)
    save_runtime_entry(cli.store, definition, create=True, schedule_group=schedule_group)
    _echo_entry(cli, as_json, "added", name, lambda row: (
        f"added {name}: {schedule_text(row['schedule'])}, next {_fmt(row['next_fire_at'])}"))


@entries.command("update")
@click.argument("name")
@_schedule_options
@click.option("--group", "schedule_group", default=None, metavar="GROUP",
              help="Move it to this schedule group (default: it keeps its group).")
@_json_option
@pass_cli
@handle_errors
def update_cmd(cli: CliContext, /, name: str, as_json: bool = False,
               schedule_group: str | None = None, **params: Any) -> None:
    """Change a runtime entry: only the options given change."""
    existing = get_entry(cli.store, name)
    if existing["origin"] == "config":
        raise ConfigurationError(f"entry {name!r} comes from beat_schedule; change it there")
    definition = build_definition(cli, name, params, existing=existing)
    outcome = save_runtime_entry(cli.store, definition, create=False,
                                 schedule_group=schedule_group)
    _echo_entry(cli, as_json, outcome, name, lambda row: (
        f"{outcome} {name}: {schedule_text(row['schedule'])}, next {_fmt(row['next_fire_at'])}"))


@_entry_command("remove")
def remove_cmd(cli: CliContext, name: str, as_json: bool) -> None:
    """Remove a runtime entry (its runs stay as history)."""
    remove(cli.store, name)
    _done(cli, as_json, "removed", name, f"removed {name}")


@_entry_command("pause")
def pause_cmd(cli: CliContext, name: str, as_json: bool) -> None:
    """Pause an entry: it stops firing; its grid is kept."""
    pause(cli.store, name)
    _done(cli, as_json, "paused", name, f"paused {name}")


@_entry_command("resume")
def resume_cmd(cli: CliContext, name: str, as_json: bool) -> None:
    """Resume an entry; slots missed while paused go through its misfire policy.

    A quarantined entry (a malformed stored value) is checked first, as the beat checks it:
    still malformed, it stays quarantined and nothing changes (exit 1, the problems named).
    """
    problems = quarantine_problems(cli.store, name)
    if problems:
        fail(f"entry {name!r} stays quarantined (not resumed): its row is still malformed: "
             + "; ".join(problems) + f". Fix: rewrite it with `reliable-beat entries update "
             f"{name}` ... (config entries: correct beat_schedule), then resume it",
             1, kind="invalid", problems=[f"entry {name!r}: {p}" for p in problems])
    resume(cli.store, name)
    _echo_entry(cli, as_json, "resumed", name, lambda row: (
        f"resumed {name} (misfire policy {row['misfire_policy']}; "
        f"next {_fmt(row['next_fire_at'])})"))


@_entry_command("trigger")
def trigger_cmd(cli: CliContext, name: str, as_json: bool) -> None:
    """Fire NAME once now, under its own key (recorded as a manual run)."""
    key = ops_actions.trigger(cli.store, name, app=cli.app)
    group = get_entry(cli.store, name).get("schedule_group")
    published = ops_actions.app_publishes(cli.app, group)
    if as_json:
        cli.echo_json({"outcome": "triggered", "entry": name, "key": key,
                       "published": published})
        return
    how = "published" if published else (
        "queued in the outbox (the relay sends it)" if cli.app is None else
        f"queued in the outbox for schedule group {group!r} (its beat or relay sends it)")
    click.echo(f"triggered {name}: key {key}, {how}")


@entries.command("backfill")
@click.argument("name")
@click.argument("start")
@click.argument("end")
@click.option("--force", is_flag=True, help="Allow more slots than reliable_beat_backfill_limit.")
@_json_option
@pass_cli
@handle_errors
def backfill_cmd(
    cli: CliContext, name: str, start: str, end: str, force: bool, as_json: bool
) -> None:
    """Create runs for every slot of NAME in [START, END) that has none (ISO 8601 instants
    with offsets; slots after now are left to the beat)."""
    problems: list[str] = []
    s = parse_instant(start, "START", problems, name)
    e = parse_instant(end, "END", problems, name)
    if problems or s is None or e is None:
        raise EntryValidationError(problems)
    result = ops_actions.backfill(
        cli.store, name, s, e, limit=cli.settings.backfill_limit, force=force, app=cli.app
    )
    if as_json:
        cli.echo_json(jsonable(result.as_dict()))
        return
    click.echo(
        f"backfill {name}: {result.slots} slots in window, {result.created} runs created, "
        f"{result.existing} already had a run"
        + (f", {result.buffered} buffered (released one at a time)" if result.buffered else "")
        + (f", {result.future} future slots left to the beat" if result.future else "")
    )


@_entry_command("describe")
def describe_cmd(cli: CliContext, name: str, as_json: bool) -> None:
    """Answer the five questions for NAME: run twice? overlap? machine dies? retry? idempotent?"""
    info = ops_describe.describe(cli.store, cli.app, name)
    if as_json:
        cli.echo_json(jsonable(info))
        return
    titles = {
        "run_twice": "Can it run twice?",
        "overlap": "Can it overlap itself?",
        "machine_dies": "What if the machine dies mid-run?",
        "retry": "Can it retry safely?",
        "idempotent": "Is it idempotent?",
    }
    click.echo(f"{name}: task {info['task']} ({info['task_kind']}), "
               f"{schedule_text(info['schedule'])}, misfire {info['misfire_policy']}, "
               f"overlap {info['overlap_policy']}")
    if info.get("task_kind_fix"):
        click.echo(f"  task kind unknown: {info['task_kind_fix']}")
    for key, title in titles.items():
        q = info["questions"][key]
        click.echo(f"\n{title} {q['answer'].upper()}")
        click.echo(f"  {q['why']}")


@entries.command("import")
@click.argument("source", type=click.Choice(["redbeat", "django-celery-beat"]))
@click.option("--from-url", "from_url", required=True, metavar="URL",
              help="RedBeat: its Redis URL (redbeat_redis_url). django-celery-beat: the Django "
                   "database as a SQLAlchemy URL.")
@click.option("--key-prefix", default="redbeat:", show_default=True,
              help="RedBeat's redbeat_key_prefix.")
@click.option("--naive-timezone", default=None, metavar="ZONE",
              help="django-celery-beat with USE_TZ=False: Django's TIME_ZONE (default: the "
                   "app's timezone, else UTC).")
@click.option("--skip-invalid", is_flag=True,
              help="Import the valid entries and list the others (default: all or nothing).")
@click.option("--dry-run", is_flag=True, help="Validate and show the outcome; write nothing.")
@click.option("--group", "schedule_group", default=None, metavar="GROUP",
              help="Schedule group of the imported entries (default with -A: the app's "
                   "group; without -A: none, any beat fires them).")
@_json_option
@pass_cli
@handle_errors
def import_cmd(cli: CliContext, source: str, from_url: str, key_prefix: str,
               naive_timezone: str | None, skip_invalid: bool, dry_run: bool,
               as_json: bool, schedule_group: str | None = None) -> None:
    """Import the entries of RedBeat or django-celery-beat as runtime entries.

    Stop the old beat first. Each entry starts at the first slot after the old scheduler's
    last run: that slot is not sent twice, and one missed at the cutover meets the entry's
    misfire policy. Disabled entries come in paused; a name that already exists is left alone.
    """
    try:  # RedBeat and django-celery-beat are Celery's: their importers are the adapter's
        importers = load_adapter(DEFAULT_ADAPTER).importers()
    except ImportError as exc:
        raise click.ClickException(
            f"importing {source} entries needs the Celery adapter ({exc}); install it with "
            "pip install 'reliable-beat[celery]'") from exc
    app = cli.app
    zone = cli.app_timezone
    if source == "redbeat":
        found = importers.read_redbeat(from_url, key_prefix=key_prefix)
    else:
        found = importers.read_django_celery_beat(from_url,
                                                  naive_timezone=naive_timezone or zone)
    outcomes = importers.import_entries(
        cli.store, found, settings=cli.settings, default_timezone=zone,
        is_idempotent=task_checker(app),
        is_registered=(lambda t: ops_describe.task_kind(app, t) != "unknown") if app else None,
        skip_invalid=skip_invalid, dry_run=dry_run,
        schedule_group=schedule_group if schedule_group is not None or app is None
        else schedule_group_of(app, cli.settings.schedule_group),
    )
    counts = importers.summary(outcomes)
    if as_json:
        cli.echo_json(jsonable({"dry_run": dry_run, "counts": counts,
                                "entries": [vars(o) for o in outcomes]}))
        return
    for o in outcomes:
        state = f"{o.action}{' (paused)' if o.paused else ''}"
        nxt = f", next {_fmt(o.next_fire_at)}" if o.action == "imported" else ""
        click.echo(f"{o.name}: {state}{nxt}; {o.detail}")
    click.echo(", ".join(f"{v} {k}" for k, v in counts.items())
               + (" (dry run: nothing written)" if dry_run else ""))


def register(group: click.Group) -> None:
    """Add ``entries`` to the ``reliable-beat`` group."""
    group.add_command(entries)
