"""Django's own database connection lent to reliable_beat (design.md invariant 5).

``IdempotentTask.transaction(using="default")`` and application code (a view committing an
order and its outbox message) need our SQLAlchemy Core statements (fenced completion,
outbox insert) to run **on Django's connection, inside Django's transaction**, so the ORM
effect and the idempotency key commit or roll back together. :func:`atomic_connection` does
that:

::

    with atomic_connection("default") as tx:          # transaction.atomic(using="default")
        Order.objects.create(...)                      # the ORM, on Django's connection
        outbox.add(tx, "webhook", {...})               # our Core statement, same connection

How: a SQLAlchemy engine per database alias and process whose "pool" hands out Django's
current DBAPI connection (``connections[alias].connection``) and whose dialect never
commits, rolls back, closes or reconfigures it (:class:`_BorrowedConnectionDialect`):
Django's ``atomic()`` alone ends the transaction. Nothing is pooled by us, so nothing is
shared across ``fork`` (prefork workers), and ``CONN_MAX_AGE`` / persistent connections are
Django's business as usual.

Supported Django backends: PostgreSQL on psycopg 3 or psycopg2, and SQLite (tests), for
joining; :func:`database_url` also derives a store URL from a MySQL/MariaDB database.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings as django_settings
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from sqlalchemy import create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.pool import NullPool

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError
from reliable_beat.runs import Claim

__all__ = ["atomic_connection", "database_url", "in_outer_atomic", "lent_alias", "result_writer"]


class _BorrowedConnectionDialect:
    """Mixin: the DBAPI connection belongs to Django; SQLAlchemy only runs statements on it.

    No commit, rollback or close reaches the driver (Django's ``atomic()`` decides), and no
    per-connection setup (notice handlers, type adapters, client encoding) is applied, so
    Django's own adapters (its ``jsonb`` loader, time zone handling) stay as Django set them.
    """

    def on_connect(self) -> None:
        return None

    def do_commit(self, dbapi_connection: Any) -> None:
        return None

    def do_rollback(self, dbapi_connection: Any) -> None:
        return None

    def do_close(self, dbapi_connection: Any) -> None:
        return None

    def do_terminate(self, dbapi_connection: Any) -> None:
        return None


class DjangoPsycopgDialect(_BorrowedConnectionDialect, PGDialect_psycopg):  # type: ignore[misc]
    """PostgreSQL on psycopg 3 over Django's connection."""

    supports_statement_cache = True


class DjangoPsycopg2Dialect(_BorrowedConnectionDialect, PGDialect_psycopg2):  # type: ignore[misc]
    """PostgreSQL on psycopg2 over Django's connection."""

    supports_statement_cache = True


class DjangoSQLiteDialect(_BorrowedConnectionDialect, SQLiteDialect_pysqlite):  # type: ignore[misc]
    """SQLite (the stdlib driver) over Django's connection."""

    supports_statement_cache = True


_DRIVERS = {
    "psycopg": "rb_django_psycopg",
    "psycopg2": "rb_django_psycopg2",
    "sqlite": "rb_django_sqlite",
}
registry.register("postgresql.rb_django_psycopg", __name__, "DjangoPsycopgDialect")
registry.register("postgresql.rb_django_psycopg2", __name__, "DjangoPsycopg2Dialect")
registry.register("sqlite.rb_django_sqlite", __name__, "DjangoSQLiteDialect")

#: Libpq options of ``DATABASES[alias]["OPTIONS"]`` carried into :func:`database_url`.
_LIBPQ_OPTIONS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "target_session_attrs")


def _settings_of(alias: str) -> dict[str, Any]:
    try:
        return dict(django_settings.DATABASES[alias])
    except KeyError:
        raise ConfigurationError(
            f"Django database alias {alias!r} is not in settings.DATABASES "
            f"(known: {sorted(django_settings.DATABASES)}); pass using=<an alias>"
        ) from None


#: Django's own backends by ENGINE (others, e.g. a wrapping third-party backend, are asked
#: for their ``vendor``): the MySQL one is known without importing its driver (mysqlclient),
#: which the store does not use (it speaks PyMySQL).
_ENGINE_VENDORS = {
    "django.db.backends.postgresql": "postgresql",
    "django.db.backends.postgresql_psycopg2": "postgresql",
    "django.contrib.gis.db.backends.postgis": "postgresql",
    "django.db.backends.sqlite3": "sqlite",
    "django.contrib.gis.db.backends.spatialite": "sqlite",
    "django.db.backends.mysql": "mysql",
    "django.contrib.gis.db.backends.mysql": "mysql",
}
#: What the message of an unsupported backend tells the user to do.
_STORE_FIX = (
    "set the store yourself: RELIABLE_BEAT = {'DATABASE_URL': '<a SQLAlchemy URL>'} in Django "
    "settings (or CELERY_RELIABLE_BEAT_DATABASE_URL / $RELIABLE_BEAT_DATABASE_URL) naming a "
    "PostgreSQL, MySQL/MariaDB or SQLite database; effect and key only commit together when "
    "it is also the database your tasks write"
)


def _vendor_of(alias: str) -> str:
    """``postgresql``, ``mysql``, ``sqlite`` or another backend's ``vendor`` for ``alias``."""
    engine = str(_settings_of(alias).get("ENGINE") or "")
    vendor = _ENGINE_VENDORS.get(engine)
    if vendor is not None:
        return vendor
    try:
        return str(connections[alias].vendor)
    except Exception as exc:  # an ENGINE that cannot be imported
        raise ConfigurationError(
            f"Django DATABASES[{alias!r}]['ENGINE'] = {engine!r} cannot be loaded "
            f"({type(exc).__name__}: {exc}); {_STORE_FIX}"
        ) from exc


def _driver_of(alias: str, *, join: bool = True) -> str:
    """The driver of ``alias``: ``psycopg``, ``psycopg2`` or ``sqlite`` (the DBAPI module
    Django uses), or ``pymysql`` (the store's MySQL/MariaDB driver; not with ``join``).

    Args:
        join: for joining Django's connection (:func:`atomic_connection`), where only
            PostgreSQL and SQLite connections can be lent; else for a store URL.

    Raises:
        ConfigurationError: an unknown alias, or another backend (Oracle, a third-party
            one; with ``join`` MySQL too), naming the fix.
    """
    vendor = _vendor_of(alias)
    if vendor == "sqlite":
        return "sqlite"
    if vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        return "psycopg" if is_psycopg3 else "psycopg2"
    engine = _settings_of(alias).get("ENGINE")
    if vendor == "mysql" and not join:
        return "pymysql"
    if vendor == "mysql":
        raise ConfigurationError(
            f"Django database {alias!r} is MySQL/MariaDB: reliable_beat.contrib.django joins "
            "PostgreSQL (psycopg 3 or psycopg2) and SQLite connections only, so "
            "self.transaction(using=...) / atomic_connection() cannot run on it; use "
            "self.transaction() (the store's own connection) and write the effect with "
            "SQLAlchemy there"
        )
    raise ConfigurationError(
        f"Django DATABASES[{alias!r}] uses ENGINE {engine!r} (vendor {vendor!r}): "
        f"reliable_beat cannot derive its store from it; {_STORE_FIX}"
    )


def _url(alias: str, driver: str, *, for_store: bool) -> URL:
    cfg = _settings_of(alias)
    if driver == "sqlite":
        name = str(cfg.get("NAME") or "")
        if not name or name == ":memory:" or name.startswith("file:"):
            raise ConfigurationError(
                f"Django database {alias!r} is an in-memory SQLite database; the store must be "
                "a file other processes (beat, worker, relay) can open"
            )
        return URL.create("sqlite" if for_store else f"sqlite+{_DRIVERS[driver]}",
                          database=os.path.abspath(name))
    options = cfg.get("OPTIONS") or {}
    port = int(cfg["PORT"]) if cfg.get("PORT") not in (None, "") else None
    host = str(cfg.get("HOST") or "") or None
    # a HOST that is a path is a Unix-socket directory (PostgreSQL) or socket (MySQL): it
    # goes in the query, as the drivers take it (the URL's host part cannot hold a path)
    socket = host if host is not None and host.startswith("/") else None
    if driver == "pymysql":
        charset = options.get("charset")
        query = {"charset": str(charset)} if charset else {}
        if socket is not None:
            query["unix_socket"] = socket
        return URL.create(
            "mysql+pymysql",
            username=cfg.get("USER") or None,
            password=cfg.get("PASSWORD") or None,
            host=None if socket is not None else host,
            port=None if socket is not None else port,
            database=cfg.get("NAME") or None,
            query=query,
        )
    query = {k: str(options[k]) for k in _LIBPQ_OPTIONS if options.get(k) is not None}
    if socket is not None:
        query["host"] = socket
        if port is not None:
            query["port"] = str(port)
    return URL.create(
        f"postgresql+{driver if for_store else _DRIVERS[driver]}",
        username=cfg.get("USER") or None,
        password=(cfg.get("PASSWORD") or None) if for_store else None,
        host=None if socket is not None else host,
        port=None if socket is not None else port,
        database=cfg.get("NAME") or None,
        query=query,
    )


def database_url(using: str = DEFAULT_DB_ALIAS) -> str:
    """The store URL (``reliable_beat_database_url``) for Django database ``using``.

    Derived from ``settings.DATABASES[using]`` (``NAME``, ``USER``, ``PASSWORD``, ``HOST``,
    ``PORT`` and the ``OPTIONS`` ``sslmode``/``sslrootcert``/``sslcert``/``sslkey``/
    ``target_session_attrs``), with the driver Django itself uses (psycopg 3 or psycopg2),
    so our tables live in the database of the effects, which invariant 5 requires. A
    MySQL/MariaDB database (``django.db.backends.mysql``) gives a ``mysql+pymysql`` URL
    (``OPTIONS["charset"]`` kept): the store's driver, whatever Django's is.

    Returns:
        A SQLAlchemy URL string with the password in clear (do not log it; the banner and
        the CLI show :func:`reliable_beat.db.dialects.redact_url` of it), e.g.
        ``"postgresql+psycopg://shop:...@db:5432/shop"``, ``"mysql+pymysql://shop:...@db/shop"``
        or ``"sqlite:////srv/db.sqlite3"``.

    Raises:
        ConfigurationError: unknown alias, an unsupported backend (Oracle, a third-party
            one: the message says to set ``RELIABLE_BEAT["DATABASE_URL"]``), or in-memory
            SQLite.
    """
    driver = _driver_of(using, join=False)
    return _url(using, driver, for_store=True).render_as_string(hide_password=False)


_engines: dict[tuple[int, str, str], Engine] = {}
_engines_lock = threading.Lock()


def _engine_for(alias: str) -> Engine:
    """This process's lending engine for ``alias`` (no pool: nothing survives a fork)."""
    driver = _driver_of(alias)
    key = (os.getpid(), alias, driver)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            kwargs: dict[str, Any] = {}
            if driver != "sqlite":
                kwargs["use_native_hstore"] = False  # never registers types on Django's conn

            def lend() -> Any:
                raw = connections[alias].connection
                if raw is None:  # pragma: no cover - atomic() connected it
                    raise RuntimeError(f"Django connection {alias!r} is not open")
                return raw

            engine = _engines[key] = create_engine(
                _url(alias, driver, for_store=False), creator=lend, poolclass=NullPool,
                **kwargs,
            )
        return engine


def lent_alias(engine: Engine) -> str | None:
    """The alias whose connection ``engine`` lends (an engine :func:`atomic_connection`
    made in this process), or None for any other engine."""
    with _engines_lock:
        for (pid, alias, _driver), mine in _engines.items():
            if mine is engine and pid == os.getpid():
                return alias
    return None


@contextmanager
def atomic_connection(using: str | None = None) -> Iterator[Connection]:
    """``transaction.atomic(using=using)`` yielding a SQLAlchemy ``Connection`` on Django's
    own connection, inside that transaction.

    Everything in the block commits together when the outermost ``atomic()`` commits, or
    rolls back together: ORM writes (``create``, ``select_for_update``, ``bulk_create``,
    signal handlers' writes), savepoints of nested ``atomic()`` blocks, and statements run
    on the yielded connection (``reliable_beat.outbox.add(tx, ...)``, the fenced
    completion). Nested inside an outer ``atomic()`` (``ATOMIC_REQUESTS``, a test case),
    the block is a savepoint and the outer block decides. ``transaction.on_commit`` hooks
    run after that commit, outside it.

    Args:
        using: the Django database alias (default ``"default"``), e.g. the one a database
            router picks for the model you write.

    Yields:
        A ``sqlalchemy.engine.Connection``; do not commit, roll back or close it (leaving
        the block does). Not for use in another thread.

    Raises:
        ConfigurationError: unknown alias or unsupported backend.
    """
    alias = using or DEFAULT_DB_ALIAS
    engine = _engine_for(alias)
    with transaction.atomic(using=alias):
        conn = engine.connect()
        try:
            yield conn
        finally:
            conn.close()  # reaches no driver call: the atomic() block ends the transaction


def in_outer_atomic(using: str | None = None) -> bool:
    """True while Django's connection ``using`` is inside an ``atomic()`` block."""
    return bool(connections[using or DEFAULT_DB_ALIAS].in_atomic_block)


def result_writer(using: str | None, store: Store, claim: Claim) -> Callable[[Any], None] | None:
    """For a run completed inside an outer ``atomic()``: store its result on that commit.

    The completion holds the run row's lock until the outer transaction commits; writing
    the result on the store's own connection before that would wait on our own lock. So the
    returned callable registers the write (:func:`reliable_beat.runs.set_result`) with
    ``transaction.on_commit``; it is dropped if the outer block rolls back, as the
    completion then is. Returns None when there is no outer block (write at once).
    """
    alias = using or DEFAULT_DB_ALIAS
    if not in_outer_atomic(alias):
        return None

    def deferred(result: Any) -> None:
        transaction.on_commit(lambda: runs.set_result(store, claim, result), using=alias)

    return deferred
