"""``reliable-beat relay`` and ``reliable-beat outbox status``.

``relay`` needs the Celery app (``reliable-beat -A proj relay`` or ``celery -A proj
reliable-beat relay``) to deliver ``celery`` and ``kombu`` rows; without one it delivers only
the other destinations and leaves those rows pending.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import click

from reliable_beat.cli import CliContext, pass_cli
from reliable_beat.errors import ConfigurationError
from reliable_beat.metrics import serve
from reliable_beat.redaction import get_logger
from reliable_beat.relay import Relay, outbox_status

__all__ = ["register"]


class _ConfigError(click.ClickException):
    """A configuration problem: one line, exit code 2."""

    exit_code = 2


@click.command("relay")
@click.option("--once", is_flag=True, help="Run one claim/deliver/settle cycle and exit.")
@click.option("--batch-size", type=int, default=None,
              help="Rows per claim (default reliable_beat_outbox_batch_size).")
@click.option("--claim-lease-seconds", type=float, default=60.0, show_default=True,
              help="How long a claim lasts; rows of a dead relay are re-delivered after it.")
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help="With --once: print the outcome as JSON.")
@pass_cli
def relay(cli: CliContext, once: bool, batch_size: int | None, claim_lease_seconds: float,
          loglevel: str, as_json: bool) -> None:
    """Deliver outbox rows until SIGTERM / SIGINT (any number of relays may run at once)."""
    logging.basicConfig(level=loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli.role = "relay"
    try:
        worker = Relay(cli.store, cli.app, settings=cli.settings, batch_size=batch_size,
                       claim_lease_seconds=claim_lease_seconds)
    except ConfigurationError as exc:  # e.g. a destination's secret not in the environment
        raise _ConfigError(str(exc)) from exc
    click.echo(f"relay {worker.owner} on {cli.store.safe_url} (from "
               f"{cli.settings.database_url_origin}); destinations: "
               + ", ".join(sorted(worker.handlers)), err=True)
    warning = cli.settings.default_store_warning("relay")
    if warning:
        get_logger("reliable_beat.relay").warning("%s", warning)
    if cli.settings.metrics_port is not None and not once:
        serve(cli.settings.metrics_port, cli.store, addr=cli.settings.metrics_host,
              pending_alarm_seconds=cli.settings.workflow_pending_alarm_seconds)
    if once:
        try:
            claimed = worker.run_once()
        finally:
            worker.forget()  # a finished one-shot run is not a dead relay: no row left
            worker.close()
        if as_json:
            cli.echo_json({"claimed": claimed, "owner": worker.owner})
        else:
            click.echo(f"claimed {claimed} rows")
        return
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.run_forever(stop)


@click.group("outbox")
def outbox_group() -> None:
    """Inspect the transactional outbox."""


@outbox_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def status(cli: CliContext, as_json: bool) -> None:
    """Backlog per destination: pending, due, scheduled (delayed, not yet due: not
    backlog), age of the oldest due or failed row, dead."""
    with cli.store.begin() as conn:
        rows = outbox_status(conn)
    if as_json:
        cli.echo_json(rows)
        return
    if not rows:
        click.echo("outbox empty (no pending or dead rows)")
        return
    click.echo(f"{'destination':<20} {'pending':>8} {'due':>8} {'scheduled':>9} "
               f"{'oldest age s':>13} {'dead':>6}")
    for r in rows:
        age = r["oldest_pending_age_seconds"]
        click.echo(f"{r['destination']:<20} {r['pending']:>8} {r['due']:>8} "
                   f"{r['scheduled']:>9} {'-' if age is None else f'{age:.1f}':>13} "
                   f"{r['dead']:>6}")


def register(group: click.Group) -> None:
    group.add_command(relay)
    group.add_command(outbox_group)
