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
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

from markupsafe import Markup, escape
from sqlalchemy import String, case, column, exists, func, select, true, values
from sqlalchemy.engine import Connection

from reliable_beat import schedules as sch
from reliable_beat.db.tables import attempts, runs
from reliable_beat.errors import ReliableBeatError
from reliable_beat.redaction import redact_text

__all__ = ["OUTCOMES", "Cell", "last_slots", "legend_cells", "outcome_of", "strip",
           "strip_svg"]

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
    stored_text: bool = False  # the title quotes a stored value (the reason): redacted

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
    result = conn.execute(stmt)
    keys = list(result.keys())
    for row in result:
        found = dict(zip(keys, row, strict=True))
        out.setdefault(found["entry_name"], []).append(found)
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
    parts = [at.isoformat(" ", "seconds")[:19] + " UTC" if isinstance(at, datetime) else str(at),
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
    cells = []
    for r in runs_newest_first:
        if isinstance(r["fire_at"], datetime):
            outcome = outcome_of(r, late_after)
            cells.append(Cell(r["fire_at"], outcome, _title(r, outcome), r["idempotency_key"],
                              bool(r.get("reason"))))
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


#: Each shape's SVG, drawn at ``x`` (``{x}``, ``{x1}`` = x + 1, ...) in colour ``{c}``: trusted
#: constants only (the legend's colours, integers).
_SHAPES = {
    "square": '<rect x="{x}" y="1" width="10" height="14" fill="{c}"/>',
    "notch": '<rect x="{x}" y="5" width="10" height="10" fill="{c}"/>'
             '<rect x="{x}" y="1" width="10" height="3" fill="{c}" opacity=".35"/>',
    "diamond": '<path d="M{x5},1 L{x10},8 L{x5},15 L{x},8 Z" fill="{c}"/>',
    "bar": '<rect x="{x}" y="1" width="10" height="14" fill="{c}"/>'
           '<path d="M{x},15 L{x10},1" stroke="#fff" stroke-width="2"/>',
    "cross": '<path d="M{x1},2 L{x9},14 M{x9},2 L{x1},14" stroke="{c}" stroke-width="2.5"/>'
             '<rect x="{x}" y="1" width="10" height="14" fill="transparent"/>',
    "circle": '<circle cx="{x5}" cy="8" r="5" fill="{c}"/>',
    "hollow": '<rect x="{x1}" y="2" width="8" height="12" fill="#fff" stroke="{c}" '
              'stroke-width="1.5"/>',
    "gap": '<rect x="{x1}" y="2" width="8" height="12" fill="#fff" stroke="{c}" '
           'stroke-width="1.5" stroke-dasharray="2,2"/>',
}


def strip_svg(cells: list[Cell], root: str, width: int = 40) -> Markup:
    """One strip as SVG markup, built from trusted constants: each cell's shape and colour
    (:data:`OUTCOMES`), its position; a run's cell links to the run (its key quoted as one
    path segment: nothing in it is markup or a secret pattern any more), and its hover text
    is escaped, and redacted (the CLI's redaction) when it quotes a stored value (the run's
    reason). Rendering the same SVG through the template took most of a page's time: a page
    of 50 strips is 2,000 cells."""
    base = f"{escape(redact_text(root))}/runs/"
    out = [f'<svg class="strip" width="{width * 12}" height="16" '
           f'viewBox="0 0 {width * 12} 16" role="img" aria-label="last slots">']
    for i, c in enumerate(cells):
        _label, colour, shape = OUTCOMES[c.outcome]
        title = escape(redact_text(c.title) if c.stored_text else c.title)
        if c.key is not None:
            out.append(f'<a href="{base}{quote(c.key, safe="")}" data-outcome="{c.outcome}">')
        else:
            out.append(f'<g data-outcome="{c.outcome}">')
        x = i * 12
        out.append(f"<title>{title}</title>")
        out.append(_SHAPES.get(shape, _SHAPES["gap"]).format(
            x=x, x1=x + 1, x5=x + 5, x9=x + 9, x10=x + 10, c=colour))
        out.append("</a>" if c.key is not None else "</g>")
    out.append("</svg>")
    return Markup("".join(out))


def legend_cells() -> list[Cell]:
    """One cell per outcome (the legend)."""
    never = datetime.min.replace(tzinfo=timezone.utc)  # a legend cell has no slot
    return [Cell(never, key, label, None) for key, (label, _c, _s) in OUTCOMES.items()]
