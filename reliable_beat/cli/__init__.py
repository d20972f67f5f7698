"""The ``reliable-beat`` command line: the root click group and what every command shares.

Framework-neutral: standalone (``reliable-beat ...``, :func:`main`), and mounted by each
adapter (``celery -A proj reliable-beat ...`` through the ``celery.commands`` entry point,
:mod:`reliable_beat.celery.commands`). ``-A`` names a Celery app, loaded through the Celery
adapter (:func:`load_app`; without ``reliable-beat[celery]`` installed it is a clear error,
every command without ``-A`` works).

Each command gets a :class:`CliContext` (``ctx.find_object(CliContext)``) holding the
framework app (when one was given), the :class:`~reliable_beat.settings.Settings` read from
it, and a lazily created :class:`~reliable_beat.db.dialects.Store`. Command modules register
themselves in :data:`COMMAND_MODULES`; an adapter's commands come through the entry point
group ``reliable_beat.cli`` (:func:`plugin_command`). Nothing here imports an adapter: the app,
its zone and the foreign importers are the adapter's answers
(:class:`reliable_beat.adapters.AppAdapter`).

Output conventions, the same for every command:

* ``--json`` prints the data as JSON on stdout; every instant is ISO 8601 UTC with ``Z``
  (:func:`jsonable`), whatever produced it.
* Errors go to stderr as one line ``error: <message>`` (never ``Error:``), or, when the
  command line has ``--json``, as one JSON object ``{"error": {"message", "kind",
  "exit_code"[, "problems"]}}`` (:func:`fail`). Exit codes: 1 not found / database
  unavailable / failed; 2 bad input or usage.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import EntryPoint, entry_points
from typing import Any, NoReturn

import click
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from reliable_beat._version import __version__
from reliable_beat.adapters import (
    CLI_ENTRY_POINT_GROUP,
    DEFAULT_ADAPTER,
    adapter_for_spec,
    load_adapter,
)
from reliable_beat.db.dialects import Store, connect_refusal, is_unavailable
from reliable_beat.db.types import infinity_text
from reliable_beat.errors import (
    ConfigurationError,
    EntryNotFoundError,
    ReliableBeatError,
    StoreUnavailableError,
)
from reliable_beat.ops import context as ops_context
from reliable_beat.redaction import get_logger, redact_text, redact_value
from reliable_beat.settings import Settings

__all__ = [
    "COMMAND_MODULES",
    "CliContext",
    "fail",
    "jsonable",
    "load_app",
    "main",
    "pass_cli",
    "plugin_command",
    "reliable_beat",
]

logger = get_logger(__name__)

#: ``ctx.meta`` key: the command line asked for ``--json`` (errors are JSON too).
JSON_META = "reliable_beat.json"


def jsonable(value: Any) -> Any:
    """``value`` with every ``datetime`` as ISO 8601 UTC (``...Z``, microseconds kept when
    non-zero; a naive one is taken as UTC), recursively through dicts, lists and tuples, for
    ``--json`` output."""
    if infinity_text(value) is not None:  # PostgreSQL 'infinity' / '-infinity' (malformed)
        return infinity_text(value)
    if isinstance(value, datetime):
        at = (value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)
              ).astimezone(timezone.utc)
        fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if at.microsecond else "%Y-%m-%dT%H:%M:%SZ"
        return at.strftime(fmt)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def wants_json() -> bool:
    """True when the running command line has ``--json``."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(JSON_META))


def fail(message: str, code: int = 1, *, kind: str = "error",
         problems: list[str] | None = None) -> NoReturn:
    """Print an error on stderr and exit with ``code``.

    Text: ``error: <message>``. With ``--json`` on the command line: one JSON object
    ``{"error": {"message": str, "kind": str, "exit_code": int, "problems": [str]?}}``.

    Args:
        kind: a stable word for scripts: ``usage``, ``invalid``, ``not_found``,
            ``store_unavailable``, ``schema_missing``, ``database``, ``error``.
        problems: every problem of a validation error (each names its entry).

    Raises:
        SystemExit: always, with ``code``.
    """
    message = redact_text(message)  # URLs, tokens: never in an error line
    problems = [redact_text(p) for p in problems] if problems else problems
    if wants_json():
        body: dict[str, Any] = {"message": message, "kind": kind, "exit_code": code}
        if problems:
            body["problems"] = problems
        click.echo(json.dumps({"error": body}, sort_keys=True), err=True)
    else:
        click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


#: Modules whose import adds commands to :func:`reliable_beat` (each defines ``register(group)``).
#: Adapters add theirs through the entry point group
#: :data:`~reliable_beat.adapters.CLI_ENTRY_POINT_GROUP` (see :class:`_Group`).
COMMAND_MODULES = [
    "reliable_beat.cli.db",
    "reliable_beat.cli.entries",
    "reliable_beat.cli.relay",
    "reliable_beat.cli.status",
    "reliable_beat.cli.metrics",
    "reliable_beat.cli.runs",
    "reliable_beat.cli.schedule",
    "reliable_beat.cli.workflows",
    "reliable_beat.cli.purge",
    "reliable_beat.cli.dashboard",
]


@dataclass
class CliContext:
    """What every command needs: the app, the settings and the store."""

    app: Any = None
    database_url: str | None = field(default=None, repr=False)  # may hold a password
    database_url_origin: str = "--database-url"  # where database_url came from
    role: str = "cli"
    create_store: bool = False  # only `db upgrade` may create an embedded SQLite file
    _settings: Settings | None = field(default=None, repr=False)
    _store: Store | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = ops_context.settings_for(self.app, self.database_url,
                                                      self.database_url_origin)
        return self._settings

    @property
    def store(self) -> Store:
        if self._store is None:
            url = self.settings.database_url
            path = _sqlite_path(url)
            if path is not None and not self.create_store and not os.path.exists(path):
                raise click.ClickException(self._no_sqlite_store(path))
            self._store = Store.from_url(url, role=self.role)
        return self._store

    def _no_sqlite_store(self, path: str) -> str:
        """Why there is no store at SQLite file ``path``, and the fixes that apply to where
        its URL came from (``-A`` given or not, ``--database-url``, the app's setting)."""
        settings = self.settings
        origin = settings.database_url_origin
        create = ("start a beat (it creates the embedded store) or run `reliable-beat db "
                  "upgrade` to create it here")
        if origin == "--database-url":
            fix = f"{create}, or give --database-url the URL of the store your beats use"
        elif self.app is not None:
            fix = (f"{create}, or set {settings.database_url_key} in the app (or pass "
                   "--database-url) to the store your beats use")
        else:
            fix = (f"{create}, or give the store's URL or the app, before the command: "
                   f"{_group_option_form()}")
        return f"no reliable_beat store at {path} (URL from {origin}): {fix}"

    @property
    def app_timezone(self) -> str:
        """The IANA zone the app evaluates schedules in (its adapter's
        :meth:`~reliable_beat.adapters.AppAdapter.app_timezone`: Celery's ``app.timezone``),
        the zone of entries that set none; UTC without an app."""
        return ops_context.app_timezone(self.app)

    def echo_json(self, value: Any) -> None:
        """Print ``value`` as JSON (instants as ISO 8601 ``Z``, see :func:`jsonable`; secrets
        redacted, see :func:`reliable_beat.redaction.redact_value`)."""
        click.echo(json.dumps(redact_value(jsonable(value)), indent=2, default=str,
                              sort_keys=True))


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
    """Turns every failure into one ``error:`` line (or JSON object, see :func:`fail`) and an
    exit code, never a traceback; adds the adapters' commands (:func:`plugin_command`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        builtin = set(self.commands)
        for name, ep in _plugin_entry_points().items():
            if name in builtin:
                _warn_shadowed(name, ep)
        return sorted(builtin | set(_plugin_entry_points()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.commands.get(cmd_name) or plugin_command(cmd_name)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[JSON_META] = "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except StoreUnavailableError as exc:
            fail(str(exc), 1, kind="store_unavailable")
        except DBAPIError as exc:
            text = str(exc.orig)
            if is_unavailable(exc):  # down, or refused the connection (no such role, ...)
                fail(_unavailable_message(self, ctx, exc), 1, kind="store_unavailable")
            if _schema_missing(exc):
                fail(f"the reliable_beat schema is missing ({text.splitlines()[0]}): run "
                     "`reliable-beat db upgrade`", 1, kind="schema_missing")
            fail(f"database error: {text.splitlines()[0] if text else exc!r}", 1,
                 kind="database")
        except EntryNotFoundError as exc:
            fail(str(exc), 1, kind="not_found")
        except ConfigurationError as exc:
            fail(str(exc), 2, kind="invalid", problems=getattr(exc, "problems", None))
        except ReliableBeatError as exc:
            fail(str(exc), 1)
        except click.UsageError as exc:
            if not wants_json() and exc.ctx is not None:
                click.echo(exc.ctx.get_usage(), err=True)
                click.echo(f"Try '{exc.ctx.command_path} --help' for help.", err=True)
            fail(exc.format_message(), exc.exit_code, kind="usage")
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)


#: Loaded adapter commands (entry point name -> command, or the stand-in of a broken one).
_plugins: dict[str, click.Command] = {}
_shadowed_warned: set[str] = set()


def _plugin_entry_points() -> dict[str, EntryPoint]:
    """The entry points of group :data:`~reliable_beat.adapters.CLI_ENTRY_POINT_GROUP`."""
    return {ep.name: ep for ep in entry_points(group=CLI_ENTRY_POINT_GROUP)}


def _warn_shadowed(name: str, ep: EntryPoint) -> None:
    if name not in _shadowed_warned:
        _shadowed_warned.add(name)
        logger.warning("reliable-beat: the command %r of entry point %s = %r is ignored: a "
                       "built-in command has that name; rename the entry point", name, name,
                       ep.value)


def plugin_command(name: str) -> click.Command | None:
    """The command an adapter contributes as ``reliable-beat <name>`` through the entry point
    group :data:`~reliable_beat.adapters.CLI_ENTRY_POINT_GROUP` (``name =
    "package.module:attr"``, a :class:`click.Command`), imported on first use (``reliable-beat
    status`` imports no adapter); None when no entry point has that name.

    A plugin that fails to import, or names no click command, becomes a stand-in command of
    that name: listed in ``--help`` as unavailable, and running it exits 2 with one error
    naming the entry point, its target and the cause (a missing framework names the extra to
    install). The rest of the command line works.
    """
    if name in _plugins:
        return _plugins[name]
    ep = _plugin_entry_points().get(name)
    if ep is None:
        return None
    try:
        command = ep.load()
        if not isinstance(command, click.Command):
            raise TypeError(f"{type(command).__name__} object, not a click command or group")
    except Exception as exc:  # any failure: one clear error on use, the rest still works
        command = _broken_plugin(ep, exc)
    _plugins[name] = command
    return command


def _broken_plugin(ep: EntryPoint, exc: Exception) -> click.Command:
    """A stand-in for the plugin ``ep`` that failed to load with ``exc``."""
    reason = f"{type(exc).__name__}: {exc}"
    message = (f"the {ep.name!r} commands are unavailable: entry point {ep.name} = "
               f"{ep.value!r} (group {CLI_ENTRY_POINT_GROUP!r}) failed to load ({reason})")
    dist = getattr(ep, "dist", None)
    if isinstance(exc, ModuleNotFoundError):
        if dist is not None and dist.metadata["Name"] == "reliable-beat":
            message += f"; install it with pip install 'reliable-beat[{ep.name}]'"
        else:
            message += f"; install {exc.name!r} or the package that provides {ep.value!r}"
    else:
        message += "; fix or uninstall the package that declares it"
    logger.debug("%s", message)

    def unavailable(args: tuple[str, ...]) -> None:
        fail(message, 2, kind="usage")

    return click.Command(
        ep.name, callback=unavailable, help=message,
        short_help=f"(unavailable: {reason})"[:200],
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                          "help_option_names": []})


def _unavailable_message(group: click.Group, ctx: click.Context, exc: DBAPIError) -> str:
    """``database URL is unavailable: why`` for a connection error that escaped the store."""
    cli = ctx.obj if isinstance(ctx.obj, CliContext) else None
    store = cli._store if cli is not None else None
    if store is not None:
        return store.unavailable_message(exc)
    orig = exc.orig if exc.orig is not None else exc
    refused = connect_refusal(orig)
    return (f"database unavailable: {refused} ({orig})" if refused is not None
            else f"database unavailable: {orig}")


def _schema_missing(exc: DBAPIError) -> bool:
    """True when a statement failed because a reliable_beat table is missing (SQLite ``no
    such table``, PostgreSQL ``relation ... does not exist`` / SQLSTATE 42P01, MySQL 1146),
    never for a connection the server refused (``role ... does not exist``)."""
    orig = exc.orig
    text = str(orig)
    if "no such table" in text:
        return True
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if code == "42P01":
        return True
    args = getattr(orig, "args", ())
    if args and args[0] == 1146:
        return True
    return "relation" in text and "does not exist" in text


#: How to install the Celery adapter (named by every error about a missing Celery).
CELERY_EXTRA_HINT = "pip install 'reliable-beat[celery]'"


def load_app(spec: str | None, parent_app: Any = None) -> Any:
    """The app for ``-A spec`` (or the one ``celery -A proj reliable-beat`` already loaded,
    ``parent_app``), with its task modules imported, or None when neither is given.

    ``-A`` names a Celery app (``module`` or ``module:attr``); it is loaded by the adapter
    :data:`reliable_beat.adapters.DEFAULT_ADAPTER` (the Celery adapter), through
    :meth:`reliable_beat.adapters.AppAdapter.load_app`: the CLI imports no adapter itself.
    A spec naming another framework's app (a Dramatiq broker module, ``-A proj.broker``) is
    loaded by that framework's adapter (:func:`reliable_beat.adapters.adapter_for_spec`).

    Raises:
        click.ClickException: the Celery adapter cannot be imported (Celery is not installed:
            the message names the ``reliable-beat[celery]`` extra), or a task module of the
            app fails to import.
    """
    if not spec and parent_app is None:
        return None
    if spec:
        # another framework's app (a Dramatiq broker module): its own adapter loads it
        try:
            other = adapter_for_spec(spec)
        except ImportError:  # the default adapter's (Celery missing): said just below
            other = None
        if other is not None and other.name != DEFAULT_ADAPTER:
            return other.load_app(spec, parent_app)
    try:
        adapter = load_adapter(DEFAULT_ADAPTER)
    except ImportError as exc:
        what = f"-A {spec}" if spec else "the parent command's app"
        hint = "" if CELERY_EXTRA_HINT in str(exc) else f" ({CELERY_EXTRA_HINT})"
        raise click.ClickException(
            f"{what}: a Celery app needs the Celery adapter: {exc}{hint}; the commands run "
            "with --database-url instead of -A work without Celery"
        ) from exc
    return adapter.load_app(spec, parent_app)


@click.group(name="reliable-beat", cls=_Group)
@click.version_option(version=__version__, prog_name="reliable-beat",
                      message="%(prog)s %(version)s")
@click.option("-A", "--app", "app_spec", default=None, envvar="RELIABLE_BEAT_APP",
              help="Celery app, or Dramatiq broker module (module or module:attr) whose "
                   "reliable_beat settings to use.")
@click.option("--database-url", default=None, envvar="RELIABLE_BEAT_DATABASE_URL",
              help="Store URL; overrides reliable_beat_database_url.")
@click.pass_context
def reliable_beat(ctx: click.Context, app_spec: str | None, database_url: str | None) -> None:
    """Effectively-once periodic tasks for Celery: schema, entries, runs, relay, status."""
    parent = ctx.find_object(object) if ctx.parent is not None else None
    # mounted as `celery -A proj reliable-beat ...`: Celery loaded the app, not its tasks
    app = load_app(app_spec, getattr(parent, "app", None))
    from_env = (ctx.get_parameter_source("database_url")
                == click.core.ParameterSource.ENVIRONMENT)
    ctx.obj = CliContext(app=app, database_url=database_url,
                         database_url_origin=("$RELIABLE_BEAT_DATABASE_URL" if from_env
                                              else "--database-url"))


def _register_all() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(reliable_beat)


_register_all()


def main() -> None:
    """Run the ``reliable-beat`` command line (the console script)."""
    reliable_beat(prog_name="reliable-beat")


def _group_option_form() -> str:
    """``--database-url`` and ``-A`` are options of the ``reliable-beat`` group, given before
    the command: the forms that work for the command being run (``reliable-beat
    --database-url URL relay`` or ``reliable-beat -A APP relay``)."""
    ctx = click.get_current_context(silent=True)
    path = ctx.command_path.split() if ctx is not None else []
    root, rest = (path[0], " ".join(path[1:])) if path else ("reliable-beat", "COMMAND")
    rest = rest or "COMMAND"
    return f"`{root} --database-url URL {rest}` or `{root} -A APP {rest}` (the app's store)"
