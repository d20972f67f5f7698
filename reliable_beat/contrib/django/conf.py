"""Where the Django app finds the store and the Celery app: one Django setting, a dict.

::

    RELIABLE_BEAT = {
        "CELERY_APP": "proj.celery:app",   # -A of the CLI; needed to requeue a dead letter
                                           # (the task is sent again) and for `describe`
        "DATABASE_ALIAS": "default",       # the Django database holding our tables
        "DATABASE_URL": None,              # the store URL; default: derived from that alias
    }

Every key is optional. The default store URL is
:func:`reliable_beat.contrib.django.db.database_url` of the alias, so the tables live in the
database of the ORM effects (invariant 5). (One dict, not ``RELIABLE_BEAT_*`` settings:
Celery's ``config_from_object("django.conf:settings")`` exposes every Django setting, and
``reliable_beat_*`` keys there are read, and checked, as reliable_beat's own settings.)
"""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings

from reliable_beat.contrib.django.db import database_url
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError
from reliable_beat.settings import Settings

__all__ = ["celery_app", "database_alias", "option", "store", "store_settings", "store_url"]

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


def store_url() -> str:
    """The store URL: ``RELIABLE_BEAT["DATABASE_URL"]``, else the Django database's."""
    explicit = option("DATABASE_URL")
    return str(explicit) if explicit else database_url(database_alias())


def store() -> Store:
    """This process's store for the admin and the command (role ``cli``), made once."""
    url = store_url()
    with _lock:
        found = _stores.get(url)
        if found is None:
            found = _stores[url] = Store.from_url(url, role="cli")
        return found


def celery_app() -> Any:
    """The Celery app named by ``RELIABLE_BEAT["CELERY_APP"]``, or None."""
    spec = option("CELERY_APP")
    if not spec:
        return None
    from celery.app.utils import find_app

    return find_app(str(spec))


def store_settings() -> Settings:
    """The ``reliable_beat_*`` settings of the Celery app (defaults without one)."""
    app = celery_app()
    return Settings.from_celery(app) if app is not None else Settings()
