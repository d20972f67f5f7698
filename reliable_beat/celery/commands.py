"""The ``reliable-beat`` click group: standalone (``reliable-beat ...``) and as a Celery
sub-command (``celery -A proj reliable-beat ...``, through the ``celery.commands`` entry point).

Each command gets a :class:`CliContext` (``ctx.find_object(CliContext)``) holding the Celery
app (when one was given), the :class:`~reliable_beat.settings.Settings` read from it, and a
lazily created :class:`~reliable_beat.db.dialects.Store`. Command modules register themselves
in :data:`COMMAND_MODULES`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import click
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from reliable_beat.db.dialects import Store
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.redaction import redact_text, redact_value
from reliable_beat.settings import Settings

__all__ = ["COMMAND_MODULES", "CliContext", "pass_cli", "reliable_beat"]

#: Modules whose import adds commands to :func:`reliable_beat` (each defines ``register(group)``).
COMMAND_MODULES = [
    "reliable_beat.cli_db",
    "reliable_beat.cli_entries",
    "reliable_beat.cli_relay",
    "reliable_beat.cli_status",
    "reliable_beat.metrics",
    "reliable_beat.cli_runs",
]


@dataclass
class CliContext:
    """What every command needs: the app, the settings and the store."""

    app: Any = None
    database_url: str | None = field(default=None, repr=False)  # may hold a password
    role: str = "cli"
    create_store: bool = False  # only `db upgrade` may create an embedded SQLite file
    _settings: Settings | None = field(default=None, repr=False)
    _store: Store | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            base = Settings.from_celery(self.app) if self.app is not None else Settings()
            if self.database_url:
                from dataclasses import replace

                base = replace(base, database_url=self.database_url)
            self._settings = base
        return self._settings

    @property
    def store(self) -> Store:
        if self._store is None:
            url = self.settings.database_url
            path = _sqlite_path(url)
            if path is not None and not self.create_store and not os.path.exists(path):
                raise click.ClickException(
                    f"no reliable_beat store at {path}: start a beat (it creates the embedded "
                    "store), run `reliable-beat db upgrade`, or pass --database-url / -A"
                )
            self._store = Store.from_url(url, role=self.role)
        return self._store

    def echo_json(self, value: Any) -> None:
        click.echo(json.dumps(redact_value(value), indent=2, default=str, sort_keys=True))


pass_cli = click.make_pass_decorator(CliContext)


def _sqlite_path(url: str) -> str | None:
    """The file of a ``sqlite:///path`` URL (None for other URLs and in-memory SQLite)."""
    try:
        parsed = make_url(url)
    except Exception:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return str(parsed.database)


class _Group(click.Group):
    """Turns store failures into one line and exit code 1, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except StoreUnavailableError as exc:
            raise click.ClickException(redact_text(exc)) from exc
        except DBAPIError as exc:
            text = str(exc.orig)
            if "no such table" in text or "does not exist" in text:
                raise click.ClickException(
                    f"the reliable_beat schema is missing ({text.splitlines()[0]}): run "
                    "`reliable-beat db upgrade`"
                ) from exc
            raise click.ClickException(
                f"database error: {redact_text(text.splitlines()[0] if text else repr(exc))}"
            ) from exc


def _load_app(spec: str) -> Any:
    from celery.app.utils import find_app

    sys.path.insert(0, ".")
    return find_app(spec)


@click.group(name="reliable-beat", cls=_Group)
@click.option("-A", "--app", "app_spec", default=None, envvar="RELIABLE_BEAT_APP",
              help="Celery app (module or module:attr) whose reliable_beat_* settings to use.")
@click.option("--database-url", default=None, envvar="RELIABLE_BEAT_DATABASE_URL",
              help="Store URL; overrides reliable_beat_database_url.")
@click.pass_context
def reliable_beat(ctx: click.Context, app_spec: str | None, database_url: str | None) -> None:
    """Effectively-once periodic tasks for Celery: schema, entries, runs, relay, status."""
    app = None
    parent = ctx.find_object(object) if ctx.parent is not None else None
    if app_spec:
        app = _load_app(app_spec)
    elif parent is not None and hasattr(parent, "app"):
        app = parent.app  # running as `celery -A proj reliable-beat ...`
    ctx.obj = CliContext(app=app, database_url=database_url)


def _register_all() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(reliable_beat)


_register_all()
