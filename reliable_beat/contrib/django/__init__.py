"""Django, first class: the ORM effect commits with the idempotency key, an admin, a command.

Add ``"reliable_beat.contrib.django"`` to ``INSTALLED_APPS``. Inside an ``IdempotentTask``
body, ``with self.transaction(using="default") as tx:`` opens ``transaction.atomic()`` on
Django's connection and completes the run (fenced) on that same connection, so whatever the
ORM writes in the block commits or rolls back with the key, the result and the outbox rows.
See ``docs/django.md``.

Importing this package does not import Django; :mod:`reliable_beat.contrib.django.db` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["atomic_connection", "database_url"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from reliable_beat.contrib.django import db

        return getattr(db, name)
    raise AttributeError(name)
