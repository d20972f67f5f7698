"""Where the Django app finds the store and the Celery app: one Django setting, a dict.

::

    RELIABLE_BEAT = {
        "CELERY_APP": "proj.celery:app",   # -A of the CLI; needed to requeue a dead letter
                                           # (the task is sent again) and for `describe`
        "DATABASE_ALIAS": "default",       # the Django database holding our tables
        "DATABASE_URL": None,              # the store URL; default: derived from that alias
    }

Every key is optional. The store URL is, first found: the Celery app's
``reliable_beat_database_url`` (any of its forms, e.g. ``CELERY_RELIABLE_BEAT_DATABASE_URL``),
``$RELIABLE_BEAT_DATABASE_URL``, ``RELIABLE_BEAT["DATABASE_URL"]``, then
:func:`reliable_beat.contrib.django.db.database_url` of the alias, so the tables live in the
database of the ORM effects (invariant 5). The app's ``ready()`` registers
:func:`database_url_source` with :func:`reliable_beat.settings.register_database_url_source`,
so beats, workers and relays of a Django project find the same store without the setting.

The Celery app (for ``describe``, requeue, ``-A``) is ``RELIABLE_BEAT["CELERY_APP"]``, else
found the way Celery's Django integration lays it out (:func:`celery_app`).

(One dict, not ``RELIABLE_BEAT_*`` settings:
Celery's ``config_from_object("django.conf:settings")`` exposes every Django setting, and
``reliable_beat_*`` keys there are read, and checked, as reliable_beat's own settings.)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

from reliable_beat.contrib.django.db import database_url
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError
from reliable_beat.settings import Settings

__all__ = ["celery_app", "database_alias", "database_url_source", "django_store_url", "option",
           "store", "store_settings", "store_url"]

_lock = threading.Lock()
_stores: dict[str, Store] = {}


_KEYS = ("CELERY_APP", "DATABASE_ALIAS", "DATABASE_URL")


def option(name: str) -> Any:
    """``settings.RELIABLE_BEAT[name]`` or None.

    Raises:
        ConfigurationError: ``RELIABLE_BEAT`` is not a dict or has an unknown key.
    """
    conf = getattr(settings, "RELIABLE_BEAT", None) or {}
    if not isinstance(conf, dict):
        raise ConfigurationError(f"settings.RELIABLE_BEAT must be a dict, got {conf!r}")
    unknown = sorted(set(conf) - set(_KEYS))
    if unknown:
        raise ConfigurationError(
            f"settings.RELIABLE_BEAT has unknown key(s) {unknown}; valid: {list(_KEYS)}")
    return conf.get(name)


def database_alias() -> str:
    """``RELIABLE_BEAT["DATABASE_ALIAS"]`` (default ``"default"``)."""
    return str(option("DATABASE_ALIAS") or "default")


def database_url_source() -> tuple[str, str]:
    """``(url, origin)`` of the store this Django project implies (see :func:`django_store_url`).

    Registered in ``AppConfig.ready()`` as the ``"django"`` store-URL source; the origin is
    what banners and ``status`` print after "from": ``"Django RELIABLE_BEAT['DATABASE_URL']"``
    or ``"Django DATABASES['default']"``.

    Raises:
        ConfigurationError: the alias is unknown or its ENGINE unsupported (the message says
            to set ``RELIABLE_BEAT["DATABASE_URL"]``).
    """
    explicit = option("DATABASE_URL")
    if explicit:
        return str(explicit), "Django RELIABLE_BEAT['DATABASE_URL']"
    alias = database_alias()
    return database_url(alias), f"Django DATABASES[{alias!r}]"


def django_store_url() -> str:
    """``RELIABLE_BEAT["DATABASE_URL"]``, else the URL of the ``DATABASE_ALIAS`` database."""
    return database_url_source()[0]


def store_url() -> str:
    """The store URL the beats and workers of this project use (first found): the Celery
    app's ``reliable_beat_database_url`` setting, ``$RELIABLE_BEAT_DATABASE_URL``,
    ``RELIABLE_BEAT["DATABASE_URL"]``, the Django database's (:func:`store_settings`)."""
    return store_settings().database_url


def store() -> Store:
    """This process's store for the admin and the command (role ``cli``), made once."""
    url = store_url()
    with _lock:
        found = _stores.get(url)
        if found is None:
            found = _stores[url] = Store.from_url(url, role="cli")
        return found


_found: dict[str, Any] = {}


def _clear(**_: Any) -> None:
    with _lock:
        _found.clear()


setting_changed.connect(_clear, dispatch_uid="reliable_beat_conf_setting_changed")


def _is_celery_app(obj: Any) -> bool:
    try:
        from celery import Celery
    except ImportError:  # pragma: no cover - celery is a dependency
        return False
    return isinstance(obj, Celery)


def _project_app() -> Any:
    """The Celery app of the Django project's package, as Celery's Django docs lay it out:
    ``proj/__init__.py`` exports ``celery_app`` (``from .celery import app as celery_app``),
    or ``proj/celery.py`` defines ``app``; ``proj`` is the package of ``SETTINGS_MODULE``."""
    module = str(getattr(settings, "SETTINGS_MODULE", None) or "")
    parts = module.split(".")[:-1]
    for depth in range(len(parts), 0, -1):  # proj.settings.prod -> proj.settings, proj
        package = ".".join(parts[:depth])
        try:
            pkg = importlib.import_module(package)
        except ImportError:
            continue
        if _is_celery_app(getattr(pkg, "celery_app", None)):
            return pkg.celery_app
        name = f"{package}.celery"
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            mod = importlib.import_module(name)
            for attr in ("app", "celery", "celery_app"):
                if _is_celery_app(getattr(mod, attr, None)):
                    return getattr(mod, attr)
    return None


def _current_app() -> Any:
    """The app made current by the process (``celery.current_app``), or None when only
    Celery's fallback ``default`` app would answer."""
    from celery import _state

    app = getattr(_state._tls, "current_app", None) or _state.default_app
    if app is None or getattr(app, "main", None) == "default":  # Celery's fallback app
        return None
    return app


def celery_app() -> Any:
    """The Celery app of this project, or None.

    Found, first match: ``RELIABLE_BEAT["CELERY_APP"]`` (``"proj.celery:app"``, as ``-A``
    takes it); the project package's ``celery_app`` or ``celery.app`` (Celery's Django
    layout, see :func:`_project_app`); ``celery.current_app`` when a process created an app
    (a worker, a beat, a shell that imported the tasks). Its task modules are loaded as a
    worker loads them (``autodiscover_tasks``), so its tasks are known: the admin's
    ``describe`` names the task kind.
    """
    spec = option("CELERY_APP")
    key = f"spec:{spec}" if spec else "auto"
    with _lock:
        if key in _found:
            return _found[key]
    if spec:
        from celery.app.utils import find_app

        app = find_app(str(spec))
    else:
        app = _project_app() or _current_app()
    if app is not None:
        # the Celery adapter (it imports Celery and the CLI): only once an app was found
        from reliable_beat.celery.commands import prepare_app

        app = prepare_app(app)
        with _lock:
            _found[key] = app  # None is not kept: a process may create its app later
    return app


def store_settings() -> Settings:
    """The ``reliable_beat_*`` settings of the Celery app (defaults without one)."""
    app = celery_app()
    return Settings.from_celery(app) if app is not None else Settings()
