"""Schema migrations: :func:`upgrade`, :func:`check`, :func:`current`, around Alembic.

The migrations ship inside the package (``reliable_beat/db/migrations``) and record their
revision in their own table, ``reliable_beat_alembic_version``. Several processes may call
:func:`upgrade` at once: on PostgreSQL it runs under a transaction-level advisory lock, on
MySQL/MariaDB under the named lock ``GET_LOCK('reliable_beat_migrate')``, on SQLite under
the write lock, so only one applies each revision.
"""

from __future__ import annotations

import io
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection

from reliable_beat.db.dialects import Store
from reliable_beat.errors import SchemaError
from reliable_beat.redaction import get_logger

__all__ = ["MIGRATIONS_DIR", "check", "current", "ensure_schema", "head", "upgrade"]

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
VERSION_TABLE = "reliable_beat_alembic_version"
#: Arbitrary 64-bit key for pg_advisory_xact_lock while migrating ("rbeat").
_ADVISORY_KEY = 0x7262656174
#: MySQL/MariaDB named lock (GET_LOCK) held while migrating, and how long to wait for it.
_MYSQL_LOCK = "reliable_beat_migrate"
_MYSQL_LOCK_WAIT_SECONDS = 300
log = get_logger("reliable_beat.migrate")


def _config(url: str = "", stdout: io.StringIO | None = None) -> Config:
    cfg = Config(output_buffer=stdout) if stdout is not None else Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def _known(revision: str) -> bool:
    """True when ``revision`` is one of this package's migrations."""
    try:
        return ScriptDirectory.from_config(_config()).get_revision(revision) is not None
    except Exception:
        return False


def head() -> str:
    """The newest revision shipped with this package."""
    rev = ScriptDirectory.from_config(_config()).get_current_head()
    assert rev is not None
    return rev


def _current(conn: Connection) -> str | None:
    ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return ctx.get_current_revision()


def current(store: Store) -> str | None:
    """The revision the database is at, or None when reliable_beat's tables were never created.

    Raises:
        StoreUnavailableError: the database cannot be reached or refused the connection (no
            such role or database, a wrong password): never read as "no schema".
    """
    with store.connect() as conn:
        return _current(conn)


def check(store: Store) -> bool:
    """True when the database is at :func:`head` (usable as a readiness probe)."""
    return current(store) == head()


def upgrade(store: Store, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` in one transaction. Safe from several processes.

    Raises:
        StoreUnavailableError: the database cannot be reached or refused the connection.
        SchemaError: on MySQL/MariaDB, another upgrade held the migration lock for
            300 s.
    """
    if store.dialect in ("mysql", "mariadb"):
        _upgrade_mysql(store, revision)
        return
    with store.begin() as conn:
        if store.dialect == "postgresql":
            # Released by the commit, so the next upgrader reads the committed revision.
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADVISORY_KEY})
        _apply(conn, store.url, revision)


def _upgrade_mysql(store: Store, revision: str) -> None:
    # A session-level named lock: MySQL DDL commits implicitly, so no transaction lock would
    # outlive the first CREATE TABLE. The lock is released only after the commit: the last
    # revision's version-table UPDATE is not committed by any later DDL, and an upgrader
    # taking the lock before it is would read the previous revision and apply it again.
    with store.connect() as conn:
        got = conn.execute(text("SELECT GET_LOCK(:n, :t)"),
                           {"n": _MYSQL_LOCK, "t": _MYSQL_LOCK_WAIT_SECONDS}).scalar()
        conn.commit()
        if got != 1:
            raise SchemaError(
                f"database {store.safe_url}: another `reliable-beat db upgrade` held the "
                f"migration lock {_MYSQL_LOCK!r} for {_MYSQL_LOCK_WAIT_SECONDS} s; "
                "run it again when that one has finished")
        try:
            with conn.begin():
                _apply(conn, store.url, revision)
        finally:
            conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": _MYSQL_LOCK})
            conn.commit()


def _apply(conn: Connection, url: str, revision: str) -> None:
    cfg = _config(url)
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, revision)


def upgrade_sql(url: str, revision: str = "head") -> str:
    """The SQL :func:`upgrade` would run (Alembic offline mode), for a DBA to review."""
    out = io.StringIO()
    command.upgrade(_config(url, out), revision, sql=True)
    return out.getvalue()


def ensure_schema(store: Store, *, run_migrations: bool) -> None:
    """Make sure the schema is at head before a process starts working.

    An embedded SQLite store, or any store when ``run_migrations`` is true, is upgraded in
    place. A server database that is behind is an error.

    Raises:
        SchemaError: the database is behind and migrations are not to be run here; the
            message names ``reliable-beat db upgrade``.
    """
    at = current(store)
    if at == head():
        return
    if at is not None and not _known(at):
        # A newer release upgraded the schema (expand/contract): keep running on it.
        log.warning("database %s is at schema revision %s, newer than this reliable_beat's "
                    "%s; running on it (upgrade this process soon)", store.safe_url, at, head())
        return
    if run_migrations or store.dialect == "sqlite":
        upgrade(store)
        return
    raise SchemaError(
        f"database {store.safe_url} is at schema revision {at or '(none)'}, this reliable_beat "
        f"needs {head()}: run `reliable-beat db upgrade` (or set "
        "reliable_beat_run_migrations = True to upgrade on start)"
    )
