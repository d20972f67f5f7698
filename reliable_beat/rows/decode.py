"""Reading rows without trusting their types: each value decoded on its own.

On SQLite every column may hold any value (dynamic typing) and a JSON column may hold text
that is not JSON, which SQLAlchemy would otherwise fail to decode *while fetching the whole
result*: :func:`raw_columns` selects the columns undecoded and :func:`decode_row` decodes each
value of each row on its own, so that a failure becomes a problem of that row only. On
PostgreSQL an instant column may hold ``'infinity'`` (:func:`infinite_instant`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import cache
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    JSON,
    Table,
    and_,
    cast,
    func,
    inspect,
    literal_column,
    not_,
    or_,
    type_coerce,
)
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.types import NullType, Text

from reliable_beat.db.types import UTCDateTime, infinity_text

__all__ = [
    "OPTIONAL_COLUMNS",
    "LabelledReader",
    "decode_labelled",
    "decode_row",
    "decode_value",
    "display_rows",
    "infinite_instant",
    "infinity_text",
    "missing_optional_columns",
    "raw_columns",
    "raw_labelled",
    "raw_repr",
    "unreadable_instant",
]


#: Columns a later migration added that the code writes and reads only when a feature is
#: on (``traceparent``: tracing); a store not yet upgraded lacks them, and reads skip them.
OPTIONAL_COLUMNS = frozenset({"traceparent"})
_present: dict[tuple[int, str], frozenset[str]] = {}


def missing_optional_columns(conn: Connection, table: Table) -> frozenset[str]:
    """The :data:`OPTIONAL_COLUMNS` of ``table`` that the store's table lacks (new code on a
    store not yet upgraded: a rolling deploy). Read once per engine and table."""
    wanted = OPTIONAL_COLUMNS & set(table.c.keys())
    if not wanted:
        return frozenset()
    key = (id(conn.engine), table.name)
    names = _present.get(key)
    if names is None:
        names = frozenset(c["name"] for c in inspect(conn).get_columns(
            table.name, schema=table.schema))
        if wanted <= names:  # upgraded: remember; not yet: ask again next time
            _present[key] = names
    return frozenset(wanted - names)


def raw_columns(table: Table, dialect: Dialect,
                skip: frozenset[str] = frozenset()) -> list[Any]:
    """The columns of ``table`` to select so that fetching never decodes a value.

    SQLite (dynamic typing: any column may hold anything, a JSON column may hold invalid
    text): every column coerced to an untyped expression labelled with its name, decoded
    later by :func:`decode_row`, one value at a time. Other dialects: the typed columns
    (the server enforces the column types; only JSON *shapes* can be wrong there).
    """
    columns = [c for c in table.c if c.name not in skip]
    if dialect.name != "sqlite":
        return columns
    return [type_coerce(c, NullType()).label(c.name) for c in columns]


def unreadable_instant(column: Any) -> Any:
    """SQLite: a SQL predicate true when ``column`` (not NULL) holds no readable instant.

    A claim ORs it into its "due" test so that a row whose instant is garbage is claimed,
    found malformed and quarantined, instead of never being due and silently stuck (SQLite
    compares text, so ``'zzz' <= now`` is false forever). Only for the SQLite dialect.
    """
    return and_(
        column.is_not(None),
        or_(func.datetime(column).is_(None),
            not_(type_coerce(column, Text()).op("GLOB", is_comparison=True)(_INSTANT_GLOB))),
    )


_INSTANT_GLOB = "[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*"


def infinite_instant(column: Any) -> Any:
    """PostgreSQL: a SQL predicate true when ``column`` holds ``'infinity'`` or a year after
    9999, ``'-infinity'`` or a date BC (read as :data:`~reliable_beat.db.types.INFINITY` /
    :data:`~reliable_beat.db.types.NEG_INFINITY`, not instants).

    A claim ORs it into its "due" test so that such a row is claimed, found malformed and
    quarantined or dead-lettered, instead of never being due and silently stuck. Index
    range scans of both ends.
    """
    return or_(column >= literal_column("'10000-01-01 00:00:00+00'::timestamptz"),
               column < literal_column("'0001-01-01 00:00:00+00'::timestamptz"))


def _infinity_problem(name: str, text: str) -> str:
    return (f"{name}={text!r}: expected a UTC instant (PostgreSQL {text!r} is none; set a "
            "real instant, or NULL where the column allows it)")


def _infinite_columns(table: Table, values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(column, 'infinity' | '-infinity')`` for each instant column of ``table`` in
    ``values`` holding a sentinel (PostgreSQL ``'infinity'``, ``'-infinity'``, a year
    Python cannot hold: :mod:`reliable_beat.db.dialects`)."""
    out: list[tuple[str, str]] = []
    for name in _instant_columns(table):
        if name in values:
            text = infinity_text(values[name])
            if text is not None:
                out.append((name, text))
    return out


@cache
def _instant_columns(table: Table) -> tuple[str, ...]:
    """The names of ``table``'s :class:`~reliable_beat.db.types.UTCDateTime` columns (a
    table's columns are fixed once defined: read once per table, not once per row)."""
    return tuple(c.name for c in table.c if isinstance(c.type, UTCDateTime))


def raw_labelled(columns: Mapping[str, Any], dialect: Dialect) -> list[Any]:
    """``columns`` (label -> column) to select without decoding on SQLite, for
    :func:`decode_labelled`; typed, labelled columns elsewhere."""
    if dialect.name != "sqlite":
        return [c.label(label) for label, c in columns.items()]
    return [type_coerce(c, NullType()).label(label) for label, c in columns.items()]


def decode_labelled(
    row: Mapping[Any, Any], columns: Mapping[str, Any], dialect: Dialect
) -> SimpleNamespace:
    """Decode a row read with :func:`raw_labelled`, value by value.

    Returns:
        The values by label as attributes (an undecodable value reads as None), plus
        ``unreadable``: the set of labels that could not be decoded or hold a PostgreSQL
        ``'infinity'`` / ``'-infinity'`` (kept as the sentinel, not an instant).
    """
    if dialect.name != "sqlite":  # typed by the driver; only an instant can be 'infinity'
        values = {label: row[label] for label in columns}
        return SimpleNamespace(unreadable={
            label for label, raw in values.items()
            if isinstance(raw, datetime) and not 1 < raw.year < 9999  # (fast: no call)
            and infinity_text(raw) is not None}, **values)
    values = {}
    unreadable: set[str] = set()
    for label, c in columns.items():
        raw = row[label]
        try:
            values[label] = decode_value(c, raw, dialect)
        except Exception:
            values[label] = None
            unreadable.add(label)
    return SimpleNamespace(unreadable=unreadable, **values)


class LabelledReader:
    """:func:`raw_labelled` and :func:`decode_labelled` for many rows whose JSON values
    repeat (entries' ``args``, ``options``, ``schedule``): each JSON column is read as text
    and each distinct text decoded once (the same object for equal texts: read-only), the
    other columns as :func:`decode_labelled` decodes them. The same values and the same
    ``unreadable`` labels; at 20,000 entries a third of the time the driver takes to decode
    every JSON value."""

    def __init__(self, columns: Mapping[str, Any], dialect: Dialect) -> None:
        self.columns = columns
        self.dialect = dialect
        self.json = [label for label, c in columns.items() if isinstance(c.type, JSON)]
        self.plain = {label: c for label, c in columns.items() if label not in self.json}
        self._memo: dict[tuple[str, Any], tuple[Any, bool]] = {}

    def select(self) -> list[Any]:
        """The labelled columns to select (JSON ones as text)."""
        if self.dialect.name == "sqlite":
            return raw_labelled(self.columns, self.dialect)
        return [cast(c, Text).label(label) if label in self.json else c.label(label)
                for label, c in self.columns.items()]

    def decode(self, row: Mapping[Any, Any]) -> SimpleNamespace:
        """One row: :func:`decode_labelled`'s namespace."""
        r = decode_labelled(row, self.plain, self.dialect)
        for label in self.json:
            text = row[label]
            got = self._memo.get((label, text))
            if got is None:
                try:
                    got = (self._load(label, text), False)
                except Exception:  # not JSON (SQLite): a problem of this column only
                    got = (None, True)
                if len(self._memo) > 10_000:  # bounded: memory must not grow with rows
                    self._memo.clear()
                self._memo[(label, text)] = got
            setattr(r, label, got[0])
            if got[1]:
                r.unreadable.add(label)
        return r

    def _load(self, label: str, text: Any) -> Any:
        if text is None:
            return None
        if self.dialect.name == "sqlite":
            return decode_value(self.columns[label], text, self.dialect)
        return json.loads(text)


def decode_row(
    table: Table, row: Mapping[str, Any], dialect: Dialect
) -> tuple[dict[str, Any], list[str]]:
    """Decode one row read with :func:`raw_columns`, each value on its own.

    Args:
        table: the table the row comes from.
        row: the row's mapping (``row._mapping``), keyed by column name.
        dialect: the connection's dialect.

    Returns:
        ``(values, problems)``: the decoded values by column name (an undecodable value is
        kept raw), and one problem string per column that could not be decoded or holds a
        PostgreSQL ``'infinity'`` / ``'-infinity'`` (read as a sentinel, see
        :data:`~reliable_beat.db.types.INFINITY`; the problem names the column and the fix).
    """
    values = dict(row)
    problems: list[str] = [_infinity_problem(name, text)
                           for name, text in _infinite_columns(table, values)]
    if dialect.name != "sqlite":
        return values, problems
    for c in table.c:
        if c.name not in values:
            continue
        raw = values[c.name]
        if raw is None:
            continue
        try:
            values[c.name] = decode_value(c, raw, dialect)
        except Exception as exc:
            problems.append(f"{c.name}: unreadable value {raw_repr(raw)} ({_short(exc)})")
    return values, problems


def display_rows(conn: Connection, stmt: Any, table: Table) -> list[dict[str, Any]]:
    """Run ``stmt`` (a ``select(table)``, with its filters, order and limit) for showing the
    rows to a person (``runs``, ``runs show``, ``dead-letters list|show``, ``schedule list``)
    without letting one stored value fail the command.

    On SQLite every value is fetched undecoded and decoded on its own (:func:`decode_row`);
    a value that cannot be (text that is not JSON, not an instant) is shown as the string
    ``"unreadable: <the stored text>"`` instead of failing the whole listing. Other dialects
    return the typed values (a PostgreSQL ``'infinity'`` is the
    :data:`~reliable_beat.db.types.INFINITY` sentinel, which the CLI prints as
    ``malformed: infinity``).

    Returns:
        One dict per row, keyed by column name.
    """
    if conn.dialect.name != "sqlite":
        return [dict(r) for r in conn.execute(stmt).mappings()]
    raw_stmt = stmt.with_only_columns(*raw_columns(table, conn.dialect))
    out: list[dict[str, Any]] = []
    for r in conn.execute(raw_stmt).mappings():
        values: dict[str, Any] = {}
        for c in table.c:
            raw = r[c.name]
            try:
                values[c.name] = decode_value(c, raw, conn.dialect)
            except Exception:
                values[c.name] = f"unreadable: {raw_repr(raw)}"
        out.append(values)
    return out


def decode_value(column: Any, raw: Any, dialect: Dialect) -> Any:
    """Decode one raw value of ``column`` as SQLAlchemy would when fetching it.

    Raises:
        Exception: whatever the column type's result processing raises on a bad value.
    """
    if raw is None:
        return None
    proc = column.type.dialect_impl(dialect).result_processor(dialect, None)
    return raw if proc is None else proc(raw)


def raw_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (for log lines and reasons); a PostgreSQL
    ``'infinity'`` sentinel as ``'infinity'``."""
    text = repr(infinity_text(value) or value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {raw_repr(str(exc), 160)[1:-1]}"
