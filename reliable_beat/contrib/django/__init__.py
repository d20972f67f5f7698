"""Django, first class: the ORM effect commits with the idempotency key, an admin, a command.

Add ``"reliable_beat.contrib.django"`` to ``INSTALLED_APPS``. Inside an ``IdempotentTask``
body, ``with self.transaction() as tx:`` opens ``transaction.atomic()`` on Django's
connection to the store's database (``using="default"`` names the alias) and completes the
run (fenced) on that same connection, so whatever the ORM writes in the block commits or
rolls back with the key, the result and the outbox rows; an ORM write on another Django
connection in the block is refused (:mod:`reliable_beat.contrib.django.join`). See
``docs/django.md``.

Importing this package does not import Django; :mod:`reliable_beat.contrib.django.db` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["atomic_connection", "database_url", "default_database_url"]

APP = "reliable_beat.contrib.django"


def default_database_url() -> str | None:
    """The store URL implied by a configured Django project, or None.

    For settings code that must not import Django: returns ``database_url(<the
    RELIABLE_BEAT["DATABASE_ALIAS"] alias>)`` (or ``RELIABLE_BEAT["DATABASE_URL"]``) when
    Django is already imported, its settings are configured and ``INSTALLED_APPS`` holds this
    app; None otherwise (then the usual default applies). Never imports Django itself.
    """
    import sys

    if "django.conf" not in sys.modules:
        return None
    from django.conf import settings

    if not settings.configured or APP not in getattr(settings, "INSTALLED_APPS", ()):
        return None
    from reliable_beat.contrib.django import conf  # imports Django: only once configured

    return conf.django_store_url()


def __getattr__(name: str) -> Any:
    if name in ("atomic_connection", "database_url"):
        from reliable_beat.contrib.django import db  # imports Django: on first use

        return getattr(db, name)
    raise AttributeError(name)
