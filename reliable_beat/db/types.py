"""Column types that behave the same on every dialect."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, DateTime
from sqlalchemy.dialects.mysql import DATETIME as MYSQL_DATETIME
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = ["INFINITY", "NEG_INFINITY", "JSONType", "UTCDateTime", "infinity_text"]

#: What a PostgreSQL ``timestamptz`` of ``'infinity'`` (or a year after 9999, which Python
#: cannot represent) reads as: ``datetime.max`` in UTC (psycopg2 does the same by itself;
#: the store registers a psycopg 3 loader, :mod:`reliable_beat.db.dialects`). Not an
#: instant: :mod:`reliable_beat.rows` flags a row holding it as malformed.
INFINITY = datetime.max.replace(tzinfo=timezone.utc)
#: ``'-infinity'`` (or a date BC): ``datetime.min`` in UTC. Not an instant either.
NEG_INFINITY = datetime.min.replace(tzinfo=timezone.utc)


def infinity_text(value: object) -> str | None:
    """``'infinity'`` / ``'-infinity'`` when ``value`` is :data:`INFINITY` /
    :data:`NEG_INFINITY` (any tzinfo), else None."""
    if not isinstance(value, datetime) or 1 < value.year < 9999:  # neither end: an instant
        return None
    aware = value.replace(tzinfo=timezone.utc)  # compare the fields, whatever the zone
    if aware == INFINITY:
        return "infinity"
    if aware == NEG_INFINITY:
        return "-infinity"
    return None

#: JSON everywhere, JSONB on PostgreSQL. Never pickle.
JSONType = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """A tz-aware UTC instant: ``timestamptz`` on PostgreSQL, UTC text on SQLite,
    ``DATETIME(6)`` holding UTC on MySQL/MariaDB (microseconds kept; a bare ``DATETIME``
    would round them away, and ``TIMESTAMP`` ends in 2038).

    Writes: a tz-aware ``datetime`` (any offset) is converted to UTC; a naive one is
    rejected with :class:`ValueError` (never guessed). Reads: always UTC-aware, whatever
    the server's or the process's time zone (SQLite has no time-zone type, so the value is
    stored as UTC text and the zone is attached on read).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(MYSQL_DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass a tz-aware UTC datetime")
        value = value.astimezone(timezone.utc)
        if dialect.name in ("sqlite", "mysql", "mariadb"):
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is timezone.utc and 1 < value.year < 9999:  # already a UTC instant
            return value
        if value.tzinfo is None or infinity_text(value) is not None:
            return value.replace(tzinfo=timezone.utc)  # a sentinel never shifts (overflow)
        return value.astimezone(timezone.utc)
