"""Reading the entries a beat claims, with each distinct config decoded and checked once.

A herd of entries shares a handful of configs (the same task, arguments, options, schedule,
policies): decoding four JSON columns and checking every value of every claimed row was a
third of a tick's CPU. :class:`ClaimedEntries` selects the JSON columns as text on
PostgreSQL and keys a memo on the stored config values themselves (the texts and scalars as
read, not ``config_hash``, which a row changed by SQL does not update): equal stored values
decode to equal values and pass the same checks, so a row whose config was seen before only
has its own columns checked (name, instants). Any problem, and every row on the other
dialects, goes the full way (:func:`~reliable_beat.rows.read_entry`): the same values, the
same problems, the same quarantine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from operator import itemgetter
from typing import Any

from sqlalchemy import Text, cast
from sqlalchemy.engine import Dialect

from reliable_beat.db.tables import entries
from reliable_beat.db.types import UTCDateTime
from reliable_beat.rows.decode import raw_columns
from reliable_beat.rows.quarantine import read_entry

__all__ = ["CONFIG_COLUMNS", "ClaimedEntries"]

#: The entry columns that make its config: what the checks of a config depend on.
CONFIG_COLUMNS = ("task", "args", "kwargs", "options", "schedule", "timezone",
                  "misfire_policy", "misfire_grace_seconds", "catch_up_limit",
                  "catch_up_window_seconds", "overlap_policy")
_JSON_COLUMNS = ("args", "kwargs", "options", "schedule")
_INSTANTS = tuple(c.name for c in entries.c if isinstance(c.type, UTCDateTime))
_NULLABLE_INSTANTS = tuple(n for n in _INSTANTS if n != "next_fire_at" and entries.c[n].nullable)
#: a claimed row's stored config values, as one tuple (the memo's key)
_config_of = itemgetter(*CONFIG_COLUMNS)
#: Distinct configs remembered (bounded: memory must not grow with the entries).
MAX_CONFIGS = 10_000


class ClaimedEntries:
    """The columns a claim selects and the decoding of the rows it returns, for one beat.

    Decoded config values are shared by the rows of one config and across ticks: read-only
    (every consumer copies what it changes: a trigger's payload is serialised, the
    publishers copy ``args`` / ``kwargs``).
    """

    def __init__(self) -> None:
        #: stored config values -> (decoded JSON values by column, the built schedule)
        self._memo: dict[tuple[Any, ...], tuple[dict[str, Any], Any]] = {}

    @staticmethod
    def columns(dialect: Dialect) -> list[Any]:
        """Every entry column; on PostgreSQL the JSON ones as text (decoded once per config)."""
        if dialect.name != "postgresql":
            return raw_columns(entries, dialect)
        return [cast(c, Text).label(c.name) if c.name in _JSON_COLUMNS else c
                for c in entries.c]

    def read(
        self, row: Mapping[str, Any], dialect: Dialect,
        schedule_of: Callable[[str, Mapping[str, Any]], Any],
    ) -> tuple[dict[str, Any], list[str], set[str], Any]:
        """Decode and check one claimed row.

        Returns:
            ``(values, problems, unreadable columns, schedule)`` as
            :func:`~reliable_beat.rows.read_entry` returns the first three; ``schedule`` is
            the entry's schedule object when the row is usable (None otherwise).
        """
        if dialect.name != "postgresql":
            values, problems, unreadable = read_entry(row, dialect, schedule_of)
            return values, problems, unreadable, (
                None if problems else schedule_of(values["name"], values["schedule"]))
        key = _config_of(row)
        values = dict(row)
        hit = self._memo.get(key)
        if hit is not None and self._own_columns_ok(values):
            values.update(hit[0])
            return values, [], set(), hit[1]
        for c in _JSON_COLUMNS:
            text = values[c]
            if text is not None:
                values[c] = json.loads(text)  # the server stored valid JSON (jsonb)
        values, problems, unreadable = read_entry(values, dialect, schedule_of)
        if problems:
            return values, problems, unreadable, None
        schedule = schedule_of(values["name"], values["schedule"])
        if len(self._memo) >= MAX_CONFIGS:
            self._memo.clear()
        self._memo[key] = ({c: values[c] for c in _JSON_COLUMNS}, schedule)
        return values, [], set(), schedule

    @staticmethod
    def _own_columns_ok(values: Mapping[str, Any]) -> bool:
        """The checks of :func:`~reliable_beat.rows.read_entry` that do not depend on the
        config, as a yes/no (any doubt: False, and the full check says what is wrong)."""
        name = values["name"]
        if name.__class__ is not str or not name:
            return False
        for n in _INSTANTS:
            v = values[n]
            if v is None:
                if n in _NULLABLE_INSTANTS:
                    continue
                return False
            if v.__class__ is not datetime or v.tzinfo is None or not 1 < v.year < 9999:
                return False
        return True
