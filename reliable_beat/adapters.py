"""The framework adapter hook: how the framework-neutral core reaches a framework's app.

The core (beat, runs, outbox, relay, re-dispatch, runtime, workflows ...) never imports Celery,
kombu or an adapter package (``tests/unit/test_core_imports.py`` enforces it). Where a core
function is given a framework *app* (``Relay(store, app)``, ``runtime.trigger(..., app=app)``,
``redispatch_stuck_runs(store, app, ...)``, ``workflow(app=app)``), it asks that app's adapter,
found here, for the framework-specific part: its outbox handlers, its publish, its registry of
tracked tasks.

Adapters are registered by name, as ``"package.module:attr"`` strings resolved on first use
(so importing the core imports no framework): the built-in Celery adapter
(:data:`BUILTIN_ADAPTERS`), then the entry point group :data:`ENTRY_POINT_GROUP`, then
:func:`register_adapter`. An app belongs to the adapter whose name is the top-level package
of a class in the app's type's MRO (``celery.app.base.Celery`` -> ``celery``); any other app
object is taken as a Celery app, as before the core was made framework-neutral.

The command line reaches an adapter the same way: ``-A`` loads the app through
:meth:`AppAdapter.load_app` of :data:`DEFAULT_ADAPTER`, ``entries import`` uses its
:meth:`AppAdapter.importers`; an adapter adds its own commands through the entry point group
:data:`CLI_ENTRY_POINT_GROUP` (loaded by :mod:`reliable_beat.cli`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reliable_beat.errors import ConfigurationError
from reliable_beat.settings import Settings

if TYPE_CHECKING:
    from reliable_beat.db.dialects import Store
    from reliable_beat.messages import OutboxMessage
    from reliable_beat.triggers import Trigger

__all__ = [
    "BUILTIN_ADAPTERS",
    "CLI_ENTRY_POINT_GROUP",
    "DEFAULT_ADAPTER",
    "ENTRY_POINT_GROUP",
    "AppAdapter",
    "adapter_for",
    "adapter_for_spec",
    "app_lease_seconds",
    "app_settings",
    "load_adapter",
    "register_adapter",
]

#: Entry point group for third-party adapters: ``name = "package.module:attr"`` (an
#: :class:`AppAdapter`), ``name`` being the top-level package of the framework's app class.
ENTRY_POINT_GROUP = "reliable_beat.adapters"
#: Entry point group for adapters' command-line commands: ``name = "package.module:attr"``, a
#: :class:`click.Command` (usually a group) mounted as ``reliable-beat <name>``.
CLI_ENTRY_POINT_GROUP = "reliable_beat.cli"
#: The adapters that ship with reliable_beat (name -> ``"module:attr"``).
BUILTIN_ADAPTERS: dict[str, str] = {
    "celery": "reliable_beat.celery.adapter:ADAPTER",
    "dramatiq": "reliable_beat.dramatiq.adapter:ADAPTER",
}
#: The adapter of an app object no registered adapter claims.
DEFAULT_ADAPTER = "celery"

_registered: dict[str, str] = {}
_loaded: dict[str, AppAdapter] = {}


@runtime_checkable
class AppAdapter(Protocol):
    """What the core asks a framework adapter about one of its apps.

    ``publish`` returns ``[(outbox id, None or the error)]``, one per message, in order
    (the contract of :func:`reliable_beat.redispatch.redispatch_with`).
    """

    name: str

    def handlers(self, app: Any) -> dict[str, Callable[[OutboxMessage], None]]:
        """The outbox handlers of ``app``'s broker (destination name -> handler)."""
        ...

    def publish(self, app: Any, messages: list[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        """Publish trigger rows into ``app``'s broker (no outbox bookkeeping)."""
        ...

    def publish_triggers(self, store: Store, app: Any, triggers: list[Trigger],
                         now: datetime) -> int:
        """Publish just-committed triggers at once and mark them sent; how many went out."""
        ...

    def tracked_tasks(self, app: Any) -> list[str]:
        """Names of ``app``'s tasks that keep run state (idempotent tasks)."""
        ...

    def task_kind(self, app: Any, task: str) -> str:
        """``idempotent``, ``plain`` or ``unknown`` (``app`` does not register ``task``)."""
        ...

    def lease_seconds(self, app: Any, task: str) -> float | None:
        """The run lease ``task`` declares itself, in seconds (None: the settings' default)."""
        ...

    def task_function(self, app: Any, task: str) -> Callable[..., Any] | None:
        """The function a worker calls with an entry's args / kwargs for ``task`` (a bound
        task's ``self`` already bound), None when ``app`` does not register ``task`` or its
        arguments are not checked; used to refuse arguments that cannot fit."""
        ...

    def settings(self, app: Any, database_url: tuple[str, str] | None = None) -> Settings:
        """The ``reliable_beat`` settings ``app`` runs with; ``database_url`` (``(url,
        origin)``, the CLI's ``--database-url``) replaces the store URL.

        Raises:
            ConfigurationError: a bad setting (named), or the app carries none.
        """
        ...

    def install_workflows(self, app: Any) -> Callable[[], Store]:
        """Install the workflow advance task on ``app``; returns its store factory."""
        ...

    # What the command line (reliable_beat.cli) asks; it imports no adapter itself.

    def load_app(self, spec: str | None, parent_app: Any = None) -> Any:
        """The app named by ``spec`` (``-A spec``: ``module`` or ``module:attr``), or
        ``parent_app`` (the one a framework's own command already loaded), with its task
        modules imported, as the framework's worker would; None when neither is given.

        Raises:
            click.ClickException: the app or one of its task modules fails to import (the
                message names it).
        """
        ...

    def app_timezone(self, app: Any) -> str:
        """The IANA zone ``app`` evaluates schedules in (the default of entries without one)."""
        ...

    def importers(self) -> Any:
        """The module that imports this framework's foreign schedulers' entries:
        ``read_<source>(...) -> [ForeignEntry]`` per source, ``import_entries(store, found,
        ...) -> [ImportOutcome]`` and ``summary(outcomes) -> {action: count}`` (the Celery
        adapter's: :mod:`reliable_beat.celery.importers`, RedBeat and django-celery-beat)."""
        ...


def register_adapter(name: str, spec: str) -> None:
    """Register (or replace) the adapter for apps whose class lives in package ``name``.

    Args:
        name: a top-level package name (``"celery"``).
        spec: ``"package.module:attr"`` of an :class:`AppAdapter`, imported on first use.
    """
    _registered[name] = spec
    _loaded.pop(name, None)


def _specs() -> dict[str, str]:
    from importlib.metadata import entry_points

    specs = dict(BUILTIN_ADAPTERS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        specs[ep.name] = ep.value
    specs.update(_registered)
    return specs


def load_adapter(name: str) -> AppAdapter:
    """The adapter registered as ``name``, imported on first use.

    Raises:
        ConfigurationError: no adapter has that name, or its spec names no object.
        ImportError: the adapter's framework is not installed (the Celery adapter's message
            names the ``reliable-beat[celery]`` extra).
    """
    if name in _loaded:
        return _loaded[name]
    spec = _specs().get(name)
    if spec is None:
        raise ConfigurationError(
            f"no reliable_beat adapter named {name!r}: register one with "
            f"reliable_beat.adapters.register_adapter or the {ENTRY_POINT_GROUP!r} entry "
            "point group")
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)  # ImportError: the framework is missing
    try:
        adapter: AppAdapter = getattr(module, attr)
    except AttributeError as exc:
        raise ConfigurationError(
            f"reliable_beat adapter {name!r}: {spec!r} names no object ({exc})") from exc
    _loaded[name] = adapter
    return adapter


def adapter_for(app: Any) -> AppAdapter:
    """The adapter of framework ``app`` (see the module docstring for how it is found).

    Raises:
        ValueError: ``app`` is None (the caller has no app: it must not ask).
        ImportError: the adapter's framework is not installed.
    """
    if app is None:
        raise ValueError("adapter_for(None): there is no framework app to adapt")
    specs = _specs()
    for cls in type(app).__mro__:
        top = (getattr(cls, "__module__", "") or "").partition(".")[0]
        if top in specs and top != "builtins":
            return load_adapter(top)
    return load_adapter(DEFAULT_ADAPTER)


def app_settings(app: Any, database_url: tuple[str, str] | None = None) -> Settings:
    """The settings of framework ``app`` (its adapter's :meth:`AppAdapter.settings`; an
    adapter written before that method existed: Celery's ``app.conf``)."""
    adapter = adapter_for(app)
    read = getattr(adapter, "settings", None)
    if callable(read):
        settings: Settings = read(app, database_url=database_url)
        return settings
    return Settings.from_celery(app, database_url=database_url)


def app_lease_seconds(app: Any, task: str) -> float | None:
    """The run lease ``app``'s ``task`` declares (its adapter's
    :meth:`AppAdapter.lease_seconds`), None when it declares none."""
    read = getattr(adapter_for(app), "lease_seconds", None)
    return read(app, task) if callable(read) else None


def app_task_function(app: Any, task: str) -> Callable[..., Any] | None:
    """The function ``app``'s worker calls for ``task`` (its adapter's
    :meth:`AppAdapter.task_function`); None when unknown here or the adapter predates it."""
    read = getattr(adapter_for(app), "task_function", None)
    return read(app, task) if callable(read) else None


def task_function_checker(app: Any) -> Callable[[str], Callable[..., Any] | None] | None:
    """``task name -> function`` for :func:`reliable_beat.entries.definition_from_celery`'s
    argument check against ``app`` (None without an app: nothing is checked)."""
    if app is None:
        return None
    return lambda task: app_task_function(app, task)


def _framework_of(value: Any, names: set[str]) -> str | None:
    """The registered adapter name (in ``names``) of an app-like object, by its type's MRO;
    None for classes, modules, functions and other plain Python objects."""
    for cls in type(value).__mro__:
        top = (getattr(cls, "__module__", "") or "").partition(".")[0]
        if top in names and top != "builtins":
            return top
    return None


def import_from_cwd(module_name: str) -> Any:
    """``importlib.import_module(module_name)`` with the current directory importable, as
    ``celery -A proj`` and ``dramatiq proj`` make it (``./proj`` found without PYTHONPATH).

    Raises:
        whatever the import raises (ImportError, or the module's own error).
    """
    import os
    import sys

    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(module_name)


def adapter_for_spec(spec: str) -> AppAdapter:
    """The adapter of the app ``-A spec`` names (``module`` or ``module:attr``).

    The module is imported (the current directory importable, as ``celery -A`` and
    ``dramatiq`` do) and the object ``attr`` names, or without ``attr`` the module's
    app-like objects, are matched to a registered adapter the way :func:`adapter_for`
    matches an app (``dramatiq.brokers.redis.RedisBroker`` -> ``dramatiq``). Anything else
    (a module that does not import, a Celery spec such as ``proj.app``, objects of no other
    registered framework, or of several) goes to :data:`DEFAULT_ADAPTER`, whose loader
    reports a bad spec as before.

    Raises:
        ConfigurationError, ImportError: see :func:`load_adapter`.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = import_from_cwd(module_name)
    except Exception:  # the default adapter's loader imports it again and says why
        return load_adapter(DEFAULT_ADAPTER)
    names = set(_specs())
    if attr:
        values = [getattr(module, attr)] if hasattr(module, attr) else []
    else:
        values = list(vars(module).values())
    found = {n for n in (_framework_of(v, names) for v in values) if n is not None}
    if len(found) == 1:
        return load_adapter(found.pop())
    return load_adapter(DEFAULT_ADAPTER)
