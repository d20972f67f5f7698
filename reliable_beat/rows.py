"""Rows are data: read each one defensively, check its shape, isolate the bad ones.

Rows of the store are written by this library, but also by a person with ``psql``, a data
migration, an older or newer version of the library, or a restore. A malformed row must
never stop the pipeline that reads it (design.md: "loops never die on one bad item"). Every
reader that serves many rows (the beat's claim, the relay's claim, the release of buffered
runs) therefore:

1. **reads each row without trusting its types** (:func:`raw_columns` + :func:`decode_row`):
   on SQLite every column may hold any value (dynamic typing) and a JSON column may hold
   text that is not JSON, which SQLAlchemy would otherwise fail to decode *while fetching
   the whole result*; here each value of each row is decoded on its own and a failure
   becomes a problem of that row only;
2. **checks the row's shape** (:func:`check_entry`, :func:`check_outbox`,
   :func:`check_run_call`): types of every column the pipeline uses, JSON shapes (``options``
   an object, ``options.expires`` a positive number, ``options.headers`` an object, ``args`` a
   list, ``kwargs`` an object, a schedule spec that rebuilds, a known time zone, ...);
3. **quarantines** a row with problems and goes on with the others: an entry is disabled
   with ``quarantine_reason`` / ``quarantined_at`` (shown by ``reliable-beat status`` and the
   ``reliable_beat_quarantined_rows`` metric); an outbox row, a buffered run, a run a
   worker's claim finds malformed (:func:`check_run_row`) or a slot's run in an unknown
   state (:func:`settle_unknown_states`) is dead-lettered with reason ``malformed`` (its
   original values are kept in the dead letter's payload). The problems are logged at
   ERROR, naming the row and the fix.

Nothing here imports a task framework.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    JSON,
    Table,
    and_,
    cast,
    func,
    literal_column,
    not_,
    or_,
    select,
    type_coerce,
    update,
)
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.types import NullType, Text

from reliable_beat import schedules as sch
from reliable_beat.db.tables import dead_letters, entries, runs
from reliable_beat.db.types import UTCDateTime, infinity_text
from reliable_beat.policies import catch_up_limit_problem
from reliable_beat.redaction import get_logger
from reliable_beat.triggers import TRIGGER_DESTINATIONS

__all__ = [
    "KNOWN_RUN_STATES",
    "MALFORMED",
    "LabelledReader",
    "check_entry",
    "check_options",
    "check_outbox",
    "check_run_call",
    "check_run_row",
    "column_of",
    "dead_letter_run",
    "decode_labelled",
    "decode_row",
    "decode_value",
    "describe_problems",
    "display_rows",
    "entry_checker",
    "infinite_instant",
    "infinity_text",
    "jsonable_raw",
    "quarantine_counts",
    "quarantine_entry",
    "raw_columns",
    "raw_labelled",
    "raw_repr",
    "read_buffered_runs",
    "read_entry",
    "read_entry_options",
    "settle_unknown_states",
    "stored_config_hashes",
    "unreadable_instant",
]

log = get_logger("reliable_beat.rows")

#: ``reliable_beat_dead_letters.reason`` of a row dead-lettered because it is malformed.
MALFORMED = "malformed"
#: Largest duration (seconds, about 31 years) a row may hold; beyond it ``timedelta`` overflows.
MAX_SECONDS = 1e9
#: Longest quarantine reason / dead-letter error stored.
MAX_REASON_CHARS = 2000
#: Every ``reliable_beat_runs.state`` this library writes. A run in any other state (a
#: typo by SQL, a newer version's state) is malformed: a claim that finds it dead-letters it
#: (reason ``malformed``) instead of running it or treating its slot as fired.
KNOWN_RUN_STATES = frozenset({
    "scheduled", "dispatched", "running", "retrying", "succeeded", "dead", "skipped",
    "buffered",
})
_MISFIRE = frozenset({"catch_up", "fire_once", "skip"})
_OVERLAP = frozenset({"allow", "skip", "buffer_one"})


def raw_columns(table: Table, dialect: Dialect) -> list[Any]:
    """The columns of ``table`` to select so that fetching never decodes a value.

    SQLite (dynamic typing: any column may hold anything, a JSON column may hold invalid
    text): every column coerced to an untyped expression labelled with its name, decoded
    later by :func:`decode_row`, one value at a time. Other dialects: the typed columns
    (the server enforces the column types; only JSON *shapes* can be wrong there).
    """
    if dialect.name != "sqlite":
        return list(table.c)
    return [type_coerce(c, NullType()).label(c.name) for c in table.c]


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _is_instant(value: Any) -> bool:
    return (isinstance(value, datetime) and value.tzinfo is not None
            and infinity_text(value) is None)


def _optional_str(problems: list[str], where: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        problems.append(f"{where}={raw_repr(value)}: expected a string or null")


def check_options(options: Any, where: str = "options") -> list[str]:
    """Problems of an entry's publish ``options`` (a JSON object), as the trigger uses them.

    ``expires``: a number of seconds > 0 or null; ``headers``: an object or null;
    ``queue`` / ``routing_key`` / ``exchange`` / ``serializer``: strings or null;
    ``priority``: an integer 0..255 or null. Unknown keys are left alone (another version
    may write them; the trigger only forwards the keys above).
    """
    if not isinstance(options, Mapping):
        return [f"{where}={raw_repr(options)}: expected a JSON object "
                "(publish options such as queue, expires, headers)"]
    problems: list[str] = []
    expires = options.get("expires")
    if expires is not None and not (_is_number(expires) and 0 < expires <= MAX_SECONDS):
        problems.append(f"{where}.expires={raw_repr(expires)}: expected seconds (a number > 0) "
                        "or null")
    headers = options.get("headers")
    if headers is not None and not isinstance(headers, Mapping):
        problems.append(f"{where}.headers={raw_repr(headers)}: expected a JSON object or null")
    for key in ("queue", "routing_key", "exchange", "serializer"):
        _optional_str(problems, f"{where}.{key}", options.get(key))
    priority = options.get("priority")
    if priority is not None and not (_is_int(priority) and 0 <= priority <= 255):
        problems.append(f"{where}.priority={raw_repr(priority)}: expected an integer 0..255 "
                        "or null")
    return problems


def check_run_call(task: Any, args: Any, kwargs: Any) -> list[str]:
    """Problems of a task call (``task`` name, ``args`` list, ``kwargs`` object)."""
    problems: list[str] = []
    if not isinstance(task, str) or not task:
        problems.append(f"task={raw_repr(task)}: expected the registered task name")
    if not isinstance(args, list):
        problems.append(f"args={raw_repr(args)}: expected a JSON array")
    if not isinstance(kwargs, Mapping):
        problems.append(f"kwargs={raw_repr(kwargs)}: expected a JSON object")
    return problems


def check_run_row(values: Mapping[str, Any]) -> list[str]:
    """Problems of one decoded ``reliable_beat_runs`` row that a worker's claim would trip on.

    Checks what the claim reads and uses: ``state`` (one of :data:`KNOWN_RUN_STATES`), the
    stored call (:func:`check_run_call`: ``task`` a string, ``args`` a JSON array, ``kwargs``
    a JSON object), ``fence_token`` / ``attempts`` integers, ``entry_name`` a string or
    null, ``fire_at`` / ``lease_expires_at`` UTC instants or null.

    Returns:
        One string per problem, each naming the column and what is expected; empty: usable.
    """
    problems: list[str] = []
    state = values.get("state")
    if state not in KNOWN_RUN_STATES:
        problems.append(f"state={raw_repr(state)}: expected one of "
                        f"{', '.join(sorted(KNOWN_RUN_STATES))}")
    problems += check_run_call(values.get("task"), values.get("args"), values.get("kwargs"))
    for col in ("fence_token", "attempts"):
        if not _is_int(values.get(col)):
            problems.append(f"{col}={raw_repr(values.get(col))}: expected an integer")
    _optional_str(problems, "entry_name", values.get("entry_name"))
    for col in ("fire_at", "lease_expires_at"):
        value = values.get(col)
        if value is not None and not _is_instant(value):
            problems.append(f"{col}={raw_repr(value)}: expected a UTC instant or null")
    return problems


def check_entry(
    row: Mapping[str, Any],
    schedule_of: Callable[[str, Mapping[str, Any]], Any] | None = None,
) -> list[str]:
    """Problems of one decoded ``reliable_beat_entries`` row that the beat would trip on.

    Checks every column a tick reads: name, task, args, kwargs, options
    (:func:`check_options`), the schedule spec (rebuilt with
    :func:`reliable_beat.schedules.schedule_from_spec`: kind, expression, interval, anchor,
    time zone), the ``timezone`` column, the policies and their numbers, the instants.

    Args:
        row: the decoded row, by column name.
        schedule_of: ``(name, spec) -> Schedule``, a caching builder (the beat's: a cron
            schedule costs about 0.7 ms to build); default
            :func:`~reliable_beat.schedules.schedule_from_spec`.

    Returns:
        One string per problem, each naming the column and what is expected; empty: usable.
    """
    problems: list[str] = []
    name = row.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"name={raw_repr(name)}: expected a non-empty string")
    problems += check_run_call(row.get("task"), row.get("args"), row.get("kwargs"))
    problems += check_options(row.get("options"))
    spec = row.get("schedule")
    if not isinstance(spec, Mapping):
        problems.append(f"schedule={raw_repr(spec)}: expected a schedule spec object")
    else:
        try:
            if schedule_of is not None and isinstance(name, str):
                schedule_of(name, spec)
            else:
                sch.schedule_from_spec(spec)
        except Exception as exc:
            problems.append(f"schedule={raw_repr(dict(spec))}: {_short(exc)}")
    tz = row.get("timezone")
    try:
        if not isinstance(tz, str):
            raise TypeError("not a string")
        sch.validate_timezone(tz)
    except Exception as exc:
        problems.append(f"timezone={raw_repr(tz)}: expected an IANA zone name ({_short(exc)})")
    if row.get("misfire_policy") not in _MISFIRE:
        problems.append(f"misfire_policy={raw_repr(row.get('misfire_policy'))}: expected one "
                        "of catch_up, fire_once, skip")
    if row.get("overlap_policy") not in _OVERLAP:
        problems.append(f"overlap_policy={raw_repr(row.get('overlap_policy'))}: expected one "
                        "of allow, skip, buffer_one")
    grace: Any = row.get("misfire_grace_seconds")
    if not (_is_number(grace) and 0 <= grace <= MAX_SECONDS):
        problems.append(f"misfire_grace_seconds={raw_repr(grace)}: expected a number of "
                        f"seconds 0..{MAX_SECONDS:.0e}")
    limit: Any = row.get("catch_up_limit")
    if not (_is_int(limit) and limit >= 0):
        problems.append(f"catch_up_limit={raw_repr(limit)}: expected an integer >= 0")
    elif (limit_problem := catch_up_limit_problem(limit)) is not None:
        problems.append(limit_problem)
    window = row.get("catch_up_window_seconds")
    if window is not None and not (_is_number(window) and 0 <= window <= MAX_SECONDS):
        problems.append(f"catch_up_window_seconds={raw_repr(window)}: expected a number of "
                        f"seconds 0..{MAX_SECONDS:.0e} or null")
    if not _is_instant(row.get("next_fire_at")):
        problems.append(f"next_fire_at={raw_repr(row.get('next_fire_at'))}: expected a UTC "
                        "instant")
    for col in ("last_fire_at", "end_at", "start_at"):
        value = row.get(col)
        if value is not None and not _is_instant(value):
            problems.append(f"{col}={raw_repr(value)}: expected a UTC instant or null")
    return problems


def stored_config_hashes(row: Mapping[str, Any]) -> set[str]:
    """The digests :meth:`reliable_beat.entries.EntryDefinition.config_hash` gives for the
    definition a stored row holds (an interval's anchor excluded or not: two candidates);
    empty when the row's values cannot be a definition's."""
    try:
        spec = row["schedule"]
        specs = [spec]
        if isinstance(spec, Mapping) and spec.get("kind") == "interval":
            specs.append({k: v for k, v in spec.items() if k != "anchor"})
        window = row["catch_up_window_seconds"]
        body = {
            "task": row["task"], "args": row["args"], "kwargs": row["kwargs"],
            "options": row["options"], "misfire_policy": row["misfire_policy"],
            "misfire_grace": float(row["misfire_grace_seconds"]),
            "catch_up_limit": row["catch_up_limit"],
            "catch_up_window": float(window) if window else None,
            "overlap_policy": row["overlap_policy"],
            "start_at": row["start_at"].isoformat() if row["start_at"] else None,
            "end_at": row["end_at"].isoformat() if row["end_at"] else None,
        }
        return {hashlib.sha256(json.dumps(dict(body, schedule=s), sort_keys=True,
                                          default=str).encode()).hexdigest() for s in specs}
    except Exception:  # a value of the wrong type: not a definition's (checked in full)
        return set()


def entry_checker() -> Callable[[Mapping[str, Any]], list[str]]:
    """A checker of decoded ``reliable_beat_entries`` rows: :func:`reliable_beat.rows.
    check_entry` (the check a beat's claim makes), fast enough for ``status`` at 20,000
    entries: a schedule is built once per distinct spec (10,000 entries of ``0 * * * *``
    build one cron schedule, not 10,000), and not at all when the row's ``config_hash``
    is the digest of its stored values (the library wrote them from a definition whose
    schedule it built; a row changed by SQL no longer matches its digest and is built).
    Every other column is checked on every row.

    Returns:
        ``row -> [problem]`` (each problem names the column and what is expected; empty:
        the beat can fire the entry).
    """
    built: dict[str, Any] = {}  # spec as sorted JSON -> its schedule, or why it fails
    seen: dict[int, tuple[Any, Any]] = {}  # id(spec) -> (spec, built[...]): a shared object

    def check(row: Mapping[str, Any]) -> list[str]:
        def trusted() -> bool:
            stored = row.get("config_hash")
            return isinstance(stored, str) and stored in stored_config_hashes(row)

        def schedule_of(_name: str, spec: Mapping[str, Any]) -> Any:
            # a spec built before (the same object, or an equal one) needs no digest: its
            # outcome is known; only a failing one asks whether the row is a definition's
            hit = seen.get(id(spec))
            found = hit[1] if hit is not None and hit[0] is spec else _built(spec)
            if found is None:  # never built: a definition's row is not built at all
                if trusted():
                    return None  # the schedule of a definition, as written by the library
                found = _build(spec)
            if isinstance(found, Exception):
                if trusted():
                    return None
                raise found
            return found

        return check_entry(row, schedule_of)

    def _key(spec: Mapping[str, Any]) -> str | None:
        try:
            return json.dumps(spec, sort_keys=True, default=str)
        except (TypeError, ValueError):  # an odd value in a malformed spec: no sharing
            return None

    def _built(spec: Mapping[str, Any]) -> Any:
        key = _key(spec)
        found = built.get(key) if key is not None else None
        if found is not None:
            _remember(spec, found)
        return found

    def _build(spec: Mapping[str, Any]) -> Any:
        try:
            found: Any = sch.schedule_from_spec(spec)
        except Exception as exc:
            found = exc
        key = _key(spec)
        if key is not None:
            if len(built) > 10_000:  # bounded: memory must not grow with entries
                built.clear()
            built[key] = found
            _remember(spec, found)
        return found

    def _remember(spec: Mapping[str, Any], found: Any) -> None:
        if len(seen) > 10_000:
            seen.clear()
        seen[id(spec)] = (spec, found)  # holds spec: its id is not reused meanwhile

    return check


def _check_instant_text(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return parsed.tzinfo is not None


def check_outbox(row: Mapping[str, Any]) -> list[str]:
    """Problems of one decoded ``reliable_beat_outbox`` row that the relay would trip on.

    Every destination: ``message_id`` and ``destination`` non-empty strings, ``headers`` an
    object, ``ordering_key`` a string or null, ``run_id`` an integer or null, ``attempts`` an
    integer, ``available_at`` / ``created_at`` instants. A trigger destination (``celery``,
    ``dramatiq``: :data:`reliable_beat.beat.TRIGGER_DESTINATIONS`; a ``dramatiq`` row whose
    payload names an ``actor`` is an application message, not a trigger) also: ``payload`` an
    object with ``task`` (string), ``args`` (array), ``kwargs`` (object), ``options`` /
    ``headers`` (objects or null), ``task_id`` / ``message_id`` (strings or null),
    ``reliable_beat`` (the neutral shape's identity: an object with a ``key`` string, or
    null) and ``expires_at`` (ISO 8601 with offset, or null). Other destinations' payload
    shapes are their handler's business (a handler error fails that one message).
    """
    problems: list[str] = []
    for col in ("message_id", "destination"):
        value = row.get(col)
        if not isinstance(value, str) or not value:
            problems.append(f"{col}={raw_repr(value)}: expected a non-empty string")
    if not isinstance(row.get("headers"), Mapping):
        problems.append(f"headers={raw_repr(row.get('headers'))}: expected a JSON object")
    _optional_str(problems, "ordering_key", row.get("ordering_key"))
    run_id = row.get("run_id")
    if run_id is not None and not _is_int(run_id):
        problems.append(f"run_id={raw_repr(run_id)}: expected an integer or null")
    if not _is_int(row.get("attempts")):
        problems.append(f"attempts={raw_repr(row.get('attempts'))}: expected an integer")
    for col in ("available_at", "created_at"):
        if not _is_instant(row.get(col)):
            problems.append(f"{col}={raw_repr(row.get(col))}: expected a UTC instant")

    payload = row.get("payload")
    destination = row.get("destination")
    # The ``dramatiq`` destination also carries application messages, ``{"actor": ...}``
    # (reliable_beat.dramatiq.DramatiqHandler): their shape is the handler's business.
    app_message = (destination != "celery" and isinstance(payload, Mapping)
                   and "actor" in payload)
    if destination in TRIGGER_DESTINATIONS and not app_message:  # a trigger payload's shape
        if not isinstance(payload, Mapping):
            problems.append(f"payload={raw_repr(payload)}: a {row.get('destination')} trigger "
                            "needs a JSON object")
        else:
            problems += [
                f"payload.{p}"
                for p in check_run_call(
                    payload.get("task"),
                    [] if payload.get("args") is None else payload.get("args"),
                    {} if payload.get("kwargs") is None else payload.get("kwargs"),
                )
            ]
            for key in ("options", "headers"):
                value = payload.get(key)
                if value is not None and not isinstance(value, Mapping):
                    problems.append(f"payload.{key}={raw_repr(value)}: expected a JSON object "
                                    "or null")
            _optional_str(problems, "payload.task_id", payload.get("task_id"))
            _optional_str(problems, "payload.message_id", payload.get("message_id"))
            identity = payload.get("reliable_beat")
            if identity is not None and not (isinstance(identity, Mapping)
                                             and isinstance(identity.get("key"), str)
                                             and identity.get("key")):
                problems.append(f"payload.reliable_beat={raw_repr(identity)}: expected a JSON "
                                "object with the run's key (a non-empty string), or null")
            if not _check_instant_text(payload.get("expires_at")):
                problems.append(f"payload.expires_at={raw_repr(payload.get('expires_at'))}: "
                                "expected ISO 8601 with a UTC offset, or null")
    return problems


def describe_problems(problems: Sequence[str]) -> str:
    """The problems as one line, cut to :data:`MAX_REASON_CHARS`."""
    text = "; ".join(problems)
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def jsonable_raw(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` made JSON-safe for a dead letter's payload: JSON values kept, anything
    else (an undecodable text, a ``datetime``) as its ``str``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            json.dumps(value, allow_nan=False)
            out[key] = value
        except (TypeError, ValueError):
            out[key] = value.isoformat() if isinstance(value, datetime) else str(value)
    return out


# --------------------------------------------------------------------------- quarantine


def _fix_hint(name: Any, origin: Any) -> str:
    if origin == "config":
        return ("it comes from beat_schedule: the next beat start rewrites it from the "
                "configuration (correct the configuration if the problem is there)")
    return (f"rewrite it with `reliable-beat entries update {name}` ..., or correct the "
            f"columns named and run `reliable-beat entries resume {name}`")


def quarantine_entry(
    conn: Connection,
    values: Mapping[str, Any],
    problems: Sequence[str],
    now: datetime,
    *,
    unreadable: Iterable[str] = (),
) -> None:
    """Disable one malformed entry with the reason; joins the caller's transaction.

    Sets ``enabled = false``, ``quarantine_reason`` (the problems, at most
    :data:`MAX_REASON_CHARS`), ``quarantined_at = now`` and ``updated_at = now``. Instants
    that could not be read (``unreadable``, SQLite only) are set to NULL so that every
    reader of the row works again; their original text is in the reason. Logs at ERROR,
    naming the entry, the problems and the fix.

    Args:
        conn: a connection inside a transaction (the beat's claim transaction).
        values: the decoded row (``id`` must be readable; it is the SQLite rowid).
        problems: what is wrong, one string per problem.
        now: the store's clock, UTC.
        unreadable: names of columns whose value could not be decoded.
    """
    reason = describe_problems(problems)
    name = values.get("name")
    cleared: dict[str, datetime | None] = {
        c: None for c in unreadable if c in _NULLABLE_INSTANTS
    }
    if "created_at" in unreadable:
        cleared["created_at"] = now
    conn.execute(
        update(entries)
        .where(entries.c.id == values["id"])
        .values(enabled=False, quarantine_reason=reason, quarantined_at=now, updated_at=now,
                **cleared)
    )
    log.error(
        "entry %s (id %s) quarantined, it will not fire until fixed: malformed row: %s. "
        "Fix: %s", raw_repr(name), values.get("id"), reason,
        _fix_hint(name, values.get("origin")),
    )


_NULLABLE_INSTANTS = frozenset({"next_fire_at", "last_fire_at", "start_at", "end_at", "paused_at"})


def read_entry(
    row: Mapping[str, Any], dialect: Dialect,
    schedule_of: Callable[[str, Mapping[str, Any]], Any] | None = None,
) -> tuple[dict[str, Any], list[str], set[str]]:
    """Decode and check one ``reliable_beat_entries`` row read with :func:`raw_columns`
    (``schedule_of``: see :func:`check_entry`).

    Returns:
        ``(values, problems, unreadable columns)``; no problems: the row is usable.
    """
    values, problems = decode_row(entries, row, dialect)
    unreadable = {column_of(p) for p in problems}
    problems += [p for p in check_entry(values, schedule_of) if column_of(p) not in unreadable]
    return values, problems, unreadable


def column_of(problem: str) -> str:
    """The column a problem string names (its leading identifier)."""
    match = re.match(r"[A-Za-z_]+", problem)
    return match.group() if match else ""


def read_buffered_runs(conn: Connection, now: datetime, *, limit: int) -> list[Any]:
    """The oldest ``buffered`` runs (at most ``limit``), each read and checked on its own.

    A run that cannot be read or has the wrong shape (task, args, kwargs, key, entry, slot)
    is dead-lettered with reason ``malformed`` (:func:`dead_letter_run`) instead of failing
    the beat's tick. Joins the caller's transaction.

    Returns:
        The usable runs as objects with attribute access (``id``, ``idempotency_key``,
        ``entry_name``, ``fire_at``, ``task``, ``args``, ``kwargs``, ``trigger``).
    """
    rows = conn.execute(
        select(*raw_columns(runs, conn.dialect))
        .where(runs.c.state == "buffered")
        .order_by(runs.c.id)
        .limit(limit)
    ).all()
    usable: list[Any] = []
    for raw in rows:
        values, problems = decode_row(runs, dict(raw._mapping), conn.dialect)
        unreadable = {column_of(p) for p in problems}
        checks = check_run_call(values.get("task"), values.get("args"), values.get("kwargs"))
        for col in ("idempotency_key", "entry_name", "trigger"):
            if not isinstance(values.get(col), str) or not values.get(col):
                checks.append(f"{col}={raw_repr(values.get(col))}: expected a non-empty string")
        if not _is_instant(values.get("fire_at")):
            checks.append(f"fire_at={raw_repr(values.get('fire_at'))}: expected a UTC instant")
        problems += [p for p in checks if column_of(p) not in unreadable]
        if problems:
            dead_letter_run(conn, values, problems, now)
            continue
        usable.append(SimpleNamespace(**values))
    return usable


#: The fix logged for a run dead-lettered as malformed (see :func:`dead_letter_run`).
RUN_FIX = ("repair the row from the dead letter's payload and requeue it "
           "(`reliable-beat dead-letters show/requeue`)")
#: The fix logged for a run found in a state outside :data:`KNOWN_RUN_STATES`.
STATE_FIX = ("its slot may have run or not: check the task's effects, then requeue the dead "
             "letter to run it (`reliable-beat dead-letters requeue ID`) or leave it")


def dead_letter_run(
    conn: Connection, values: Mapping[str, Any], problems: Sequence[str], now: datetime,
    *, guard: Any = None, fix: str = RUN_FIX,
) -> bool:
    """Dead-letter one malformed run (reason ``malformed``); joins the caller's transaction.

    The run goes ``-> dead`` with ``reason = "malformed: <problems>"`` and its fence token
    moves (an earlier holder that wakes up is fenced out); the dead letter
    keeps every original column value (undecodable ones as text). Logged at ERROR, naming
    the run, its key, the problems and ``fix``. Safe from several beats at once: only the
    one that moves the run writes the dead letter.

    Args:
        guard: a SQL condition the run must still meet to be moved (default: ``state =
            'buffered'``, the beat's release; a worker's claim passes its own, e.g. its
            fence token, or ``true()`` under the row lock).
        fix: what a person should do, for the log line.

    Returns:
        True when this call moved the run and wrote the dead letter.
    """
    error = describe_problems(problems)
    key = values.get("idempotency_key")
    entry = values.get("entry_name")
    task = values.get("task")
    fire_at = values.get("fire_at")
    # an unreadable slot instant (SQLite) is cleared so that every reader of the row works
    # again; the original is in the dead letter's payload
    cleared = {"fire_at": None} if fire_at is not None and not _is_instant(fire_at) else {}
    changed = conn.execute(
        update(runs).where(runs.c.id == values["id"],
                           runs.c.state == "buffered" if guard is None else guard)
        .values(state="dead", reason=f"malformed: {error}"[:MAX_REASON_CHARS],
                fence_token=runs.c.fence_token + 1, leased_by=None, lease_expires_at=None,
                updated_at=now, finished_at=now, **cleared)
    ).rowcount
    if not changed:  # another beat read it too and settled it first (the read takes no lock)
        return False
    conn.execute(
        dead_letters.insert().values(
            kind="run", run_id=values["id"],
            key=(key if isinstance(key, str) and key else f"run:{values['id']}")[:400],
            entry_name=entry[:200] if isinstance(entry, str) else None,
            task=task[:255] if isinstance(task, str) else None,
            payload=jsonable_raw(values), reason=MALFORMED, error=error, attempts=0,
            created_at=now,
        )
    )
    log.error("run %s (%s) dead-lettered: malformed row: %s. Fix: %s",
              values["id"], raw_repr(key), error, fix)
    return True


def settle_unknown_states(conn: Connection, keys: Iterable[str], now: datetime) -> int:
    """Runs among ``keys`` whose ``state`` is outside :data:`KNOWN_RUN_STATES`: each is
    dead-lettered (reason ``malformed``, :func:`dead_letter_run`), logged at ERROR with its
    key and the fix. Joins the caller's transaction.

    The beat calls it for the slots whose run row already existed (its insert was a no-op,
    normally "already fired"). Such a slot is never fired again by the beat (the key exists:
    it may have run), and never silently counted as fired either: the dead letter shows in
    ``reliable-beat status`` (``quarantined_rows.runs``) and ``status --check``; a person
    checks the effects and requeues it, or leaves it.

    Returns:
        How many runs were dead-lettered.
    """
    wanted = list(keys)
    if not wanted:
        return 0
    found = conn.execute(
        select(*raw_columns(runs, conn.dialect))
        .where(runs.c.idempotency_key.in_(wanted), runs.c.state.not_in(sorted(KNOWN_RUN_STATES)))
    ).all()
    settled = 0
    for raw in found:
        values, _ = decode_row(runs, dict(raw._mapping), conn.dialect)
        problems = [p for p in check_run_row(values) if column_of(p) == "state"]
        if problems and dead_letter_run(conn, values, problems, now,
                                        guard=runs.c.state == values.get("state"),
                                        fix=STATE_FIX):
            settled += 1
    return settled


def read_entry_options(
    conn: Connection, names: Iterable[str], now: datetime
) -> dict[str, dict[str, Any] | None]:
    """``options`` of the named entries, each read and checked on its own.

    Returns:
        name -> options, or None for an entry whose options are malformed (that entry is
        quarantined, :func:`quarantine_entry`). A name with no entry is absent.
    """
    out: dict[str, dict[str, Any] | None] = {}
    rows = conn.execute(
        select(*raw_columns(entries, conn.dialect)).where(entries.c.name.in_(list(names)))
    ).all()
    for raw in rows:
        values, problems = decode_row(entries, dict(raw._mapping), conn.dialect)
        problems = [p for p in problems if column_of(p) == "options"]
        if not problems:
            problems = check_options(values.get("options"))
        name = values.get("name")
        if not isinstance(name, str):
            continue
        if problems:
            if not values.get("quarantine_reason"):  # once, not on every tick
                quarantine_entry(conn, values, problems, now,
                                 unreadable={column_of(p) for p in problems})
            out[name] = None
        else:
            out[name] = dict(values["options"])
    return out


def unknown_state_runs(conn: Connection, limit: int = 10) -> tuple[int, list[str]]:
    """Runs whose ``state`` is none of :data:`KNOWN_RUN_STATES` (set by SQL) and not
    dead-lettered yet: ``(count, idempotency keys of the first ``limit``)``. No claim,
    sweep or completion of the library leaves such a row: ``reliable-beat status`` reports
    them (MALFORMED RUN ROWS) and ``status --check`` fails."""
    # NOT IN, written as the ranges between the known states (state is NOT NULL): each
    # range is a probe of the state index, not a scan of every run (0.2 s at a million)
    known = sorted(KNOWN_RUN_STATES)
    bad = or_(runs.c.state < known[0], runs.c.state > known[-1],
              *(and_(runs.c.state > lo, runs.c.state < hi)
                for lo, hi in pairwise(known)))
    count = int(conn.execute(select(func.count()).select_from(runs).where(bad)).scalar_one())
    keys = list(conn.execute(select(runs.c.idempotency_key).where(bad)
                             .order_by(runs.c.id).limit(limit)).scalars()) if count else []
    return count, keys


def quarantine_counts(conn: Connection) -> dict[str, int]:
    """Malformed rows isolated so far (:mod:`reliable_beat.rows`), per table.

    Returns:
        ``{"entries": quarantined entries, "outbox": outbox rows dead-lettered as malformed,
        "runs": runs dead-lettered as malformed}`` (dead letters not requeued).
    """
    counts = {"entries": 0, "outbox": 0, "runs": 0}
    counts["entries"] = int(conn.execute(
        select(func.count()).select_from(entries)
        .where(entries.c.quarantine_reason.is_not(None))
    ).scalar_one())
    for kind, n in conn.execute(
        select(dead_letters.c.kind, func.count())
        .where(dead_letters.c.reason == MALFORMED, dead_letters.c.requeued_at.is_(None))
        .group_by(dead_letters.c.kind)
    ):
        counts["outbox" if kind == "outbox" else "runs"] += int(n)
    return counts
