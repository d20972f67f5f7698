"""``reliable-beat purge``: one retention pass now (see :mod:`reliable_beat.retention`)."""

from __future__ import annotations

from datetime import datetime

import click

from reliable_beat.cli import CliContext, pass_cli
from reliable_beat.retention import purge, purge_dead_letters

__all__ = ["register"]


@click.command("purge")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Rows per transaction (default reliable_beat_purge_batch_size).")
@click.option("--dead-letters-before", "dead_before", default=None, metavar="INSTANT",
              help="Also delete dead letters created before this ISO 8601 instant with a UTC "
                   "offset (a person's decision: never done automatically).")
@pass_cli
def purge_cmd(cli: CliContext, dry_run: bool, as_json: bool, batch_size: int | None,
              dead_before: str | None) -> None:
    """Delete finished runs, old attempts and sent outbox rows past their retention.

    Retention per table: reliable_beat_runs_retention_seconds,
    reliable_beat_attempts_retention_seconds, reliable_beat_outbox_retention_seconds. Runs
    until caught up, in transactions of --batch-size rows; safe while beats, workers and
    relays run (and while they purge too).
    """
    before: datetime | None = None
    if dead_before is not None:
        try:
            before = datetime.fromisoformat(dead_before.replace("Z", "+00:00"))
        except ValueError:
            raise click.BadParameter(f"{dead_before!r} is not an ISO 8601 instant",
                                     param_hint="--dead-letters-before") from None
        if before.tzinfo is None or before.utcoffset() is None:
            raise click.BadParameter(f"{dead_before!r} has no UTC offset (add Z or +HH:MM)",
                                     param_hint="--dead-letters-before")
    result = purge(cli.store, cli.settings, dry_run=dry_run, batch_size=batch_size)
    out = result.as_dict()
    if before is not None:
        out["dead_letters"] = purge_dead_letters(cli.store, before=before, dry_run=dry_run)
    if as_json:
        cli.echo_json(out)
        return
    verb = "would delete" if dry_run else "deleted"
    rate = result.total / result.seconds if result.seconds and not dry_run else 0.0
    click.echo(f"{verb}: {out['runs']} runs, {out['attempts']} attempts, {out['outbox']} "
               f"sent outbox rows" + (f", {out['dead_letters']} dead letters"
                                      if "dead_letters" in out else "")
               + ("" if dry_run else f" in {result.seconds:.2f} s ({rate:,.0f} rows/s)"))
    for table in ("runs", "attempts", "outbox"):
        cutoff = out["cutoffs"].get(table)
        click.echo(f"  {table}: " + (f"older than {cutoff}" if cutoff else "kept forever"))


def register(group: click.Group) -> None:
    """Add ``purge`` to the ``reliable-beat`` group."""
    group.add_command(purge_cmd)
