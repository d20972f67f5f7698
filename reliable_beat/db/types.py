"""Column types that behave the same on every dialect."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, DateTime
from sqlalchemy.dialects.mysql import DATETIME as MYSQL_DATETIME
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = ["JSONType", "UTCDateTime"]

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
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)
