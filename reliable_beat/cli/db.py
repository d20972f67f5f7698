"""``reliable-beat db upgrade|check|current``: the schema, through Alembic."""

from __future__ import annotations

from typing import Any

import click

from reliable_beat.cli import CliContext, pass_cli
from reliable_beat.db import migrate


@click.group("db")
def db() -> None:
    """Create and upgrade the reliable_beat schema (needs DDL rights)."""


@db.command("upgrade")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it (offline mode).")
@click.option("--revision", default="head", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
def upgrade(cli: CliContext, sql: bool, revision: str, as_json: bool) -> None:
    """Upgrade the schema to REVISION (safe while other processes run or upgrade)."""
    if sql:
        click.echo(migrate.upgrade_sql(cli.settings.database_url, revision))
        return
    cli.create_store = True
    migrate.upgrade(cli.store, revision)
    if as_json:
        cli.echo_json(_revision(cli))
        return
    click.echo(f"{cli.store.safe_url}: schema at {migrate.current(cli.store)}")


@db.command("check")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
def check(cli: CliContext, as_json: bool) -> None:
    """Exit 0 when the schema is at head, 1 when behind (a readiness probe)."""
    at = migrate.current(cli.store)
    if as_json:
        info = _revision(cli)
        cli.echo_json(info)
        if not info["up_to_date"]:
            raise SystemExit(1)
        return
    if at != migrate.head():
        click.echo(f"behind: at {at or '(none)'}, head is {migrate.head()}; "
                   "run `reliable-beat db upgrade`", err=True)
        raise SystemExit(1)
    click.echo(f"up to date ({at})")


@db.command("current")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
def current(cli: CliContext, as_json: bool) -> None:
    """Print the schema revision of the database."""
    if as_json:
        cli.echo_json(_revision(cli))
        return
    click.echo(migrate.current(cli.store) or "(none)")


def _revision(cli: CliContext) -> dict[str, Any]:
    at = migrate.current(cli.store)
    return {"store": cli.store.safe_url, "revision": at, "head": migrate.head(),
            "up_to_date": at == migrate.head()}


def register(group: click.Group) -> None:
    group.add_command(db)
