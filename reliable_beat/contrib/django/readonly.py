"""The two lines of the guard on other Django aliases during a block (:mod:`.join`).

1. :func:`is_write`, a statement check: a clear error before the database for the statements
   that plainly write (anywhere in the text: multi-statement strings, ``EXPLAIN ANALYZE``,
   ``CALL``, ``DO``, ``COPY``, ``PREPARE``/``EXECUTE``, ``SELECT ... INTO``, DDL) or that
   would switch the session back to read-write or end its transaction (the setting names
   and ``set_config`` also when quoted: ``SET "transaction_read_only" = off``).
2. :class:`ReadOnly`, the database's read-only mode for one alias while the block is open,
   so what the text does not show (``SELECT fn_that_inserts()``) is refused by the database:

   * PostgreSQL: ``SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY`` (every
     autocommit statement, and every transaction begun later, is read-only), plus ``SET
     TRANSACTION READ ONLY`` when the first statement opens a transaction (an ``atomic()``
     on that alias inside the block); the server reports ``default_transaction_read_only``
     with each reply, so it is set again, before the next statement, if anything turned it
     off (a rolled-back ``atomic()``, a function);
   * MySQL/MariaDB: ``SET SESSION TRANSACTION READ ONLY``;
   * SQLite: ``PRAGMA query_only = ON``;

   restored (read-write) when the block ends, also on error; a connection that cannot be
   restored (durably: outside a transaction) is closed. An alias already inside its own
   ``atomic()`` when the block opens (PostgreSQL, MySQL) keeps the statement check only:
   its transaction cannot be read-only for part of it, and its writes commit or roll back
   with that ``atomic()``. So does a PostgreSQL alias not in autocommit (``AUTOCOMMIT:
   False``, ``set_autocommit(False)``) outside ``atomic()``: its user commits and rolls
   back by hand, so a setting sent in its transaction could outlive the block or be undone.

:func:`refused_by_database` tells the database's read-only error from others.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["ReadOnly", "is_write", "refused_by_database", "statement_text"]

# Comments and string literals hide nothing that runs (dollar-quoted bodies do: DO $$ ... $$
# is scanned as is); a doubled quote inside one splits it in two. A quoted identifier names
# a column or table, or a setting or function: its words are scanned for _QUOTED_WORDS
# (Django's ORM quotes every column, so "update" or "into" there is a name, not a write).
_NOISE = re.compile(r"--[^\n]*|/\*.*?\*/|'[^']*'|(?P<quoted>\"[^\"]*\"|`[^`]*`)", re.S)
# The same where a backslash escapes the next character in quotes (PostgreSQL's E'...'
# strings, standard_conforming_strings off, MySQL's strings): a text with a backslash is
# read both ways, so E'\''; INSERT ... cannot hide the INSERT from either reading.
_NOISE_ESCAPED = re.compile(r"--[^\n]*|/\*.*?\*/|'(?:[^'\\]|\\.)*'"
                            r"|(?P<quoted>\"(?:[^\"\\]|\\.)*\"|`[^`]*`)", re.S)
_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
#: Words that write (other DDL, e.g. COMMENT ON, is left to the database: words users name
#: columns), or that would turn the read-only mode off or end the transaction under it.
_WRITE_WORDS = frozenset({
    "INSERT", "REPLACE", "UPDATE", "DELETE", "MERGE", "TRUNCATE", "UPSERT", "CALL", "DO",
    "COPY", "PREPARE", "EXECUTE", "INTO", "CREATE", "ALTER", "DROP", "GRANT", "REVOKE",
    "REINDEX", "VACUUM", "REFRESH", "NOTIFY", "PG_NOTIFY",
    "TRANSACTION_READ_ONLY", "DEFAULT_TRANSACTION_READ_ONLY", "TX_READ_ONLY", "QUERY_ONLY",
    "SET_CONFIG", "RESET", "DISCARD", "COMMIT", "ABORT", "ROLLBACK", "BEGIN",
})
#: Names that switch the read-only mode off (settings, set_config) or write outside it,
#: found in quoted identifiers too: SET "transaction_read_only" = off.
_QUOTED_WORDS = frozenset({
    "TRANSACTION_READ_ONLY", "DEFAULT_TRANSACTION_READ_ONLY", "TX_READ_ONLY", "QUERY_ONLY",
    "SET_CONFIG", "PG_NOTIFY",
})
# A Unicode-escaped identifier (U&"\0074ransaction_read_only") cannot be read as written.
_UNICODE_QUOTED = re.compile(r"U&\s*$", re.I)
_PAIRS = frozenset({("READ", "WRITE"), ("SESSION", "CHARACTERISTICS"),
                    ("START", "TRANSACTION")})
_ROLLBACK_TO = re.compile(r"\s*(?:WORK\s+|TRANSACTION\s+)?TO\b", re.I)
# Django's SQLite backend opens atomic() with a bare BEGIN through the cursor.
_BARE_BEGIN = re.compile(r"\s*BEGIN(?:\s+(?:DEFERRED|IMMEDIATE|EXCLUSIVE))?"
                         r"(?:\s+TRANSACTION)?\s*;?\s*", re.I)

#: PostgreSQL's SQLSTATE read_only_sql_transaction; MySQL's ER_CANT_EXECUTE_IN_READ_ONLY_
#: TRANSACTION.
_PG_READ_ONLY, _MYSQL_READ_ONLY = "25006", 1792
_IDLE = 0  # psycopg 3 TransactionStatus.IDLE == psycopg2 TRANSACTION_STATUS_IDLE


def statement_text(sql: Any, raw: Any = None) -> str | None:
    """The text of ``sql`` as Django's cursor gets it: a ``str``, ``bytes``, or a composed
    statement (psycopg's ``sql.Composable``, rendered on the DBAPI connection ``raw``);
    None when it cannot be read."""
    if isinstance(sql, bytes):
        return sql.decode("utf-8", "replace")
    if isinstance(sql, str):
        return sql
    as_string = getattr(sql, "as_string", None)
    if as_string is None:
        return None
    try:
        text = as_string(raw)
    except Exception:  # no connection to render it on: not readable
        return None
    return text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)


def is_write(sql: Any, raw: Any = None) -> bool:
    """True when ``sql`` (a statement as Django's cursor gets it; ``raw`` the DBAPI
    connection a composed one renders on) may write rows or leave the read-only mode; a
    statement whose text cannot be read counts as a write."""
    text = statement_text(sql, raw)
    if text is None:
        return True
    return _writes(text, _NOISE) or ("\\" in text and _writes(text, _NOISE_ESCAPED))


def _writes(text: str, noise: re.Pattern[str]) -> bool:
    quoted_write = False

    def blank(found: re.Match[str]) -> str:
        nonlocal quoted_write
        name = found.group("quoted")
        if name is not None and (
                _UNICODE_QUOTED.search(found.string, 0, found.start()) is not None
                or any(word.upper() in _QUOTED_WORDS for word in _WORD.findall(name))):
            quoted_write = True
        return " "

    text = noise.sub(blank, text)
    if quoted_write:
        return True
    if _BARE_BEGIN.fullmatch(text):
        return False
    before = before_that = ""
    for found in _WORD.finditer(text):
        word = found.group(0).upper()
        if (before, word) in _PAIRS:
            return True
        if word in _WRITE_WORDS and not _lets_through(word, before, before_that, text,
                                                       found.end()):
            return True
        before_that, before = before, word
    return False


def _lets_through(word: str, before: str, before_that: str, text: str, end: int) -> bool:
    if word == "UPDATE":  # a read's row lock: FOR UPDATE, FOR NO KEY UPDATE
        return before == "FOR" or (before, before_that) == ("KEY", "NO")
    if word in ("INSERT", "REPLACE"):  # the MySQL/PostgreSQL string functions
        return text[end:end + 80].lstrip().startswith("(")
    if word == "ROLLBACK":  # ROLLBACK TO SAVEPOINT
        return _ROLLBACK_TO.match(text, end) is not None
    return False


def refused_by_database(exc: BaseException) -> bool:
    """True when ``exc`` (as Django raises it, the driver's error its cause) is the
    database refusing a write in a read-only transaction or a ``query_only`` SQLite."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if _PG_READ_ONLY in (getattr(seen, "sqlstate", None), getattr(seen, "pgcode", None)):
            return True
        args = getattr(seen, "args", ())
        if args and args[0] == _MYSQL_READ_ONLY:
            return True
        if "readonly database" in str(seen):  # SQLite: attempt to write a readonly database
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _transaction_status(raw: Any) -> int:
    info = getattr(raw, "info", None)
    if info is not None:  # psycopg 3
        return int(info.transaction_status)
    return int(raw.get_transaction_status())  # psycopg2


def _parameter(raw: Any, name: str) -> str | None:
    info = getattr(raw, "info", None)
    if info is not None:
        return info.parameter_status(name)  # type: ignore[no-any-return]
    return raw.get_parameter_status(name)  # type: ignore[no-any-return]


def _run(raw: Any, *statements: str) -> None:
    cur = raw.cursor()
    try:
        for statement in statements:
            cur.execute(statement)
    finally:
        cur.close()


class ReadOnly:
    """Keeps the statements on Django connection ``wrapper`` (one alias, this thread)
    read-only at the database while a block is open: :meth:`before` each statement,
    :meth:`restore` when the block ends.

    ``round_trips`` counts the statements it sent (the cost of the guard)."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.vendor = str(wrapper.vendor)
        #: inside its own atomic() when the block opened: its transaction cannot be
        #: read-only for part of it (PostgreSQL, MySQL): the statement check only
        self.outer = bool(wrapper.in_atomic_block) and self.vendor != "sqlite"
        self.raw: Any = None  # the DBAPI connection switched to read-only by us
        self.in_read_only_transaction = False
        self.round_trips = 0

    def before(self) -> None:
        """Make the next statement read-only at the database (PostgreSQL, MySQL/MariaDB,
        SQLite; other backends keep the statement check only)."""
        if self.outer:
            return
        raw = self.wrapper.connection
        if raw is None:
            return
        if self.vendor == "postgresql":
            self._postgresql(raw)
        elif raw is not self.raw and self.vendor in ("mysql", "sqlite"):
            if self.vendor == "mysql":
                self._send(raw, "SET SESSION TRANSACTION READ ONLY")
            else:
                self._send(raw, "PRAGMA query_only = ON")
            self.raw = raw

    def _postgresql(self, raw: Any) -> None:
        status = _transaction_status(raw)
        if status != _IDLE:  # inside a transaction begun under our eyes, or not ours
            if not self.in_read_only_transaction and raw is not self.raw:
                self.outer = True  # begun before the block touched it: as an outer atomic
            return
        autocommit = bool(self.wrapper.get_autocommit())
        if not autocommit and not self.wrapper.in_atomic_block:
            # transactions managed by hand (AUTOCOMMIT: False, set_autocommit(False)): a
            # setting sent in one is made or unmade by the user's commit or rollback, which
            # may come after the block: the statement check only, as for an outer atomic()
            self.outer = True
            return
        # the next transaction starts under the session's default
        self.in_read_only_transaction = not autocommit
        if _parameter(raw, "default_transaction_read_only") == "on":
            return  # read-only already: ours, or the session's own (nothing to restore)
        statements = ["SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"]
        if not autocommit:  # the driver sends BEGIN first: that transaction too
            statements.append("SET TRANSACTION READ ONLY")
        self._send(raw, *statements)
        self.raw = raw

    def _send(self, raw: Any, *statements: str) -> None:
        _run(raw, *statements)
        self.round_trips += len(statements)

    def restore(self) -> None:
        """Read-write again on the connection switched by :meth:`before` (closed when that
        fails); nothing when the connection is gone or was never switched."""
        raw, self.raw = self.raw, None
        self.in_read_only_transaction = False
        if raw is None or self.wrapper.connection is not raw:
            return  # never switched, or closed in the block: the setting went with it
        statement = {"postgresql": "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
                     "mysql": "SET SESSION TRANSACTION READ WRITE",
                     "sqlite": "PRAGMA query_only = OFF"}[self.vendor]
        try:
            self._send(raw, statement)
            if self.vendor == "postgresql" and _transaction_status(raw) != _IDLE:
                # sent inside a transaction a later rollback may undo: not restored
                raise RuntimeError("read-write not restored durably")
        except Exception:  # a read-only session must not be reused: drop the connection
            try:
                self.wrapper.close()
            except Exception:
                self.wrapper.connection = None
