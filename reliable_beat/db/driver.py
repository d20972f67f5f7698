"""Fixed statements executed on the driver connection (psycopg), for the hot paths.

A :class:`DriverStatement` is a SQLAlchemy statement compiled once per dialect; each call
binds its parameters through the columns' own types (the same bind and result processors
SQLAlchemy applies) and runs it on the DBAPI cursor of the caller's SQLAlchemy
:class:`~sqlalchemy.engine.Connection`, skipping the per-call execution context and result
objects (about a third of a short statement's client CPU). It stays on that connection and
inside its transaction, so it sees and writes exactly what a ``conn.execute()`` would, and:

* ``before_cursor_execute`` / ``after_cursor_execute`` listeners of the engine still see it
  (statement counts, fault hooks);
* a driver error is raised as SQLAlchemy's wrapped exception (``OperationalError``,
  ``DataError``, ...; parameters hidden), and a lost connection invalidates the pooled one,
  exactly as through ``conn.execute()``;
* psycopg prepares it server-side after a few executions, as it does any statement.

Only for psycopg (3) connections; the callers keep the ``conn.execute()`` path otherwise.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.expression import Select

__all__ = ["DriverStatement", "uses_psycopg"]


def uses_psycopg(conn: Connection) -> bool:
    """True when ``conn`` runs on psycopg 3 (the driver :class:`DriverStatement` runs on)."""
    return conn.dialect.driver == "psycopg"


class DriverStatement:
    """A statement built once by ``build`` and executed on the driver connection.

    ``build`` returns a SELECT (it may carry data-modifying CTEs); a row comes back as a
    named tuple of its selected columns (``row.id``, as a SQLAlchemy ``Row`` reads).
    """

    def __init__(self, build: Callable[[], Select[Any]]) -> None:
        self._build = build
        self._stmt: Select[Any] | None = None
        self._row: Any = None
        self._compiled: dict[int, tuple[Dialect, str, dict[str, Any],
                                        dict[str, Callable[[Any], Any]],
                                        list[tuple[int, Callable[[Any], Any]]]]] = {}

    @property
    def statement(self) -> Select[Any]:
        if self._stmt is None:
            self._stmt = self._build()
        return self._stmt

    def _for(self, dialect: Dialect) -> tuple[str, dict[str, Any],
                                              dict[str, Callable[[Any], Any]],
                                              list[tuple[int, Callable[[Any], Any]]]]:
        got = self._compiled.get(id(dialect))
        if got is None or got[0] is not dialect:
            stmt = self.statement
            compiled = stmt.compile(dialect=dialect)
            binds: dict[str, Callable[[Any], Any]] = {}
            for name, bind in compiled.binds.items():
                proc = bind.type.dialect_impl(dialect).bind_processor(dialect)
                if proc is not None:
                    binds[compiled.bind_names.get(bind, name)] = proc
            results: list[tuple[int, Callable[[Any], Any]]] = []
            for i, col in enumerate(stmt.selected_columns):
                proc = col.type.dialect_impl(dialect).result_processor(dialect, None)
                if proc is not None:
                    results.append((i, proc))
            if self._row is None:
                self._row = namedtuple(  # type: ignore[misc]
                    "DriverRow", list(stmt.selected_columns.keys()), rename=True)
            got = (dialect, compiled.string, dict(compiled.params), binds, results)
            self._compiled[id(dialect)] = got
        return got[1], got[2], got[3], got[4]

    def first(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """Execute on ``conn``'s driver connection (in its transaction, if any); the first
        row as a named tuple (values through the columns' result processors), or None."""
        rows = self._execute(conn, params, one=True)
        return rows[0] if rows else None

    def all(self, conn: Connection, params: Mapping[str, Any]) -> list[Any]:
        """As :meth:`first`, every row (a list of named tuples)."""
        return self._execute(conn, params, one=False)

    def _execute(self, conn: Connection, params: Mapping[str, Any], *, one: bool) -> list[Any]:
        dialect = conn.dialect
        sql, defaults, binds, results = self._for(dialect)
        bound = {**defaults, **params}
        for name, proc in binds.items():  # as SQLAlchemy does: every value, None too
            bound[name] = proc(bound[name])
        dbapi_conn = conn.connection.dbapi_connection
        dispatch = conn.dispatch
        cursor = None
        try:
            cursor = dbapi_conn.cursor()  # type: ignore[union-attr]
            if dispatch.before_cursor_execute:
                dispatch.before_cursor_execute(conn, cursor, sql, bound, None, False)
            cursor.execute(sql, bound)
            if dispatch.after_cursor_execute:
                dispatch.after_cursor_execute(conn, cursor, sql, bound, None, False)
            if one:
                row = cursor.fetchone()
                fetched: list[Any] = [] if row is None else [row]
            else:
                fetched = list(cursor.fetchall())
            cursor.close()
        except dialect.loaded_dbapi.Error as exc:
            disconnect = dialect.is_disconnect(exc, dbapi_conn, cursor)
            if disconnect and not conn.invalidated:
                conn.invalidate(exc)
            raise DBAPIError.instance(
                sql, bound, exc, dialect.loaded_dbapi.Error, hide_parameters=True,
                connection_invalidated=disconnect, dialect=dialect,
            ) from exc
        except BaseException as exc:
            # as SQLAlchemy does: an exit (KeyboardInterrupt, SystemExit, a greenlet's) in
            # the middle of a statement leaves the connection in an unknown state
            if not isinstance(exc, Exception) and not conn.invalidated:
                conn.invalidate()
            raise
        make = self._row._make
        if not results:
            return [make(row) for row in fetched]
        out = []
        for row in fetched:
            values = list(row)
            for i, proc in results:
                values[i] = proc(values[i])
            out.append(make(values))
        return out
