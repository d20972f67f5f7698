"""Which connection a body's transaction runs on when the user names none (invariant 10).

An ``IdempotentTask`` (Celery) or ``IdempotentActor`` (Dramatiq) body writes its effect in
``transaction()``: the effect commits with the idempotency key only if it is written on the
connection the block holds. A framework with its own connections (Django's ORM) makes the
other case easy to write by accident: ``Model.objects.create()`` inside a block on the
store's SQLAlchemy connection commits at once on the ORM's connection, and a retry, a
redelivery or a stale runner repeats it. So a framework registers a :class:`Join` (the core
imports no framework; Django's app does it in ``AppConfig.ready()``), and the adapters:

* open the block on the framework's connection when the store is one of its databases and
  the user named no connection (:meth:`Join.default_alias`): the safe path is the default;
* refuse, inside the block, a write on any framework connection that is not the block's
  (:meth:`Join.guard`), with a message naming ``using=``.

Nothing is registered outside such a framework: the block is the store's own transaction.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from sqlalchemy.engine import URL, Connection, Engine

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError

__all__ = ["Join", "check_same_database", "for_using", "guard", "register", "registered",
           "same_database"]


class Join(Protocol):
    """A framework's connections as a body's transaction can use them (Django: the app's
    :data:`reliable_beat.contrib.django.join.JOIN`)."""

    def default_alias(self, store: Store) -> str | None:
        """The framework database (alias) that is ``store``'s database and can be joined,
        or None: the block then runs on the store's own connection."""

    def atomic(self, alias: str) -> AbstractContextManager[Connection]:
        """A transaction on the framework's connection ``alias``, yielding a SQLAlchemy
        ``Connection`` on it (the framework ends the transaction)."""

    def alias_of(self, conn: Connection) -> str | None:
        """The alias whose connection ``conn`` lends (one :meth:`atomic` yielded), or None."""

    def guard(self, alias: str | None, *, where: str, task_name: str, store: Store,
              fix: str | None = None) -> AbstractContextManager[None]:
        """For the block's duration: a write on a framework connection other than
        ``alias``'s (all of them when None) raises ``ConfigurationError`` naming the fix
        (``fix``, else ``where(using=...)``)."""

    def result_writer(self, alias: str, store: Store,
                      claim: runs.Claim) -> Callable[[Any], None] | None:
        """How to store the result of a run completed in a transaction joined to an outer
        one on ``alias`` (None: store it at once)."""


_registered: Join | None = None
_lock = threading.Lock()


def register(join: Join | None) -> None:
    """Register the process's framework :class:`Join` (None: unregister). Replaces one
    registered before."""
    global _registered
    with _lock:
        _registered = join


def registered() -> Join | None:
    """The registered :class:`Join`, or None."""
    return _registered


def for_using(using: str, where: str) -> Join:
    """The :class:`Join` for an explicit ``using=`` alias: the registered one, else
    Django's (``using=`` names a Django database even without the app in
    ``INSTALLED_APPS``).

    Raises:
        ConfigurationError: Django is not installed (the message names the extra).
    """
    found = registered()
    if found is not None:
        return found
    try:
        module = importlib.import_module("reliable_beat.contrib.django.join")
    except ImportError as exc:
        raise ConfigurationError(
            f"{where}(using={using!r}) joins Django's connection and needs Django ({exc}); "
            "pip install 'reliable-beat[django]'"
        ) from exc
    join: Join = module.JOIN
    return join


def guard(join: Join | None, alias: str | None, *, where: str, task_name: str,
          store: Store, fix: str | None = None) -> AbstractContextManager[None]:
    """``join.guard(...)``, or a no-op without a framework."""
    if join is None:
        return nullcontext()
    return join.guard(alias, where=where, task_name=task_name, store=store, fix=fix)


_DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}


def same_database(a: URL, b: URL) -> bool:
    """True when SQLAlchemy URLs ``a`` and ``b`` name one database (driver and password
    aside): the same backend, host, port (a missing one is the backend's default) and
    database name; for SQLite the same file (relative paths resolved in this process)."""
    backend = a.get_backend_name()
    if backend != b.get_backend_name():
        return False
    if backend == "sqlite":
        return bool(a.database) and bool(b.database) and \
            os.path.abspath(str(a.database)) == os.path.abspath(str(b.database))
    default = _DEFAULT_PORTS.get(backend)
    return _where(a, default) == _where(b, default)


def _where(url: URL, default: int | None) -> tuple[str, Any, str | None]:
    """Host (or Unix socket: ``?host=/dir``, ``?unix_socket=...``), port and database."""
    host = url.host or str(url.query.get("host") or url.query.get("unix_socket") or "")
    port = url.port or url.query.get("port") or default
    return host, str(port) if port is not None else None, url.database


def check_same_database(engine: Engine, store: Store) -> None:
    """Refuse a transaction on another database than the store's.

    Raises:
        ConfigurationError: naming both databases (passwords hidden).
    """
    if not same_database(engine.url, store.engine.url):
        raise ConfigurationError(
            f"the transaction's database {engine.url.render_as_string(hide_password=True)} "
            f"is not the reliable_beat store {store.safe_url}; effect and key cannot commit "
            "together"
        )

