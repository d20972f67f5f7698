"""The slot timeline: each entry's last slots, one cell per slot, coloured and shaped by outcome.

:func:`last_slots` reads the last ``n`` slots of a page of entries in **one** query (a
``LATERAL`` join on PostgreSQL, each entry's slots read backwards from the end of the
UNIQUE(entry_name, fire_at) index; a window function elsewhere), with, per run, whether an
attempt was fenced out and how many attempts it took. :func:`strip` turns one entry's rows
into cells, and fills in the slots of its schedule that have **no run row at all** (a gap:
nothing recorded that slot) so a gap is as visible as a double.

Outcomes (:data:`OUTCOMES`, the legend): ``on_time``, ``late`` (dispatched later than
``late_after_seconds`` after its slot), ``retried`` (succeeded after more than one attempt),
``fenced_out`` (an attempt was fenced out: another runner took the run over), ``dead``,
``running`` (scheduled, dispatched, running, buffered), ``retrying``, ``skipped`` (the
overlap policy decided not to fire it), ``missed`` (the misfire policy recorded it late past
its grace: no beat claimed it in time), ``gap`` (no run row for a slot of the schedule).
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import String, case, column, exists, func, select, true, values
from sqlalchemy.engine import Connection

from reliable_beat import schedules as sch
from reliable_beat.db.tables import attempts, runs
from reliable_beat.errors import ReliableBeatError

__all__ = ["OUTCOMES", "Cell", "last_slots", "outcome_of", "strip"]

#: Outcome -> (label, colour, shape) for the legend and the SVG cells. Shapes: ``square``
#: done, ``circle`` in flight, ``cross`` dead, ``hollow`` not fired, ``bar`` fenced out,
#: ``diamond`` retried, ``notch`` late.
OUTCOMES: dict[str, tuple[str, str, str]] = {
    "on_time": ("on time", "#2e9e4f", "square"),
    "late": ("late", "#e0a100", "notch"),
    "retried": ("retried", "#1f78b4", "diamond"),
    "fenced_out": ("fenced out", "#8e44ad", "bar"),
    "dead": ("dead", "#c0392b", "cross"),
    "running": ("running", "#3498db", "circle"),
    "retrying": ("retrying", "#e67e22", "circle"),
    "skipped": ("skipped by policy", "#95a5a6", "hollow"),
    "missed": ("missed", "#c0392b", "hollow"),
    "gap": ("no run recorded", "#c0392b", "gap"),
}

_IN_FLIGHT = ("scheduled", "dispatched", "running", "buffered")


@dataclass(frozen=True)
class Cell:
    """One slot of a strip."""

    fire_at: datetime
    outcome: str
    title: str  # the hover text: the slot, the outcome, lateness, attempts, reason
    key: str | None  # the run's idempotency key (None: a gap)

    @property
    def label(self) -> str:
        return OUTCOMES[self.outcome][0]

    @property
    def colour(self) -> str:
        return OUTCOMES[self.outcome][1]

    @property
    def shape(self) -> str:
        return OUTCOMES[self.outcome][2]


def _columns() -> list[Any]:
    fenced = exists().where(attempts.c.run_id == runs.c.id,
                            attempts.c.outcome == "fenced_out")
    return [runs.c.entry_name, runs.c.fire_at, runs.c.idempotency_key, runs.c.state,
            runs.c.attempts, runs.c.reason, runs.c.dispatched_at, runs.c.started_at,
            runs.c.finished_at, case((fenced, 1), else_=0).label("fenced")]


def last_slots(conn: Connection, names: list[str], n: int) -> dict[str, list[dict[str, Any]]]:
    """The last ``n`` slot runs (``fire_at`` not NULL) of each entry in ``names``, newest
    first, in one query.

    Returns:
        ``{entry name: [{"fire_at", "idempotency_key", "state", "attempts", "reason",
        "dispatched_at", "started_at", "finished_at", "fenced" (1: an attempt was fenced
        out)}]}``; an entry without slot runs maps to ``[]``.
    """
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    if not names or n <= 0:
        return out
    if conn.dialect.name == "postgresql":
        wanted = values(column("name", String(200)), name="wanted").data(
            [(x,) for x in names])
        inner = (select(*_columns())
                 .where(runs.c.entry_name == wanted.c.name, runs.c.fire_at.is_not(None))
                 .order_by(runs.c.fire_at.desc()).limit(n).lateral("slot"))
        stmt = select(inner).select_from(wanted).join(inner, true())
    else:
        ranked = (select(*_columns(), func.row_number().over(
            partition_by=runs.c.entry_name, order_by=runs.c.fire_at.desc()).label("rn"))
            .where(runs.c.entry_name.in_(names), runs.c.fire_at.is_not(None))
            .subquery("ranked"))
        stmt = (select(*[c for c in ranked.c if c.name != "rn"])
                .where(ranked.c.rn <= n))
    for row in conn.execute(stmt).mappings():
        out.setdefault(row["entry_name"], []).append(dict(row))
    for rows in out.values():
        rows.sort(key=lambda r: r["fire_at"], reverse=True)
    return out


def outcome_of(run: dict[str, Any], late_after: timedelta) -> str:
    """The outcome of one slot run (see the module docstring)."""
    state = run["state"]
    if run.get("fenced"):
        return "fenced_out"
    if state == "dead":
        return "dead"
    if state == "skipped":
        return "missed" if str(run.get("reason") or "").startswith("misfire") else "skipped"
    if state == "retrying":
        return "retrying"
    if state in _IN_FLIGHT:
        return "running"
    if (run.get("attempts") or 0) > 1:
        return "retried"
    if _lateness(run) > late_after:
        return "late"
    return "on_time"


def _lateness(run: dict[str, Any]) -> timedelta:
    sent = run.get("dispatched_at") or run.get("started_at")
    if sent is None or run.get("fire_at") is None:
        return timedelta(0)
    try:
        return sent - run["fire_at"]  # type: ignore[no-any-return]
    except TypeError:  # a malformed value (reliable_beat.rows): not late, shown as is
        return timedelta(0)


def _seconds(delta: timedelta) -> str:
    s = delta.total_seconds()
    if abs(s) < 60:
        return f"{s:.1f} s"
    if abs(s) < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _title(run: dict[str, Any], outcome: str) -> str:
    at = run["fire_at"]
    parts = [f"{at:%Y-%m-%d %H:%M:%S} UTC" if isinstance(at, datetime) else str(at),
             OUTCOMES[outcome][0]]
    if run.get("dispatched_at") is not None:
        parts.append(f"dispatched {_seconds(_lateness(run))} after its slot")
    if (run.get("attempts") or 0) > 0:
        parts.append(f"{run['attempts']} attempt(s)")
    if run.get("reason"):
        parts.append(str(run["reason"]))
    return " · ".join(parts)


@functools.lru_cache(maxsize=4096)
def _expected_slots(spec: str, oldest: datetime, newest: datetime,
                    most: int) -> tuple[datetime, ...]:
    """The schedule's slots in ``[oldest, newest]`` (at most ``most``). Cached: croniter
    takes about 0.2 ms a slot, and entries that share a schedule share their window."""
    return tuple(itertools.islice(
        sch.schedule_from_spec(json.loads(spec)).slots_between(oldest, newest), most))


def strip(runs_newest_first: list[dict[str, Any]], *, schedule_spec: Any, n: int,
          late_after: timedelta, now: datetime) -> list[Cell]:
    """One entry's cells, oldest first: its slot runs, and a ``gap`` cell for each slot of
    its schedule between the oldest shown and the newest that has no run row (at most ``n``
    cells in all; the newest kept)."""
    cells = [Cell(r["fire_at"], outcome_of(r, late_after), _title(r, outcome_of(r, late_after)),
                  r["idempotency_key"]) for r in runs_newest_first
             if isinstance(r["fire_at"], datetime)]
    if len(cells) >= 2:
        try:
            expected = _expected_slots(json.dumps(schedule_spec, sort_keys=True),
                                       cells[-1].fire_at, min(cells[0].fire_at, now), 4 * n)
        except (ReliableBeatError, TypeError, ValueError, KeyError, AttributeError):
            expected = ()  # a malformed schedule: the runs alone (the entry page says why)
        have = {c.fire_at for c in cells}
        cells.extend(Cell(at, "gap", f"{at:%Y-%m-%d %H:%M:%S} UTC · no run recorded for "
                          "this slot", None) for at in expected if at not in have)
    cells.sort(key=lambda c: c.fire_at)
    return cells[-n:]
