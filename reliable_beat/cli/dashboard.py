"""``reliable-beat dashboard``: serve the web dashboard (:mod:`reliable_beat.web`) from the store.

Binds ``127.0.0.1`` by default. Any other address needs a token configured (settings or
environment, never the command line: see :mod:`reliable_beat.web.auth`); without one the
command refuses to start (exit 2). The web extra is imported only when the command runs:
without it the command says to ``pip install 'reliable-beat[web]'``.
"""

from __future__ import annotations

import importlib

import click

from reliable_beat.cli import CliContext, fail, pass_cli

__all__ = ["WEB_EXTRA_HINT", "register"]

#: How to install the dashboard's libraries (named by the error when they are missing).
WEB_EXTRA_HINT = "pip install 'reliable-beat[web]'"


@click.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Off loopback, a token must be configured "
                   "(RELIABLE_BEAT_DASHBOARD_OPERATOR_TOKEN / _VIEWER_TOKEN).")
@click.option("--port", default=8477, show_default=True, type=int)
@click.option("--slots", default=40, show_default=True, type=click.IntRange(1, 200),
              help="Slots per entry in the timeline strips.")
@click.option("--refresh", "refresh_seconds", default=5.0, show_default=True,
              type=click.FloatRange(1.0, 3600.0), help="Seconds between live refreshes.")
@pass_cli
def dashboard(cli: CliContext, host: str, port: int, slots: int,
              refresh_seconds: float) -> None:
    """Serve the web dashboard: alarms, slot timelines, runs, dead letters, workflows."""
    try:
        web = importlib.import_module("reliable_beat.web")
    except ImportError as exc:
        fail(f"the dashboard needs the web extra ({exc}): {WEB_EXTRA_HINT}", 2, kind="usage")
    auth = web.AuthConfig.from_sources(cli.settings)
    web.check_bind(host, auth)  # ConfigurationError: exit 2, naming the fix
    store = cli.store
    click.echo(f"reliable-beat dashboard on http://{host}:{port}/ (store {store.safe_url}; "
               f"{'token authentication' if auth.configured else 'loopback only, no login'})")
    web.serve(store, settings=cli.settings, app=cli.app, host=host, port=port, auth=auth,
              slots=slots, refresh_seconds=refresh_seconds)


def register(group: click.Group) -> None:
    """Add ``dashboard`` to the ``reliable-beat`` group."""
    group.add_command(dashboard)
