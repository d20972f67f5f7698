"""Celery ``beat_schedule`` values (crontab, schedule, timedelta, seconds, cron strings)
converted into schedules of the same meaning, or refused with the reason and the fix."""

from __future__ import annotations

import sys
from datetime import datetime, timedelta
from typing import Any

from croniter import CroniterError, croniter

from reliable_beat.errors import InvalidScheduleError, UnknownTimezoneError
from reliable_beat.redaction import get_logger
from reliable_beat.schedules.base import Schedule, validate_timezone
from reliable_beat.schedules.cron import _REFERENCE, CronSchedule
from reliable_beat.schedules.interval import IntervalSchedule

# the logger's name is the one users configure: unchanged since the schedules were one module
log = get_logger("reliable_beat.schedules")

__all__ = ["describe_crontab", "from_celery"]


_CELERY_FIELDS = (
    # (attribute, original-value attribute, keyword, lowest, highest)
    ("minute", "_orig_minute", "minute", 0, 59),
    ("hour", "_orig_hour", "hour", 0, 23),
    ("day_of_month", "_orig_day_of_month", "day_of_month", 1, 31),
    ("month_of_year", "_orig_month_of_year", "month_of_year", 1, 12),
    ("day_of_week", "_orig_day_of_week", "day_of_week", 0, 6),
)


def describe_crontab(obj: Any) -> str:
    """Quote a Celery ``crontab`` as the user wrote it: ``crontab(minute='*/2 5', hour=3)``.

    Built from Celery's ``_orig_*`` attributes (the arguments as given); fields left at
    Celery's default ``'*'`` are omitted. Used in every error about a crontab, so a
    message never quotes our rendered cron string instead of the user's text.
    """
    parts: list[str] = []
    for _attr, orig_attr, keyword, _lo, _hi in _CELERY_FIELDS:
        orig = getattr(obj, orig_attr, "*")
        if isinstance(orig, str) and orig == "*":
            continue
        parts.append(f"{keyword}={orig!r}")
    return f"crontab({', '.join(parts)})"


def _runs(values: list[int]) -> str:
    """``[1, 2, 3, 5, 7, 8]`` → ``"1-3,5,7,8"`` (runs of three or more become ranges)."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{values[i]}-{values[j]}")
        else:
            out.extend(str(v) for v in values[i : j + 1])
        i = j + 1
    return ",".join(out)


def _render_celery_field(values: list[int], lo: int, hi: int, star: bool) -> str | None:
    """Render one expanded crontab field (Celery's own set) as a croniter field.

    ``star`` (the user's text starts with ``*``) must survive for the minute and hour
    fields, because it decides the DST rule (wildcard vs fixed-time, ``docs/dst.md``):
    a star field renders as ``*``, ``*/n`` or ``*/n,<extra values>``; any other field as a
    plain list with ranges, never starting with ``*``. Returns None when a star field
    cannot be written (its set lacks the field's lowest value).
    """
    if not star:
        step = values[1] - values[0] if len(values) >= 3 else 0
        if step > 1 and values == list(range(values[0], values[-1] + 1, step)):
            return f"{values[0]}-{values[-1]}/{step}"  # '0-58/2', short and not '*'
        return _runs(values)
    if values == list(range(lo, hi + 1)):
        return "*"
    if not values or values[0] != lo:
        return None
    have = set(values)
    # smallest step whose progression lo, lo+s, ... lies inside the set (s = span: {lo})
    step = next(s for s in range(2, hi - lo + 2) if set(range(lo, hi + 1, s)) <= have)
    rest = sorted(have - set(range(lo, hi + 1, step)))
    return f"*/{step}" + (f",{_runs(rest)}" if rest else "")


def _croniter_sets(expr: str) -> list[set[int]]:
    """The five field sets croniter expands ``expr`` to (``*`` → the full range; 7 → 0)."""
    expanded = croniter(expr, _REFERENCE.replace(tzinfo=None), day_or=False).expanded
    out: list[set[int]] = []
    for field, (_a, _o, _k, lo, hi) in zip(expanded, _CELERY_FIELDS, strict=True):
        if field == ["*"]:
            out.append(set(range(lo, hi + 1)))
        else:
            out.append({int(v) % 7 if hi == 6 else int(v) for v in field})
    return out


#: (where, crontab as written) already warned about by :func:`_warn_lenient_fields`: a beat
#: builds its definitions more than once at start; the warning is said once per process.
_LENIENT_WARNED: set[tuple[str, str]] = set()


def _warn_lenient_fields(obj: Any, where: str, expr: str) -> None:
    """Log a WARNING when a crontab field's text holds spaces (a whole cron string given as
    ``minute=``, say): Celery reads each comma-separated part up to its first space and
    ignores the rest, without a word. Celery's meaning is kept; the warning names the
    entry, the field, what Celery read and what it ignored."""
    ignored: list[str] = []
    for _attr, orig_attr, keyword, _lo, _hi in _CELERY_FIELDS:
        orig = getattr(obj, orig_attr, None)
        if not isinstance(orig, str) or not any(c.isspace() for c in orig.strip()):
            continue
        parts = [p.strip() for p in orig.split(",")]
        read = ",".join(p.split(None, 1)[0] for p in parts if p)
        dropped = "; ".join(p.split(None, 1)[1] for p in parts if len(p.split(None, 1)) > 1)
        ignored.append(f"{keyword}={orig!r} is read as {keyword}={read!r}, ignoring "
                       f"{dropped!r}")
    if not ignored:
        return
    source = describe_crontab(obj)
    if (where, source) in _LENIENT_WARNED:
        return
    if len(_LENIENT_WARNED) < 10_000:
        _LENIENT_WARNED.add((where, source))
    log.warning(
        "%s%s: %s. That is Celery's own reading of it, kept as is: cron %r. If the ignored "
        "part was meant (a whole cron string given as one field), give each field its own "
        "argument, e.g. crontab(minute='*/2', hour='6-17'), or give the cron string itself "
        "as the schedule", where, source, "; ".join(ignored), expr)


def _crontab_expr(obj: Any, where: str) -> str:
    """Render a Celery ``crontab`` as a 5-field croniter string, from Celery's own sets.

    Every field is rendered from the set Celery expanded (``crontab.minute``, ``.hour``,
    ``.day_of_month``, ``.month_of_year``, ``.day_of_week``), never from the text the user
    wrote: Celery's parsing is what counts (``minute='*/2 5'`` is every 2 minutes in Celery,
    and stays so). Only the *star-ness* of the minute and hour text is kept (it decides the
    DST rule; a full set counts as ``*``). The result is checked: croniter must expand it
    back to exactly Celery's sets. Day-of-week numbering is the same in both (0 = Sunday).

    Raises:
        InvalidScheduleError: the crontab cannot be written as a cron string with the same
            meaning (quotes the crontab as written, never our rendering).
    """
    source = describe_crontab(obj)
    celery_sets: list[set[int]] = []
    parts: list[str] = []
    for attr, orig_attr, keyword, lo, hi in _CELERY_FIELDS:
        try:
            values = sorted({int(v) for v in getattr(obj, attr)})
        except (TypeError, ValueError) as exc:
            raise InvalidScheduleError(
                f"{where}{source}: field {keyword} is not a set of integers ({exc}); build "
                "it with celery.schedules.crontab(...)"
            ) from exc
        if not values or values[0] < lo or values[-1] > hi:
            raise InvalidScheduleError(
                f"{where}{source}: Celery expanded {keyword} to {values!r}, outside "
                f"{lo}-{hi}; give values in that range"
            )
        orig = getattr(obj, orig_attr, None)
        if orig is None:  # pragma: no cover - every Celery 5 crontab keeps its arguments
            star = values == list(range(lo, hi + 1))
        else:
            star = isinstance(orig, str) and orig.strip().startswith("*")
        # a full set is '*' whatever its text (hour=range(24) stays an hourly wildcard)
        star = star or values == list(range(lo, hi + 1))
        rendered = _render_celery_field(values, lo, hi, star)
        if rendered is None:
            raise InvalidScheduleError(
                f"{where}{source}: field {keyword}={orig!r} starts with '*' but Celery expanded "
                f"it to {values!r}, which has no cron form that keeps the wildcard DST rule; "
                "write the values as a list without '*'"
            )
        celery_sets.append(set(values))
        parts.append(rendered)
    expr = " ".join(parts)
    try:
        ours = _croniter_sets(expr)
    except (CroniterError, ValueError, KeyError, TypeError) as exc:  # pragma: no cover
        raise InvalidScheduleError(
            f"{where}{source} cannot be converted to a cron string ({exc}); please report it"
        ) from exc
    for got, want, field in zip(ours, celery_sets, _CELERY_FIELDS, strict=True):
        keyword = field[2]
        if got != want:  # pragma: no cover - a rendering bug; refuse rather than guess
            raise InvalidScheduleError(
                f"{where}{source}: converting field {keyword} would change its meaning "
                f"(Celery: {sorted(want)}, cron {expr!r}: {sorted(got)}); please report it, "
                "and write the schedule as a cron string meanwhile"
            )
    _warn_lenient_fields(obj, where, expr)
    return expr


def _crontab_zone(obj: Any, where: str) -> str | None:
    """The zone a crontab carries itself, or None (then Celery uses the app's ``timezone``).

    Celery evaluates a crontab on the clock ``nowfun()`` returns (django-celery-beat's
    ``TzAwareCrontab`` keeps it as ``.tz``); that zone is the crontab's meaning.

    Raises:
        InvalidScheduleError: ``nowfun`` gives a naive time (the host's local clock) or a
            zone with no IANA name.
    """
    # an instance attribute only: BaseSchedule.tz is a property giving the app's zone
    tz = vars(obj).get("tz")
    if tz is None and getattr(obj, "nowfun", None) is not None:
        try:
            now = obj.nowfun()
        except Exception as exc:
            raise InvalidScheduleError(
                f"{where}{describe_crontab(obj)}: its nowfun() failed ({exc!r}); drop nowfun "
                "and set the entry's zone with options['reliable_beat']['timezone']"
            ) from exc
        if not isinstance(now, datetime) or now.tzinfo is None:
            raise InvalidScheduleError(
                f"{where}{describe_crontab(obj)}: its nowfun() returns a naive time (the "
                "host's local clock), which no slot can be keyed on; drop nowfun and set the "
                "entry's zone with options['reliable_beat']['timezone']"
            )
        tz = now.tzinfo
    if tz is None:
        return None
    name = getattr(tz, "key", None) or getattr(tz, "zone", None)  # zoneinfo / pytz
    if name is None and tz.utcoffset(None) == timedelta(0) and str(tz) == "UTC":
        name = "UTC"
    if not isinstance(name, str):
        raise InvalidScheduleError(
            f"{where}{describe_crontab(obj)} is evaluated in {tz!r}, which has no IANA zone "
            "name; drop nowfun/tz and set the entry's zone with "
            "options['reliable_beat']['timezone'] (e.g. 'Europe/Berlin')"
        )
    return validate_timezone(name)


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _overrides(obj: object, base: type, names: tuple[str, ...]) -> list[str]:
    """Methods of ``names`` that ``type(obj)`` redefines below ``base``."""
    return [n for n in names if getattr(type(obj), n, None) is not getattr(base, n, None)]


def from_celery(
    obj: object,
    *,
    timezone: str,
    anchor: datetime,
    entry: str = "?",
    relative: bool = False,
) -> Schedule:
    """Convert a Celery ``beat_schedule`` value into a :class:`Schedule`, same meaning or refused.

    * ``celery.schedules.crontab`` → :class:`CronSchedule` with ``day_or=False``
      (Celery ANDs day_of_month and day_of_week; cron strings OR them), rendered from the
      field sets Celery itself expanded and checked against them, in the zone of its own
      clock when it has one (``nowfun``, django-celery-beat's ``tz``), else ``timezone``.
    * ``celery.schedules.schedule``, :class:`~datetime.timedelta`, int/float seconds →
      :class:`IntervalSchedule` anchored at ``anchor``.
    * a cron string → :class:`CronSchedule` (POSIX ``day_or=True``).
    * one of our :class:`Schedule` objects → returned as is (its own zone is kept).

    ``relative`` is the ``beat_schedule`` entry key of the same name, applied as Celery's
    ``maybe_schedule`` applies it: only to a number or ``timedelta`` (it builds
    ``schedule(td, relative=True)``); Celery ignores it on every other value, and so do
    we.

    Args:
        obj: the schedule value.
        timezone: IANA zone of the entry (Celery's ``timezone`` setting).
        anchor: tz-aware grid anchor for intervals.
        entry: entry name, for error messages.
        relative: the entry's ``relative`` key (Celery default False).

    Raises:
        InvalidScheduleError: ``solar`` schedules (no stable slots), relative intervals
            (``schedule(..., relative=True)``: Celery rounds each run to the interval's
            resolution from when beat started, no fixed grid), custom ``BaseSchedule``
            subclasses (decided at run time, no fixed slots), unsupported types, or
            invalid values; the message names the entry, quotes what the user wrote and
            says what to use instead.
        UnknownTimezoneError: unknown zone.
    """
    where = f"entry {entry!r}: "
    if isinstance(obj, Schedule):
        return obj
    # A Celery schedule object exists only once celery.schedules is imported: look it up
    # instead of importing Celery (the core imports no framework; Celery is an extra).
    celery_schedules: Any = sys.modules.get("celery.schedules")
    relative_hint = (
        "Celery's relative=True rounds each run to the interval's resolution counted from "
        "when beat started, so its slots move with every restart; reliable_beat slots sit "
        "on a fixed grid (anchor + k x interval, the anchor kept with the entry). Drop "
        "relative=True (set the grid with options['reliable_beat']['anchor'] if the phase "
        "matters) or use a crontab"
    )
    try:
        if celery_schedules is not None:
            if isinstance(obj, celery_schedules.solar):
                raise InvalidScheduleError(
                    f"{where}celery solar schedules are not supported (their "
                    "slots move with the sun and cannot be keyed); use a crontab instead"
                )
            if isinstance(obj, celery_schedules.crontab):
                expr = _crontab_expr(obj, where)
                zone = _crontab_zone(obj, where) or timezone
                try:
                    return CronSchedule(expr, zone, day_or=False)
                except UnknownTimezoneError:
                    raise
                except InvalidScheduleError as exc:
                    message = str(exc).replace(f"cron {expr!r}", describe_crontab(obj))
                    raise InvalidScheduleError(f"{where}{message}") from exc
            if isinstance(obj, celery_schedules.schedule):
                custom = _overrides(
                    obj, celery_schedules.schedule, ("is_due", "remaining_estimate")
                )
                if custom:
                    raise InvalidScheduleError(
                        f"{where}{_type_name(obj)} (a celery schedule subclass) overrides "
                        f"{', '.join(custom)}: when it runs is decided at run time, so it has "
                        "no fixed slots to key runs by. Use a plain schedule/timedelta, a "
                        "crontab or a cron string, or add/remove a runtime entry from your "
                        "code when the condition changes"
                    )
                if getattr(obj, "relative", False):
                    raise InvalidScheduleError(
                        f"{where}schedule({obj.run_every!r}, relative=True): {relative_hint}"
                    )
                return IntervalSchedule(obj.run_every, anchor, timezone)
            if isinstance(obj, celery_schedules.BaseSchedule):
                raise InvalidScheduleError(
                    f"{where}{_type_name(obj)} is a custom celery schedule (a BaseSchedule "
                    "subclass): its is_due() decides at run time whether to run (e.g. by a "
                    "query per tick), so it has no fixed slots, and reliable_beat keys every "
                    "run by its slot (what makes it run once). Use a cron string or crontab, "
                    "or an interval (timedelta), whichever grid the condition is checked on "
                    "(and check the condition in the task), or add and remove a runtime entry "
                    "from your code when the condition changes (`reliable-beat entries add`)"
                )
        if isinstance(obj, (timedelta, int, float)) and not isinstance(obj, bool):
            every = obj if isinstance(obj, timedelta) else timedelta(seconds=obj)
            if relative:
                raise InvalidScheduleError(
                    f"{where}'relative': True with schedule {obj!r}: {relative_hint}"
                )
            return IntervalSchedule(every, anchor, timezone)
        if isinstance(obj, str):
            return CronSchedule(obj, timezone)
    except InvalidScheduleError as exc:
        if str(exc).startswith(where):
            raise
        raise InvalidScheduleError(f"{where}{exc}") from exc
    shown = repr(obj)
    if " object at 0x" in shown:  # the default repr says nothing useful
        shown = f"a {_type_name(obj)} object"
    raise InvalidScheduleError(
        f"{where}unsupported schedule {shown} ({type(obj).__name__}); use a "
        "celery crontab or schedule, a timedelta, seconds, or a cron string"
    )
