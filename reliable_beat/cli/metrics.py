"""``reliable-beat metrics``: serve or write the Prometheus metrics read from the store.

The collector lives in :mod:`reliable_beat.metrics`; this module only renders it as commands.
"""

from __future__ import annotations

import time

import click

from reliable_beat.cli import CliContext, pass_cli
from reliable_beat.metrics import serve, write_textfile

__all__ = ["metrics", "register"]


@click.group("metrics")
def metrics() -> None:
    """Prometheus metrics read from the store (needs the 'metrics' extra)."""


def _sweep_settings(cli: CliContext) -> dict[str, float]:
    """The settings of the CLI's app the alarm gauges read (retry overdue, workflows pending)."""
    s = cli.settings
    return {"redispatch_seconds": s.redispatch_seconds, "retry_cap_seconds": s.retry_cap_seconds,
            "pending_alarm_seconds": s.workflow_pending_alarm_seconds}


@metrics.command("serve")
@click.option("--port", type=int, default=9808, show_default=True)
@click.option("--addr", default=None,
              help="Bind address [default: reliable_beat_metrics_host, 127.0.0.1].")
@pass_cli
def serve_cmd(cli: CliContext, port: int, addr: str | None) -> None:
    """Serve /metrics over HTTP until interrupted (loopback unless --addr says otherwise)."""
    addr = addr or cli.settings.metrics_host
    try:
        server = serve(port, cli.store, addr=addr, **_sweep_settings(cli))
    except ImportError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from exc
    click.echo(f"serving metrics of {cli.store.safe_url} on http://{addr}:{server.port}/metrics")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


@metrics.command("textfile")
@click.argument("path")
@pass_cli
def textfile_cmd(cli: CliContext, path: str) -> None:
    """Write the metrics once to PATH (for node-exporter's textfile collector; run from cron)."""
    try:
        write_textfile(path, cli.store, **_sweep_settings(cli))
    except ImportError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from exc
    click.echo(f"wrote {path}")


def register(group: click.Group) -> None:
    """Add ``metrics`` to the ``reliable-beat`` group."""
    group.add_command(metrics)
