"""``reliable-beat schedule ...``: schedule groups and their config versions.

* ``schedule list`` — every config each group has synced (the current one marked), its live
  beats, when it was synced.
* ``schedule sync [--force]`` — sync the app's ``beat_schedule`` (``-A proj``) the way a
  beat does at start; ``--force`` makes an older config current again (a rollback).
* ``schedule retire GROUP`` — disable every config entry of a group whose app is gone.

See :mod:`reliable_beat.groups` for the rules (only a config the group has not synced before
wins, so old and new pods of a rolling deploy never flap the stored schedule).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

import click
from sqlalchemy import select, update

from reliable_beat.adapters import task_function_checker
from reliable_beat.cli import CliContext, fail, jsonable, pass_cli
from reliable_beat.cli.entries import handle_errors
from reliable_beat.db.dialects import update_returning
from reliable_beat.db.tables import entries, schedule_configs
from reliable_beat.entries import (
    definitions_from_beat_schedule,
    notify_entries_changed,
    sync_schedule_group,
)
from reliable_beat.errors import ConfigurationError
from reliable_beat.groups import group_health, log_sync_result, schedule_group_of
from reliable_beat.ops.status import BEAT_ALIVE_SECONDS
from reliable_beat.redaction import get_logger
from reliable_beat.rows import display_rows

__all__ = ["register", "schedule"]

log = get_logger("reliable_beat.cli")


@click.group("schedule")
def schedule() -> None:
    """Schedule groups: list their configs, sync one (after a rollback), retire a group."""


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
@handle_errors
def list_cmd(cli: CliContext, as_json: bool) -> None:
    """Every config each schedule group has synced (newest first), and its beats."""
    store = cli.store
    with store.engine.connect() as conn:
        now = store.now(conn)
        health = {g["group"]: g for g in group_health(conn, now,
                                                      alive_seconds=BEAT_ALIVE_SECONDS)}
        rows = display_rows(conn, select(schedule_configs).order_by(
            schedule_configs.c.schedule_group, schedule_configs.c.synced_at.desc()),
            schedule_configs)
    out: list[dict[str, Any]] = [
        {"schedule_group": r["schedule_group"], "config_hash": r["config_hash"],
         "current": r["superseded_at"] is None,
         "entries": ([str(n) for n in r["entry_names"]] if isinstance(r["entry_names"], list)
                     else [f"malformed entry_names: {r['entry_names']!r}"]),
         "first_synced_at": r["first_synced_at"], "synced_at": r["synced_at"],
         "synced_by": r["synced_by"], "superseded_at": r["superseded_at"],
         "beats_alive": health.get(r["schedule_group"], {}).get("beats_alive", 0)}
        for r in rows
    ]
    if as_json:
        cli.echo_json(jsonable(out))
        return
    if not out:
        click.echo("no schedule group has synced a beat_schedule yet")
    for c in out:
        mark = "current" if c["current"] else f"superseded {jsonable(c['superseded_at'])}"
        click.echo(f"{c['schedule_group']}  {str(c['config_hash'])[:12]}  {mark}  "
                   f"synced {jsonable(c['synced_at'])} by {c['synced_by'] or '-'}  "
                   f"{len(c['entries'])} entries  {c['beats_alive']} live beats")


@schedule.command("sync")
@click.option("--force", is_flag=True,
              help="Sync even a config this group synced before and replaced (a rollback).")
@click.option("--group", default=None,
              help="Schedule group (default: reliable_beat_schedule_group or the app's name).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
@handle_errors
def sync_cmd(cli: CliContext, force: bool, group: str | None, as_json: bool) -> None:
    """Sync the app's beat_schedule into its schedule group, as a beat does at start."""
    app = cli.app
    if app is None:
        raise ConfigurationError("schedule sync needs the app: pass -A proj (or run "
                                 "`celery -A proj reliable-beat schedule sync`)")
    group = group or schedule_group_of(app, cli.settings.schedule_group)
    defs = definitions_from_beat_schedule(
        app.conf.beat_schedule or {}, default_timezone=cli.app_timezone,  # as a beat does
        settings=cli.settings, now=datetime.now(timezone.utc),
        task_function=task_function_checker(app),
    )
    result = sync_schedule_group(cli.store, defs, group=group, owner="cli", force=force)
    if result.outcome == "refused":
        fail(f"schedule group {group!r}: {result.refused}", 2, kind="invalid")
    if result.outcome == "older":
        fail(f"schedule group {group!r}: this beat_schedule (config {result.config_hash[:12]}) "
             "was synced before and superseded at "
             f"{jsonable(result.superseded_at)}; nothing changed. Pass --force to make it "
             "current again (a rollback)", 2, kind="invalid")
    if as_json:
        cli.echo_json(dataclasses.asdict(result))
        return
    log_sync_result(_EchoLog(), result, cli.store.safe_url)  # type: ignore[arg-type]


@schedule.command("retire")
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
@handle_errors
def retire_cmd(cli: CliContext, group: str, as_json: bool) -> None:
    """Disable every config entry of GROUP (its app is gone); their history stays."""
    store = cli.store
    with store.begin() as conn:
        now = store.now(conn)
        names = [r.name for r in update_returning(
            conn,
            update(entries)
            .where(entries.c.origin == "config", entries.c.schedule_group == group,
                   entries.c.enabled.is_(True))
            .values(enabled=False, disabled_at=now, updated_at=now),
            entries, (entries.c.name,),
        )]
        conn.execute(update(schedule_configs)
                     .where(schedule_configs.c.schedule_group == group,
                            schedule_configs.c.superseded_at.is_(None))
                     .values(superseded_at=now))
        if names:
            notify_entries_changed(conn, store)
    if as_json:
        cli.echo_json({"schedule_group": group, "disabled": sorted(names)})
        return
    click.echo(f"schedule group {group!r}: disabled {len(names)} config entries"
               + (f" ({', '.join(sorted(names))})" if names else ""))


class _EchoLog:
    """Enough of a logger for :func:`log_sync_result`: prints to the terminal."""

    def _emit(self, level: str, msg: str, *args: Any) -> None:
        click.echo(f"{level}: {msg % args}", err=level != "info")

    def info(self, msg: str, *args: Any) -> None:
        self._emit("info", msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self._emit("warning", msg, *args)

    def error(self, msg: str, *args: Any) -> None:
        self._emit("error", msg, *args)


def register(group: click.Group) -> None:
    """Add ``schedule`` to the ``reliable-beat`` group."""
    group.add_command(schedule)
