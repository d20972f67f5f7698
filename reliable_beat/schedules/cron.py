"""Cron schedules: a cron expression read on the wall clock of an IANA zone.

The rules (the DST rule, which :func:`_wall_to_instants` alone applies; seconds-last 6-field
strings; POSIX OR of two restricted day fields) are stated in :mod:`reliable_beat.schedules`
and ``docs/dst.md``.
"""

from __future__ import annotations

import heapq
import re
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, ClassVar
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, CroniterError, croniter

from reliable_beat.errors import InvalidScheduleError
from reliable_beat.schedules.base import UTC, Schedule, validate_timezone
from reliable_beat.slots import truncate

__all__ = ["MAX_CRON_LENGTH", "NONEXISTENT_RULES", "REPEATED_RULES", "CronSchedule"]

#: Longest cron expression accepted (characters). Real expressions are far shorter (a list
#: of all 60 minutes is 170); an 85 KB one was accepted once and cost 0.5 s per slot step.
MAX_CRON_LENGTH = 256

#: Allowed values of ``CronSchedule(nonexistent=...)`` (wall time inside a DST gap).
NONEXISTENT_RULES = ("shift", "gap_end", "skip")
#: Allowed values of ``CronSchedule(repeated=...)`` (wall time occurring twice).
REPEATED_RULES = ("first", "last", "both")

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

#: Wall-clock margin around a DST transition: larger than any real offset change
#: in tzdata except Samoa/Tokelau's 2011 date-line jump (24 h), which is unsupported.
_MARGIN = timedelta(hours=3)
_ONE_SECOND = timedelta(seconds=1)
_ZERO = timedelta(0)
#: slots_between releases an instant once the wall clock is this far past it.
_RELEASE_LAG = timedelta(hours=14) + _MARGIN
#: croniter gives up after this many years without a match (``15 22 29 2 *`` needs 8).
_MAX_YEARS = 30
#: Fixed reference for construction checks and ``nominal_period`` (a Monday, UTC).
_REFERENCE = datetime(2001, 1, 1, tzinfo=UTC)


def _local_wall(at: datetime, zone: ZoneInfo) -> datetime:
    """Naive wall-clock time of the instant ``at`` in ``zone``."""
    return at.astimezone(zone).replace(tzinfo=None)


def _offset(at: datetime, zone: ZoneInfo) -> timedelta:
    off = at.astimezone(zone).utcoffset()
    assert off is not None
    return off


def _offset_of_wall(wall: datetime, zone: ZoneInfo) -> timedelta:
    """UTC offset of a naive wall time (``fold=0``), so ``wall - offset`` is UTC-naive."""
    off = zone.utcoffset(wall)
    assert off is not None
    return off


def _transition_instant(lo: datetime, hi: datetime, zone: ZoneInfo) -> datetime:
    """First instant in ``(lo, hi]`` (UTC, whole seconds) whose offset differs from ``lo``'s."""
    before = _offset(lo, zone)
    lo_s, hi_s = 0, int((hi - lo).total_seconds())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if _offset(lo + timedelta(seconds=mid), zone) == before:
            lo_s = mid
        else:
            hi_s = mid
    return lo + timedelta(seconds=hi_s)


def _wall_to_instants(
    wall: datetime, zone: ZoneInfo, nonexistent: str, repeated: str
) -> list[datetime]:
    """Map one naive wall time of ``zone`` to the UTC instants it fires at (the DST rule).

    This is the only place the DST rule lives.

    * ordinary wall time: one instant.
    * wall time in a spring-forward gap (PEP 495: ``fold=0`` and ``fold=1`` give
      different offsets and the post-transition offset is larger):
      ``"shift"`` → read with the pre-gap offset (``fold=0``, RFC 5545 §3.3.5);
      ``"gap_end"`` → the transition instant (first instant after the gap);
      ``"skip"`` → none.
    * repeated wall time (fall-back, post-transition offset is smaller):
      ``"first"`` → the earlier instant, ``"last"`` → the later one, ``"both"`` → both.

    Args:
        wall: naive local wall-clock time (whole seconds).
        zone: the entry's zone.
        nonexistent: one of :data:`NONEXISTENT_RULES`.
        repeated: one of :data:`REPEATED_RULES`.

    Returns:
        0, 1 or 2 UTC instants, ascending.
    """
    off0 = zone.utcoffset(wall.replace(fold=0))
    off1 = zone.utcoffset(wall.replace(fold=1))
    assert off0 is not None and off1 is not None
    naive0 = (wall - off0).replace(tzinfo=UTC)
    if off0 == off1:
        return [naive0]
    naive1 = (wall - off1).replace(tzinfo=UTC)
    if off1 > off0:  # gap: clocks jumped forward over this wall time
        if nonexistent == "shift":
            return [naive0]
        if nonexistent == "gap_end":
            return [_transition_instant(naive1, naive0, zone)]
        return []
    # repeated: naive0 (pre-transition offset, larger) is the earlier instant
    if repeated == "first":
        return [naive0]
    if repeated == "last":
        return [naive1]
    return [naive0, naive1]



def _split_fields(expr: str) -> list[str]:
    text = expr.strip()
    return _ALIASES.get(text.lower(), text).split()


_DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_SMALL_LIST = re.compile(r"[0-7](-[0-7])?(,[0-7](-[0-7])?)*(/[0-9]+)?")


def _day_of_week_like(field: str) -> bool:
    """A field that reads as a day of week, not seconds: names, ``L``/``#``/``?``, or a
    range or list within 0-7 (``1-5``, ``1,3,5``); a single number is not enough."""
    f = field.lower()
    if any(name in f for name in _DAY_NAMES) or any(c in f for c in "l#?"):
        return True
    return bool(_SMALL_LIST.fullmatch(f)) and ("-" in f or "," in f)


def _valid_seconds_first(fields: list[str]) -> bool:
    """Whether the 6 fields also parse as a seconds-first cron."""
    try:
        croniter(" ".join(fields).replace("?", "*"), _REFERENCE.replace(tzinfo=None),
                 second_at_beginning=True)
    except (CroniterError, ValueError, KeyError, TypeError):
        return False
    return True


def _reads_seconds_first(fields: list[str]) -> bool:
    """The seconds-first forms we can tell apart (docs/dst.md lists the ones we cannot).

    Both readings must be valid, and the seconds-last reading implausible: a last field
    that reads as a day of week (``1-5``, ``MON-FRI``, ``L5``, ``5#2``), or the usual
    Spring/Quartz shape ``0 <minute> <hour> * <month> <0-7>`` (seconds ``0`` first,
    day-of-month ``*``, a single day of week last), which read seconds-last would be
    "second 0-7 of the matching minutes of <hour>th day of the month".
    """
    if not _valid_seconds_first(fields):
        return False
    if _day_of_week_like(fields[5]):
        return True
    return fields[0] == "0" and fields[3] == "*" and fields[5] in {str(d) for d in range(8)}


def _seconds_first_why(fields: list[str]) -> str:
    if _day_of_week_like(fields[5]):
        return f"its last field {fields[5]!r} reads as days of the week, not seconds"
    return (
        f"'0' first, '*' fourth and {fields[5]!r} last is the seconds-first shape "
        f"(read seconds-last it would be 'second {fields[5]} of day-of-month {fields[2]}')"
    )


def _seconds_first_fix(fields: list[str], *, ambiguous: bool = False) -> str:
    """The rewrite for a seconds-first string: seconds moved last, or dropped when 0."""
    rest = [f.replace("?", "*") for f in fields[1:]]
    if len(fields) != 6:
        return f"E.g. {' '.join(f.replace('?', '*') for f in fields)!r}"
    moved = " ".join(rest) if fields[0] == "0" else " ".join([*rest, fields[0]])
    text = f"If you meant seconds first, write {moved!r}" + (
        " (5 fields: second 0 is the default)." if fields[0] == "0" else " (seconds last)."
    )
    if ambiguous:
        text += (
            " If you did mean seconds last, write the month field as '1-12' instead of '*' "
            "(docs/dst.md lists the forms that cannot be told apart)."
        )
    return text


class CronSchedule(Schedule):
    """A cron expression evaluated on the wall clock of an IANA zone.

    Syntax is croniter's: 5 fields (minute hour day-of-month month day-of-week), or 6
    with the **seconds field last**; ``@hourly``, ``@daily``, ``@midnight``,
    ``@weekly``, ``@monthly``, ``@yearly``/``@annually``; names (``mon``, ``jan``),
    ``L``, ``W`` and ``#``.

    Args:
        expr: the cron string.
        timezone: IANA zone whose wall clock the expression reads.
        day_or: POSIX cron (True): when both day-of-month and day-of-week are
            restricted, a day matching *either* fires. False: both must match
            (Celery ``crontab`` meaning).
        nonexistent: wall time inside a DST gap: ``"shift"`` (pre-gap offset),
            ``"gap_end"`` (the transition instant) or ``"skip"``; None = default
            (``"shift"`` for fixed-time entries, ``"skip"`` for wildcard ones).
        repeated: wall time occurring twice: ``"first"``, ``"last"`` or ``"both"``;
            None = default (``"first"`` fixed-time, ``"both"`` wildcard).

    Raises:
        InvalidScheduleError: unreadable expression (croniter's error as
            ``__cause__``), longer than :data:`MAX_CRON_LENGTH` characters,
            seconds-first 6-field string, an expression that never
            matches (none within 30 years), or an unknown rule name.
        UnknownTimezoneError: unknown zone.
    """

    kind: ClassVar[str] = "cron"

    def __init__(
        self,
        expr: str,
        timezone: str = "UTC",
        *,
        day_or: bool = True,
        nonexistent: str | None = None,
        repeated: str | None = None,
    ) -> None:
        if not isinstance(expr, str):
            raise InvalidScheduleError(f"cron expression must be a string, got {expr!r}")
        if len(expr) > MAX_CRON_LENGTH:
            raise InvalidScheduleError(
                f"cron expression {expr[:40]!r}... is {len(expr)} characters long; at most "
                f"{MAX_CRON_LENGTH} are accepted (each slot step re-reads it): use ranges and "
                "steps ('0-59/5') instead of long lists, or split the entry in two"
            )
        self.expr = expr
        self.timezone = validate_timezone(timezone)
        self.day_or = bool(day_or)
        self.nonexistent = nonexistent
        self.repeated = repeated
        self._zone = ZoneInfo(timezone)
        fields = _split_fields(expr)
        self._croniter_expr = " ".join(fields)
        self._check_syntax(fields)
        # POSIX OR of two restricted day fields (neither is exactly '*') is walked as the
        # union of two croniter expressions with one day field each: croniter ANDs them
        # when one holds L, W or #, and when it normalises the other to '*' ('1-31' with
        # '*/2'): tests/unit/test_cron_oracle.py lists the cases.
        self._exprs: tuple[str, ...] = (self._croniter_expr,)
        if self.day_or and fields[2] != "*" and fields[4] != "*":
            self._exprs = (
                " ".join([*fields[:4], "*", *fields[5:]]),
                " ".join([*fields[:2], "*", *fields[3:]]),
            )
        # One reusable croniter per expression and direction, per thread: building one
        # re-parses the expression (about half the cost of a step); a step repositions it.
        self._steppers = threading.local()
        self.fixed_time = not fields[0].startswith("*") and not fields[1].startswith("*")
        if nonexistent is not None and nonexistent not in NONEXISTENT_RULES:
            raise InvalidScheduleError(
                f"cron {expr!r}: nonexistent={nonexistent!r} is not one of "
                f"{', '.join(NONEXISTENT_RULES)} (or None for the default)"
            )
        if repeated is not None and repeated not in REPEATED_RULES:
            raise InvalidScheduleError(
                f"cron {expr!r}: repeated={repeated!r} is not one of "
                f"{', '.join(REPEATED_RULES)} (or None for the default)"
            )
        self._nonexistent = nonexistent or ("shift" if self.fixed_time else "skip")
        self._repeated = repeated or ("first" if self.fixed_time else "both")
        self._period: timedelta | None = None
        if self.next_after(_REFERENCE) is None:
            raise InvalidScheduleError(
                f"cron {expr!r} never matches (no slot within {_MAX_YEARS} years of "
                f"{_REFERENCE:%Y-%m-%d}), e.g. a day that does not exist in that month"
            )

    def _check_syntax(self, fields: list[str]) -> None:
        hint = (
            "croniter syntax: 5 fields 'minute hour day-of-month month day-of-week', "
            "or 6 with the seconds field LAST ('* * * * * */15' = every 15 seconds)"
        )
        if len(fields) not in (5, 6):
            raise InvalidScheduleError(
                f"cron {self.expr!r} has {len(fields)} fields; expected {hint}"
            )
        if any("?" in f for f in fields):
            raise InvalidScheduleError(
                f"cron {self.expr!r}: '?' is Quartz syntax, not cron: write '*' instead. "
                "Quartz also puts seconds FIRST and numbers days of the week 1=Sunday..7="
                "Saturday (cron: 0=Sunday, 1=Monday), so write the days as names (MON-FRI). "
                + _seconds_first_fix(fields)
            )
        if len(fields) == 6 and fields[5] == "*" and fields != ["*"] * 6:
            raise InvalidScheduleError(
                f"cron {self.expr!r}: a 6-field string has its seconds field LAST, so this "
                "means 'every second' of the matching minutes; that is almost always the "
                "seconds-first mistake. Put seconds last, e.g. '* * * * * */15' for every "
                "15 seconds (or use '* * * * * *' for every second). "
                + _seconds_first_fix(fields)
            )
        if len(fields) == 6 and _reads_seconds_first(fields):
            raise InvalidScheduleError(
                f"cron {self.expr!r} looks like a seconds-FIRST cron (Spring/Quartz "
                "'second minute hour day-of-month month day-of-week'): "
                + _seconds_first_why(fields)
                + ". reliable_beat reads 6 fields with the seconds field LAST (croniter). "
                + _seconds_first_fix(fields, ambiguous=not _day_of_week_like(fields[5]))
            )
        dom = fields[2].lower()
        if "w" in dom:
            day = dom[:-1]
            if not (dom.endswith("w") and day.isdigit() and 1 <= int(day) <= 28):
                raise InvalidScheduleError(
                    f"cron {self.expr!r}: day-of-month {fields[2]!r}: 'W' (nearest weekday) "
                    "is supported as a single day 1W..28W only (a list, a range, LW or a day "
                    "some months lack has no agreed meaning); use e.g. '15W', 'L', or a list "
                    "of days"
                )
        try:
            for expr in (self._croniter_expr,):
                croniter(expr, _REFERENCE.replace(tzinfo=None), day_or=self.day_or)
        except (CroniterError, ValueError, KeyError, TypeError) as exc:
            extra = ""
            if len(fields) == 6 and _valid_seconds_first(fields):
                extra = " It reads as a seconds-FIRST (Spring/Quartz) cron. " + (
                    _seconds_first_fix(fields)
                )
            raise InvalidScheduleError(
                f"cron {self.expr!r} is not valid: {exc}; expected {hint}.{extra}"
            ) from exc

    # -- wall-clock iteration -------------------------------------------------------

    def _iter(self, expr: str, wall: datetime) -> croniter:
        return croniter(
            expr,
            wall,
            day_or=self.day_or,
            max_years_between_matches=_MAX_YEARS,
        )

    def _instants(self, wall: datetime) -> list[datetime]:
        return _wall_to_instants(wall, self._zone, self._nonexistent, self._repeated)

    def _stream(self, expr: str, after_wall: datetime) -> Iterator[datetime]:
        it = self._iter(expr, after_wall)
        while True:
            try:
                yield it.get_next(datetime)
            except CroniterBadDateError:
                return

    def _walls_forward(self, after_wall: datetime) -> Iterator[datetime]:
        """Matching naive wall times strictly after ``after_wall``, ascending, unique."""
        if len(self._exprs) == 1:
            yield from self._stream(self._exprs[0], after_wall)
            return
        last: datetime | None = None
        for wall in heapq.merge(*(self._stream(e, after_wall) for e in self._exprs)):
            if wall != last:
                last = wall
                yield wall

    def _step(self, expr: str, wall: datetime, forward: bool) -> datetime | None:
        """One croniter step from ``wall`` (exclusive), or None when there is no match.

        Reuses this thread's croniter for ``(expr, forward)``, repositioned at ``wall``
        (``set_current``): the same answer as a fresh ``croniter(expr, wall)``, checked by
        tests/unit/test_cron_oracle.py, without re-parsing the expression.
        """
        cache: dict[tuple[str, bool], croniter] = self._steppers.__dict__.setdefault("c", {})
        it = cache.pop((expr, forward), None)
        if it is None:
            it = self._iter(expr, wall)
        else:
            it.set_current(wall, force=True)
        try:
            found = it.get_next(datetime) if forward else it.get_prev(datetime)
        except CroniterBadDateError:
            return None  # the instance is dropped: a failed search leaves no state behind
        cache[(expr, forward)] = it
        return found  # type: ignore[no-any-return]

    def _wall_after(self, wall: datetime) -> datetime | None:
        """First matching naive wall time strictly after ``wall`` (one croniter step each)."""
        found = [w for w in (self._step(e, wall, True) for e in self._exprs) if w is not None]
        return min(found) if found else None

    def _wall_before(self, wall: datetime) -> datetime | None:
        """Last matching naive wall time strictly before ``wall`` (one croniter step each)."""
        found = [w for w in (self._step(e, wall, False) for e in self._exprs) if w is not None]
        return max(found) if found else None

    def _transition_around(self, at: datetime) -> datetime | None:
        """The DST transition instant within ±3 h of ``at`` (UTC), or None."""
        lo, hi = at - _MARGIN, at + _MARGIN
        if _offset(lo, self._zone) == _offset(hi, self._zone):
            return None
        return _transition_instant(lo, hi, self._zone)

    def _pieces(self, transition: datetime) -> tuple[timedelta, timedelta, datetime, datetime]:
        """Offsets before/after ``transition`` and the wall times where pieces change.

        Around one transition the wall clock splits into three pieces, each with a
        fixed, monotone wall → instant map (``instant = wall - offset``): before the
        gap/repeated range (offset before), inside it (by the rule), after it (offset
        after). Returns ``(offset_before, offset_after, p1, p2)`` with ``p1 <= p2`` the
        naive wall times where the middle piece starts and ends.
        """
        before = _offset(transition - _ONE_SECOND, self._zone)
        after = _offset(transition, self._zone)
        at = transition.replace(tzinfo=None)
        return before, after, at + min(before, after), at + max(before, after)

    def _candidates_after(self, t: datetime, transition: datetime) -> list[datetime]:
        """Slots > ``t`` containing the smallest one whose wall time is near ``transition``.

        Within a piece with offset ``o`` the smallest slot > t comes from the first
        matching wall time after ``max(piece start, t + o)``; so one croniter step
        from each of four wall times suffices.
        """
        before, after, p1, p2 = self._pieces(transition)
        tn = t.replace(tzinfo=None)
        out: list[datetime] = []
        for start in {tn + before, tn + after, p1 - _ONE_SECOND, p2 - _ONE_SECOND}:
            wall = self._wall_after(start)
            if wall is not None:
                out.extend(i for i in self._instants(wall) if i > t)
        return out

    def _candidates_at_or_before(self, t: datetime, transition: datetime) -> list[datetime]:
        """Mirror of :meth:`_candidates_after`: slots <= ``t`` containing the largest."""
        before, after, p1, p2 = self._pieces(transition)
        tn = t.replace(tzinfo=None) + _ONE_SECOND
        out: list[datetime] = []
        for start in {tn + before, tn + after, p1, p2}:
            wall = self._wall_before(start)
            if wall is not None:
                out.extend(i for i in self._instants(wall) if i <= t)
        return out

    # -- public API -----------------------------------------------------------------

    def next_after(self, after: datetime) -> datetime | None:
        """Return the first slot strictly after ``after`` (UTC), or None if none ever.

        Common case (no offset change within ±3 h of ``after`` and of the result):
        one croniter step on the wall clock. Near a DST transition, wall-time order
        is not UTC order; then the wall clock is cut into pieces around the
        transition and one croniter step per piece finds the answer (at most four
        steps, whatever the cron's frequency).

        Args:
            after: tz-aware instant, any offset.

        Raises:
            ValueError: ``after`` is naive.
        """
        t = truncate(after)
        transition = self._transition_around(t)
        if transition is None:
            wall = self._wall_after(_local_wall(t, self._zone))
            if wall is None:
                return None
            later = [i for i in self._instants(wall) if i > t]
            probe = (
                later[0]
                if later
                else (wall - _offset_of_wall(wall, self._zone)).replace(tzinfo=UTC)
            )
            if later and self._transition_around(probe) is None:
                return later[0]
            transition = self._transition_around(probe)
            if transition is None:  # pragma: no cover - a skipped wall is at a transition
                return later[0] if later else None
        seen: set[datetime] = set()
        best: datetime | None = None
        while transition is not None and transition not in seen:
            seen.add(transition)
            found = self._candidates_after(t, transition)
            if best is not None:
                found.append(best)
            if not found:
                return None
            best = min(found)
            transition = self._transition_around(best)
        return best

    def previous_at_or_before(self, at: datetime) -> datetime | None:
        """Return the latest slot at or before ``at`` (UTC), or None if none.

        Mirror image of :meth:`next_after` (same fast path, same pieces).

        Args:
            at: tz-aware instant, any offset.

        Raises:
            ValueError: ``at`` is naive.
        """
        t = truncate(at)
        transition = self._transition_around(t)
        if transition is None:
            wall = self._wall_before(_local_wall(t, self._zone) + _ONE_SECOND)
            if wall is None:
                return None
            earlier = [i for i in self._instants(wall) if i <= t]
            probe = (
                earlier[-1]
                if earlier
                else (wall - _offset_of_wall(wall, self._zone)).replace(tzinfo=UTC)
            )
            if earlier and self._transition_around(probe) is None:
                return earlier[-1]
            transition = self._transition_around(probe)
            if transition is None:  # pragma: no cover
                return earlier[-1] if earlier else None
        seen: set[datetime] = set()
        best: datetime | None = None
        while transition is not None and transition not in seen:
            seen.add(transition)
            found = self._candidates_at_or_before(t, transition)
            if best is not None:
                found.append(best)
            if not found:
                return None
            best = max(found)
            transition = self._transition_around(best)
        return best

    def slots_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Yield the slots in ``[start, end)`` (UTC, ascending, unique), in one pass.

        Wall times are walked once (widened by the offset drop when a fall-back is
        within 3 h of ``start`` or ``end``); instants are buffered in a heap and
        released once no later wall time can map before them, so the window may be
        long.

        Args:
            start: tz-aware, inclusive.
            end: tz-aware, exclusive.

        Raises:
            ValueError: ``start`` or ``end`` is naive.
        """
        truncate(start)  # rejects naive
        truncate(end)
        start_u, end_u = start.astimezone(UTC), end.astimezone(UTC)
        zone = self._zone
        if start_u >= end_u:
            return
        # A wall time w maps to w - o for an offset o in force within 3 h (a gap wall
        # read with the pre-gap offset included), so the walk is widened by the
        # offset change near start and end; usually zero.
        around_start = (_offset(start_u - _MARGIN, zone), _offset(start_u + _MARGIN, zone))
        around_end = (_offset(end_u - _MARGIN, zone), _offset(end_u + _MARGIN, zone))
        lookback = max(_offset(start_u, zone) - min(around_start), _ZERO)
        lookahead = max(max(around_end) - _offset(end_u, zone), _ZERO)
        first_wall = _local_wall(truncate(start_u), zone) - lookback - _ONE_SECOND
        end_wall = _local_wall(truncate(end_u), zone) + lookahead + _ONE_SECOND
        pending: list[datetime] = []
        last: datetime | None = None
        for wall in self._walls_forward(first_wall):
            if wall > end_wall:
                break
            for instant in self._instants(wall):
                if start_u <= instant < end_u:
                    heapq.heappush(pending, instant)
            # a later wall time w' maps to w' - offset >= wall - 14 h (largest offset) - margin
            floor = wall.replace(tzinfo=UTC) - _RELEASE_LAG
            while pending and pending[0] < floor:
                instant = heapq.heappop(pending)
                if instant != last:
                    last = instant
                    yield instant
        while pending:
            instant = heapq.heappop(pending)
            if instant != last:
                last = instant
                yield instant

    def to_spec(self) -> dict[str, Any]:
        """Return ``{"kind": "cron", "expr", "timezone", "day_or", "nonexistent", "repeated"}``.

        ``nonexistent``/``repeated`` are the overrides as given (None = default rule).
        """
        return {
            "kind": "cron",
            "expr": self.expr,
            "timezone": self.timezone,
            "day_or": self.day_or,
            "nonexistent": self.nonexistent,
            "repeated": self.repeated,
        }

    @property
    def nominal_period(self) -> timedelta:
        """Gap between the first two slots after 2001-01-01T00:00Z (for warnings only)."""
        if self._period is None:
            first = self.next_after(_REFERENCE)
            second = self.next_after(first) if first is not None else None
            self._period = (
                second - first if first is not None and second is not None else timedelta(0)
            )
        return self._period
