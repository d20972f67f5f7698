"""Per-dialect choices, made once per engine: locking, upserts, the clock, connection setup.

* PostgreSQL: ``FOR UPDATE SKIP LOCKED``, ``ON CONFLICT DO NOTHING``, ``RETURNING``,
  ``clock_timestamp()``; each role's connections get server-side bounds
  (``idle_in_transaction_session_timeout``, ``lock_timeout``) so a frozen process cannot hold
  rows hostage. A ``timestamptz`` Python cannot hold (``'infinity'``, ``'-infinity'``, a year
  after 9999 or BC, written by hand) reads as :data:`~reliable_beat.db.types.INFINITY` /
  :data:`~reliable_beat.db.types.NEG_INFINITY` (psycopg 3 and psycopg2), never as an error
  that fails the whole result: :mod:`reliable_beat.rows` flags the row as malformed.
* SQLite: every write transaction is ``BEGIN IMMEDIATE`` (serialised writers, the
  single-writer equivalent of SKIP LOCKED), WAL journal, a busy timeout; ``ON CONFLICT DO
  NOTHING``; the clock is the single host's clock (there is no server).
* MySQL 8 / MariaDB 10.6+ (driver: PyMySQL, ``mysql+pymysql://``; tested on MariaDB):
  ``FOR UPDATE SKIP LOCKED``; ``INSERT IGNORE`` for duplicates, checked so that only
  duplicate-key warnings (1062) are ignored and any other downgraded error (a truncated
  string, a NULL into NOT NULL) raises; no ``RETURNING`` on ``UPDATE`` (see
  :func:`update_returning`); the clock is ``UTC_TIMESTAMP(6)``; every session runs READ
  COMMITTED (PostgreSQL's semantics: no gap locks, each statement sees the latest commits),
  UTC, strict SQL mode, ``innodb_lock_wait_timeout`` from the role and, on MariaDB,
  ``idle_transaction_timeout`` (MySQL 8 has no idle-in-transaction bound: a frozen process
  holds its row locks until its connection dies, see docs/stacks.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, Select, Table, create_engine, event, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.sql.dml import Insert, Update

from reliable_beat.db.tables import MYSQL_DIALECTS
from reliable_beat.db.types import INFINITY, NEG_INFINITY
from reliable_beat.errors import ConfigurationError, StoreUnavailableError
from reliable_beat.redaction import redact_text, redact_url

__all__ = ["MYSQL_DIALECTS", "ROLE_TIMEOUTS_MS", "Store", "redact_url", "update_returning"]

# MYSQL_DIALECTS: SQLAlchemy dialect names of the MySQL family (``mysql+pymysql://``
# against MariaDB is still ``mysql``; ``mariadb+pymysql://`` is ``mariadb``).

#: Server-side bounds per process role, in milliseconds: (idle in transaction, lock wait).
#: The beat's claim transactions are short, so a beat frozen inside one (GC pause, SIGSTOP)
#: loses its transaction after 5 s and other beats take its entries over.
#: Workers run user bodies inside a transaction, so they get no idle bound by default.
ROLE_TIMEOUTS_MS: dict[str, tuple[int, int]] = {
    "beat": (5_000, 5_000),
    "relay": (30_000, 5_000),
    "worker": (0, 30_000),
    "cli": (0, 30_000),
}

#: Roles whose pooled connections are pinged on checkout only after this many seconds in
#: the pool (instead of on every checkout): a worker checks a connection out two or three
#: times per execution, and every ``SELECT 1`` was a round trip as long as the work's own.
#: A connection the server dropped within that window fails its first statement instead,
#: as one lost mid-execution does (``StoreUnavailableError`` at the claim: an internal
#: retry; in the body's transaction: a transient failure, rolled back and retried).
PING_AFTER_IDLE_SECONDS: dict[str, float] = {"worker": 1.0}


@dataclass(repr=False)
class Store:
    """A database engine plus the dialect choices reliable_beat makes for it.

    Safe to share between threads; create one per process (engines do not survive ``fork``).

    Attributes:
        engine: the SQLAlchemy engine.
        url: the database URL (contains the password; use :attr:`safe_url` for display).
            ``repr(store)`` shows only :attr:`safe_url` (error reporters capture locals).
    """

    engine: Engine
    url: str

    def __repr__(self) -> str:
        return f"Store({self.safe_url!r})"

    @classmethod
    def from_url(cls, url: str, *, role: str = "cli", echo: bool = False) -> Store:
        """Create the engine for ``url`` with the connection setup of ``role``.

        Args:
            url: SQLAlchemy URL, e.g. ``postgresql+psycopg://u:p@host/db`` or
                ``sqlite:///reliable_beat.sqlite3``.
            role: ``beat``, ``worker``, ``relay`` or ``cli``; picks the server-side timeouts.

        Raises:
            ConfigurationError: the URL cannot be parsed or names an unsupported dialect.
        """
        try:
            parsed = make_url(url)
            parsed.port  # noqa: B018 - parse the port now, not in the first connect
        except Exception as exc:
            # never chain the parser's error: its text quotes pieces of the URL
            # ("invalid literal for int() with base 10: 'rd@...'") and tracebacks show it
            raise ConfigurationError(
                f"reliable_beat_database_url {redact_url(url)!r} is not a SQLAlchemy URL "
                f"({_parse_problem(exc)}); expected e.g. "
                "'postgresql+psycopg://user:pass@host/db' or 'sqlite:///file.sqlite3' "
                "(percent-encode '@', ':' and '/' in a password: %40, %3A, %2F)"
            ) from None
        backend = parsed.get_backend_name()
        # hide_parameters: a database error's text never carries bound values (task args,
        # payloads, headers) into logs, last_error or tracebacks
        kwargs: dict[str, Any] = {"echo": echo, "future": True, "hide_parameters": True}
        if backend == "sqlite":
            kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        elif backend == "postgresql":
            idle_ms, lock_ms = ROLE_TIMEOUTS_MS.get(role, ROLE_TIMEOUTS_MS["cli"])
            opts = f"-c lock_timeout={lock_ms} -c idle_in_transaction_session_timeout={idle_ms}"
            own = parsed.query.get("options")
            if own:  # e.g. -csearch_path=tenant_a: keep it, ours come first so it may override
                own_text = own if isinstance(own, str) else " ".join(own)
                opts = f"{opts} {own_text}"
                parsed = parsed.difference_update_query(["options"])
            kwargs["connect_args"] = {
                "options": opts,
                "application_name": f"reliable_beat:{role}",
                "connect_timeout": 10,
            }
            kwargs["pool_pre_ping"] = role not in PING_AFTER_IDLE_SECONDS
        elif backend in MYSQL_DIALECTS:
            kwargs["isolation_level"] = "READ COMMITTED"
            kwargs["pool_pre_ping"] = role not in PING_AFTER_IDLE_SECONDS
            kwargs["pool_recycle"] = 3600  # below the server's wait_timeout (8 h default)
            kwargs["connect_args"] = {"connect_timeout": 10}
        else:
            raise ConfigurationError(
                f"reliable_beat_database_url uses {backend!r}; supported: postgresql, "
                "mysql/mariadb (mysql+pymysql://, MariaDB 10.6+ / MySQL 8), sqlite"
            )
        if backend != "sqlite" and role in PING_AFTER_IDLE_SECONDS:
            kwargs["pool_use_lifo"] = True  # the connection used last comes back first
        engine = create_engine(parsed, **kwargs)
        if backend != "sqlite" and role in PING_AFTER_IDLE_SECONDS:
            _ping_after_idle(engine, PING_AFTER_IDLE_SECONDS[role])
        if backend == "postgresql":
            _setup_postgresql(engine)
        if backend == "sqlite":
            _setup_sqlite(engine, parsed.database)
        elif backend in MYSQL_DIALECTS:
            _setup_mysql(engine, role)
        return cls(engine=engine, url=url)

    @property
    def dialect(self) -> str:
        """The dialect name: ``postgresql``, ``sqlite``, ``mysql`` or ``mariadb``."""
        return self.engine.dialect.name

    @property
    def safe_url(self) -> str:
        """The URL with its password hidden."""
        return redact_url(self.url)

    @property
    def has_skip_locked(self) -> bool:
        """True where ``FOR UPDATE SKIP LOCKED`` exists (PostgreSQL, MySQL 8, MariaDB 10.6+)."""
        return self.dialect in ("postgresql", *MYSQL_DIALECTS)

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A connection inside one transaction; commits on success, rolls back on error.

        On SQLite the transaction is ``BEGIN IMMEDIATE`` (it takes the write lock at once).

        Raises:
            StoreUnavailableError: the database cannot be reached (``__cause__`` holds why).
        """
        with self._unavailable_on_disconnect(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """One pooled connection outside any transaction (autobegin, caller commits).

        Raises:
            StoreUnavailableError: the database cannot be reached (``__cause__`` holds why).
        """
        with self._unavailable_on_disconnect(), self.engine.connect() as conn:
            yield conn

    @contextmanager
    def _unavailable_on_disconnect(self) -> Iterator[None]:
        try:
            yield
        except OperationalError as exc:
            if _is_disconnect(exc):
                raise StoreUnavailableError(self.unavailable_message(exc)) from exc
            raise

    def unavailable_message(self, exc: BaseException) -> str:
        """``database URL is unavailable: why`` for an error of :func:`is_unavailable`,
        secrets redacted; a connection the server refused (no such role or database, a
        wrong password, pg_hba.conf) says so first and names the fix."""
        orig = getattr(exc, "orig", None) or exc
        refused = connect_refusal(orig)
        if refused is not None:
            return redact_text(f"database {self.safe_url} is unavailable: {refused} "
                               f"({str(orig).strip()})")
        return f"database {self.safe_url} is unavailable: {redact_text(orig)}"

    def describe_failure(self, exc: BaseException) -> str:
        """One line for a log: what went wrong talking to the store, secrets redacted.

        A lock or statement timeout (SQLSTATE ``55P03`` / ``57014``, SQLite "database is
        locked") is *not* "unavailable": the server answered, another transaction held the
        rows longer than ``lock_timeout``. Bound parameters never appear (the engine is
        created with ``hide_parameters=True``).
        """
        orig = getattr(exc, "orig", None) or exc
        text = redact_text(str(orig).strip().splitlines()[0] if str(orig).strip() else repr(orig))
        if isinstance(exc, StoreUnavailableError):
            return redact_text(exc)
        if isinstance(exc, DBAPIError) and _is_disconnect(exc):
            refused = connect_refusal(orig)
            if refused is not None:
                return redact_text(f"database {self.safe_url} unavailable: {refused} ({text})")
        if isinstance(exc, DBAPIError) and not _is_disconnect(exc):
            if _is_lock_timeout(exc):
                return (f"lock wait timed out on database {self.safe_url} (another "
                        f"transaction holds the rows; {text})")
            return f"database error on {self.safe_url}: {text}"
        return f"database {self.safe_url} unavailable: {text}"

    def now(self, conn: Connection) -> datetime:
        """The store's clock as a UTC-aware ``datetime`` (design.md invariant 4).

        PostgreSQL: ``clock_timestamp()`` of the server. MySQL/MariaDB: ``UTC_TIMESTAMP(6)``
        of the server (microseconds; constant within one statement). SQLite: this host's
        clock (a SQLite store is single-host, so the host clock is the one clock).
        """
        if self.dialect == "postgresql":
            value = conn.execute(select(func.clock_timestamp())).scalar_one()
            return value.astimezone(timezone.utc)  # type: ignore[no-any-return]
        if self.dialect in MYSQL_DIALECTS:
            value = conn.execute(select(func.utc_timestamp(6))).scalar_one()
            return value.replace(tzinfo=timezone.utc)  # type: ignore[no-any-return]
        return datetime.now(timezone.utc)

    def for_update_skip_locked(self, stmt: Select[Any]) -> Select[Any]:
        """Add ``FOR UPDATE SKIP LOCKED`` where the dialect has it; SQLite serialises instead."""
        if self.has_skip_locked:
            return stmt.with_for_update(skip_locked=True)
        return stmt

    def insert_ignore(self, table: Table) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING``: a duplicate is a no-op, not an error.

        MySQL/MariaDB: ``INSERT IGNORE`` (with ``RETURNING`` on MariaDB, only the rows
        inserted come back). IGNORE would also turn other errors into warnings; the engine
        checks the warnings of every ``INSERT IGNORE`` and raises
        :class:`~sqlalchemy.exc.IntegrityError` for any but a duplicate key (1062).
        """
        if self.dialect == "postgresql":
            return postgresql.insert(table).on_conflict_do_nothing()
        if self.dialect == "sqlite":
            return sqlite.insert(table).on_conflict_do_nothing()
        return table.insert().prefix_with("IGNORE")

    def dispose(self) -> None:
        """Close all pooled connections (call after ``fork`` in the child, or at shutdown)."""
        self.engine.dispose()


def update_returning(
    conn: Connection, stmt: Update, table: Table, returning: Sequence[Any],
    *, lock_by_primary_key: bool = False,
) -> list[Any]:
    """Run ``stmt`` (an ``UPDATE`` of ``table``) and return ``returning`` of the rows it changed.

    Where the dialect has ``UPDATE ... RETURNING`` (PostgreSQL, SQLite) this is that. On
    MySQL/MariaDB, which have none, it is three statements in the caller's transaction:
    ``SELECT pk ... FOR UPDATE`` with the statement's ``WHERE`` (locks the rows it will
    change), the ``UPDATE`` restricted to those primary keys, and a ``SELECT`` of
    ``returning`` by primary key (the values after the update, as RETURNING gives).
    The rows stay locked until commit, so nobody changes them in between.

    Args:
        conn: a connection inside a transaction (the caller commits).
        stmt: the ``UPDATE``. Its ``WHERE`` is applied twice on MySQL (lock, then update);
            MariaDB allows it to read ``table`` in a subquery, MySQL 8 does not (error
            1093): give MySQL 8 a ``WHERE`` on the row's own columns.
        table: the table updated; its primary key is one column.
        returning: columns (or expressions) of ``table`` to return.
        lock_by_primary_key: MySQL/MariaDB: the ``WHERE`` names the rows by primary key
            (``pk IN (...)``): lock them through the primary key (``FORCE INDEX (PRIMARY)``)
            whatever the optimizer thinks of the other conditions. InnoDB locks every row a
            locking read scans: ``id IN (...) AND state = 'pending'`` once went through the
            ``(state, sent_at)`` index, locked every pending row of the outbox, and two relays
            settling deadlocked (one settle rolled back: its delivered rows were delivered
            again after the claim lease).

    Returns:
        One row (``Row``) per changed row, in primary-key order on MySQL (unspecified
        elsewhere).
    """
    if conn.dialect.update_returning:
        return list(conn.execute(stmt.returning(*returning)).all())
    (pk,) = table.primary_key.columns
    where = stmt.whereclause
    lock = select(pk).order_by(pk).with_for_update()
    if lock_by_primary_key:
        lock = lock.with_hint(table, "FORCE INDEX (PRIMARY)")
    if where is not None:
        lock = lock.where(where)
    ids = list(conn.execute(lock).scalars())
    if not ids:
        return []
    conn.execute(stmt.where(pk.in_(ids)))
    return list(conn.execute(select(*returning).where(pk.in_(ids)).order_by(pk)).all())


def _parse_problem(exc: BaseException) -> str:
    """What is wrong with an unparseable URL, without quoting any of it."""
    text = str(exc).lower()
    if "int()" in text or "port" in text:
        return "the port is not a number; an unescaped '@' or ':' in the password?"
    return f"{type(exc).__name__}"


#: SQLSTATEs (PostgreSQL) of a statement or lock timeout: the server is up, a lock is held.
_TIMEOUT_SQLSTATES = frozenset({"55P03", "57014", "25P03"})


#: MySQL/MariaDB error codes of the same: lock wait timeout (1205), MariaDB
#: max_statement_time (1969), MySQL max_execution_time (3024).
_MYSQL_TIMEOUT_CODES = frozenset({1205, 1969, 3024})


def is_lock_wait(exc: BaseException) -> bool:
    """True when ``exc`` is the database giving up waiting for a lock (or a statement
    timeout / SQLite's busy timeout): another transaction holds the rows, nothing is down."""
    return isinstance(exc, DBAPIError) and _is_lock_timeout(exc)


def _is_lock_timeout(exc: DBAPIError) -> bool:
    sqlstate = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if sqlstate in _TIMEOUT_SQLSTATES:
        return True
    args = getattr(exc.orig, "args", ())
    if args and args[0] in _MYSQL_TIMEOUT_CODES:
        return True
    text = str(exc.orig).lower()
    return "lock timeout" in text or "statement timeout" in text or "database is locked" in text


#: Server refusals of a new connection (what the server said -> the fix), PostgreSQL
#: (``FATAL:`` of libpq's "connection to server at ... failed") and MySQL/MariaDB (1044,
#: 1045, 1049).
_REFUSALS: tuple[tuple[str, str, str], ...] = (
    ("role", "does not exist",
     "the role (user) does not exist: create it or fix the user in the database URL"),
    ("database", "does not exist",
     "the database does not exist: create it (e.g. `createdb NAME`) or fix its name in the "
     "database URL"),
    ("password authentication failed", "",
     "the password was refused: fix the password in the database URL"),
    ("no pg_hba.conf entry", "",
     "the server does not accept this host/user/database: allow it in pg_hba.conf"),
    ("is not permitted to log in", "",
     "the role may not log in: ALTER ROLE ... LOGIN, or use another user"),
    ("too many connections", "",
     "the server has no free connection slot (max_connections): retry or raise it"),
    ("access denied for user", "",
     "the user or password was refused: fix them in the database URL"),
    ("unknown database", "",
     "the database does not exist: create it or fix its name in the database URL"),
)
#: MySQL/MariaDB client error codes of a failed or lost connection: access denied to a
#: database (1044), access denied (1045), unknown database (1049), can't connect (2003),
#: unknown host (2005), server gone away (2006), lost connection (2013).
_MYSQL_CONNECT_CODES = frozenset({1044, 1045, 1049, 2003, 2005, 2006, 2013})


def _connect_failed(orig: BaseException) -> bool:
    """True when ``orig`` (a driver error) was raised establishing a connection."""
    args = getattr(orig, "args", ())
    if args and args[0] in _MYSQL_CONNECT_CODES:
        return True
    text = str(orig).lower()
    # libpq (psycopg2) and psycopg 3: 'connection to server at "h", port p failed: ...',
    # psycopg 3 prefixes 'connection failed: '
    return ("connection to server" in text and "failed" in text) or text.startswith(
        "connection failed")


def connect_refusal(orig: BaseException) -> str | None:
    """What the server said refusing a new connection, with the fix, or None.

    E.g. ``role "nouser" does not exist`` -> ``the role (user) does not exist: create it or
    fix the user in the database URL``. Only for errors raised while connecting: a
    ``relation ... does not exist`` of a statement (a missing schema) is not a refusal.
    """
    if not _connect_failed(orig):
        return None
    text = str(orig).lower()
    for first, second, fix in _REFUSALS:
        if first in text and second in text:
            return fix
    return None


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` (a SQLAlchemy error) means the store cannot be reached or refused
    the connection (down, unreachable, no such role or database, a wrong password): the
    server did not run a statement, so it says nothing about the schema."""
    return isinstance(exc, DBAPIError) and _is_disconnect(exc)


def _is_disconnect(exc: DBAPIError) -> bool:
    if _is_lock_timeout(exc):
        return False  # the server answered: not "database unavailable"
    if exc.connection_invalidated:
        return True
    if exc.orig is not None and _connect_failed(exc.orig):
        return True
    text = str(exc.orig).lower()
    return any(
        s in text
        for s in (
            "connection refused",
            "could not connect",
            "server closed the connection",
            "terminating connection",
            "connection is closed",
            "the database system is",
            "consuming input failed",
            "no connection to the server",
        )
    )


#: MySQL/MariaDB warnings INSERT IGNORE may leave that mean "duplicate, skipped".
_DUPLICATE_KEY = 1062


def _setup_mysql(engine: Engine, role: str) -> None:
    """Per-connection session setup on MySQL/MariaDB and the INSERT IGNORE warning check."""
    idle_ms, lock_ms = ROLE_TIMEOUTS_MS.get(role, ROLE_TIMEOUTS_MS["cli"])
    lock_s = max(1, math.ceil(lock_ms / 1000))  # innodb_lock_wait_timeout: whole seconds
    idle_s = math.ceil(idle_ms / 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        mariadb = "mariadb" in str(dbapi_conn.get_server_info()).lower()
        cur = dbapi_conn.cursor()
        cur.execute("SET SESSION time_zone = '+00:00'")
        # SIMULTANEOUS_ASSIGNMENT (MariaDB 10.3.5+): ``UPDATE ... SET a = x, b = CASE WHEN
        # a ...`` reads the old ``a``, as in standard SQL and PostgreSQL. Without it MySQL
        # assigns left to right and the second expression sees the new value.
        mode = ("STRICT_ALL_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,"
                "NO_ENGINE_SUBSTITUTION" + (",SIMULTANEOUS_ASSIGNMENT" if mariadb else ""))
        cur.execute(f"SET SESSION sql_mode = '{mode}'")
        cur.execute(f"SET SESSION innodb_lock_wait_timeout = {lock_s}")
        if mariadb:
            # MariaDB only: roll back and disconnect a session idle inside a transaction.
            cur.execute(f"SET SESSION idle_transaction_timeout = {idle_s}")
        cur.close()

    @event.listens_for(engine, "after_cursor_execute")
    def _check_ignored(conn: Connection, cursor: Any, statement: str, _params: Any,
                       _context: Any, _executemany: bool) -> None:
        if not statement.startswith("INSERT IGNORE") or not getattr(cursor, "warning_count", 0):
            return
        check = cursor.connection.cursor()
        check.execute("SHOW WARNINGS")
        others = [w for w in check.fetchall() if int(w[1]) != _DUPLICATE_KEY]
        check.close()
        if others:
            raise IntegrityError(
                statement, None,
                Exception(f"INSERT IGNORE downgraded an error other than a duplicate key: "
                          f"{others[:3]}; the row is not stored as given (fix the value)"),
            )


#: OID of PostgreSQL's ``timestamptz``.
_TIMESTAMPTZ_OID = 1184


def _sentinel_for(text: str) -> datetime | None:
    """:data:`INFINITY` / :data:`NEG_INFINITY` for a ``timestamptz`` text (or a driver's
    message about one) that Python cannot represent; None for anything else."""
    low = text.strip().lower()
    if low.startswith("-infinity") or low.endswith(" bc") or "too small" in low:
        return NEG_INFINITY
    if low.startswith("infinity") or "too large" in low:
        return INFINITY
    first = low.split(" ", 1)[0].split("t", 1)[0]  # '12345-01-01 ...': the year has 5+ digits
    if len(first.split("-", 1)[0]) > 4 and first[:1].isdigit():
        return INFINITY
    return None


_PSYCOPG_LOADERS: dict[Any, Any] = {}


def _psycopg_loader(base: Any, fmt: Any) -> Any:
    """A psycopg 3 ``timestamptz`` loader that delegates to ``base`` (the driver's, C or
    Python) and reads what ``base`` refuses as too large / too small as the sentinels."""
    cached = _PSYCOPG_LOADERS.get(base)
    if cached is not None:
        return cached
    import psycopg
    from psycopg.adapt import Loader

    class _InfinityLoader(Loader):
        format = fmt

        def __init__(self, oid: int, context: Any = None) -> None:
            super().__init__(oid, context)
            self._inner = base(oid, context)

        def load(self, data: Any) -> Any:
            try:
                return self._inner.load(data)
            except psycopg.DataError as exc:
                sentinel = _sentinel_for(str(exc))
                if sentinel is None:
                    raise
                return sentinel

    _PSYCOPG_LOADERS[base] = _InfinityLoader
    return _InfinityLoader


def _psycopg2_infinity(value: str | None, cursor: Any) -> datetime | None:
    import psycopg2.extensions  # type: ignore[import-untyped]

    try:
        return psycopg2.extensions.PYDATETIMETZ(value, cursor)  # type: ignore[no-any-return]
    except ValueError:
        sentinel = _sentinel_for(value or "")
        if sentinel is None:
            raise
        return sentinel


def _ping_after_idle(engine: Engine, seconds: float) -> None:
    """Pre-ping a pooled connection on checkout only when it sat in the pool ``seconds`` or
    more (SQLAlchemy's ``pool_pre_ping`` pings on every checkout).

    A ping that fails raises ``DisconnectionError``: the pool discards that connection and
    checks out (or opens) another, as ``pool_pre_ping`` does.
    """
    from sqlalchemy.exc import DisconnectionError

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["rb_checked_in"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("rb_checked_in")
        if since is not None and time.monotonic() - since < seconds:
            return  # used a moment ago; a fresh connection has no stamp and is pinged
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            raise DisconnectionError(f"pre-ping failed: {type(exc).__name__}") from exc


def _setup_postgresql(engine: Engine) -> None:
    """Per-connection: ``timestamptz`` values Python cannot hold read as the sentinels."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        module = type(dbapi_conn).__module__
        if module.startswith("psycopg2"):
            import psycopg2.extensions  # type: ignore[import-untyped]

            caster = psycopg2.extensions.new_type(
                (_TIMESTAMPTZ_OID,), "RB_TIMESTAMPTZ", _psycopg2_infinity)
            psycopg2.extensions.register_type(caster, dbapi_conn)
            return
        adapters = getattr(dbapi_conn, "adapters", None)
        if adapters is None:  # another driver (asyncpg, pg8000): left as it is
            return
        from psycopg import pq

        for fmt in (pq.Format.TEXT, pq.Format.BINARY):
            base = adapters.get_loader(_TIMESTAMPTZ_OID, fmt)
            if base is not None and not getattr(base, "_rb_infinity", False):
                loader = _psycopg_loader(base, fmt)
                loader._rb_infinity = True
                adapters.register_loader(_TIMESTAMPTZ_OID, loader)


def _create_private_file(path: str | None) -> None:
    """Create the SQLite file ``path`` as 0600 (owner only) if it does not exist yet.

    The store holds task arguments, results and outbox payloads: not for other local users.
    An existing file keeps its mode (the operator may have chosen it).
    """
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    import os

    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    except OSError:
        return  # a missing directory etc.: sqlite3 reports it on connect, with the path
    os.close(fd)


def _setup_sqlite(engine: Engine, path: str | None = None) -> None:
    @event.listens_for(engine, "do_connect")
    def _before_connect(*_args: Any) -> None:
        _create_private_file(path)  # before sqlite3 creates it 0644 (its -wal/-shm follow)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
