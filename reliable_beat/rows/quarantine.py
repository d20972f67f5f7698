"""Isolating the bad rows: a malformed entry is quarantined (disabled with the reason), a
malformed run or outbox row is dead-lettered (reason ``malformed``, its original values kept
in the dead letter's payload). Each is logged at ERROR, naming the row and the fix; the
pipeline goes on with the other rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.engine import Connection, Dialect

from reliable_beat.db.tables import dead_letters, entries, runs
from reliable_beat.redaction import get_logger
from reliable_beat.rows.checks import (
    KNOWN_RUN_STATES,
    _is_instant,
    check_entry,
    check_options,
    check_run_call,
    check_run_row,
    column_of,
)
from reliable_beat.rows.decode import decode_row, raw_columns, raw_repr

__all__ = [
    "MALFORMED",
    "MAX_REASON_CHARS",
    "RUN_FIX",
    "STATE_FIX",
    "dead_letter_run",
    "describe_problems",
    "jsonable_raw",
    "quarantine_counts",
    "quarantine_entry",
    "read_buffered_runs",
    "read_entry",
    "read_entry_options",
    "settle_unknown_states",
    "unknown_state_runs",
]

log = get_logger("reliable_beat.rows")

#: ``reliable_beat_dead_letters.reason`` of a row dead-lettered because it is malformed.
MALFORMED = "malformed"
#: Longest quarantine reason / dead-letter error stored.
MAX_REASON_CHARS = 2000


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
