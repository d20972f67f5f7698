"""Where the Django app finds the store and the Celery app (Django settings).

* ``RELIABLE_BEAT_DATABASE_URL``: the store URL. Default: derived from
  ``DATABASES[RELIABLE_BEAT_DATABASE_ALIAS]``
  (:func:`reliable_beat.contrib.django.db.database_url`), so the tables live in the
  database of the ORM effects (invariant 5).
* ``RELIABLE_BEAT_DATABASE_ALIAS``: that alias; default ``"default"``.
* ``RELIABLE_BEAT_CELERY_APP``: the Celery app, ``"proj.celery:app"`` (``-A`` of the CLI):
  needed to requeue a dead letter (the task is sent again) and for ``describe``'s task kind.
"""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings

from reliable_beat.contrib.django.db import database_url
from reliable_beat.db.dialects import Store
from reliable_beat.settings import Settings

__all__ = ["celery_app", "database_alias", "store", "store_settings", "store_url"]

_lock = threading.Lock()
_stores: dict[str, Store] = {}


def database_alias() -> str:
    """``settings.RELIABLE_BEAT_DATABASE_ALIAS`` (default ``"default"``)."""
    return str(getattr(settings, "RELIABLE_BEAT_DATABASE_ALIAS", "default"))


def store_url() -> str:
    """The store URL: ``settings.RELIABLE_BEAT_DATABASE_URL``, else the Django database's."""
    explicit = getattr(settings, "RELIABLE_BEAT_DATABASE_URL", None)
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
    """The Celery app named by ``settings.RELIABLE_BEAT_CELERY_APP``, or None."""
    spec = getattr(settings, "RELIABLE_BEAT_CELERY_APP", None)
    if not spec:
        return None
    from celery.app.utils import find_app

    return find_app(str(spec))


def store_settings() -> Settings:
    """The ``reliable_beat_*`` settings of the Celery app (defaults without one)."""
    app = celery_app()
    return Settings.from_celery(app) if app is not None else Settings()
