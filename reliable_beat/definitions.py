"""Entry definitions: :class:`EntryDefinition`, and its parsing from a ``beat_schedule`` item.

An *entry* is a named recurring definition (Celery's word): a task, its arguments, publish
options, a schedule, and per-entry policies. Entries live in ``reliable_beat_entries``; the
beat never holds them all in memory.

Per-entry settings in a Celery ``beat_schedule`` entry go under ``options["reliable_beat"]``
(portable: stock beat ignores unknown options) or a top-level ``"reliable_beat"`` key::

    "pay-merchants": {
        "task": "shop.pay_merchants",
        "schedule": crontab(minute=0, hour=2),
        "options": {"queue": "payouts", "expires": 3600,
                    "reliable_beat": {"misfire_policy": "catch_up", "catch_up_limit": 3,
                                      "timezone": "Europe/Berlin", "overlap_policy": "skip"}},
    }

Keys: ``misfire_policy``, ``misfire_grace`` (seconds or ``timedelta``), ``catch_up_limit``,
``catch_up_window`` (seconds or ``timedelta``), ``overlap_policy``, ``timezone`` (IANA),
``dst_nonexistent`` (``shift``, ``gap_end``, ``skip``), ``dst_repeated`` (``first``, ``last``,
``both``), ``start_at`` / ``end_at`` (tz-aware ``datetime`` or ISO 8601), ``anchor`` (interval
grid anchor; default: when the entry is first stored), ``task_elsewhere`` (``True``: the task
is registered only by workers of another code base, so a beat whose app does not register it
fires it anyway instead of parking it; see :func:`reliable_beat.entries.park_reason`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from reliable_beat import schedules as sch
from reliable_beat import values as rb_values
from reliable_beat.errors import ConfigurationError, EntryValidationError
from reliable_beat.handlers import CELERY_PROTOCOL_HEADERS
from reliable_beat.policies import MisfirePolicy, OverlapPolicy, catch_up_limit_problem
from reliable_beat.redaction import get_logger
from reliable_beat.rows import check_options
from reliable_beat.settings import Settings

__all__ = [
    "ENTRY_OPTION_KEYS",
    "PUBLISH_OPTION_KEYS",
    "EntryDefinition",
    "definition_from_celery",
    "definitions_from_beat_schedule",
    "is_task_elsewhere",
]

log = get_logger("reliable_beat.definitions")

ENTRY_OPTION_KEYS = frozenset(
    {
        "misfire_policy",
        "misfire_grace",
        "catch_up_limit",
        "catch_up_window",
        "overlap_policy",
        "timezone",
        "dst_nonexistent",
        "dst_repeated",
        "start_at",
        "end_at",
        "anchor",
        "task_elsewhere",
    }
)
#: Celery publish options an entry may carry (``expires`` counts from the slot).
PUBLISH_OPTION_KEYS = frozenset(
    {"queue", "routing_key", "exchange", "priority", "expires", "headers", "serializer"}
)


#: :meth:`EntryDefinition.first_fire_at`'s default: a recurring entry's rule for every kind.
_RECURRING = object()


@dataclass
class EntryDefinition:
    """One entry as the user defines it (config or runtime).

    Attributes:
        name: unique name.
        task: registered Celery task name.
        schedule: when it fires (its ``timezone`` is the entry's zone).
        args / kwargs: JSON-serialisable call arguments.
        options: publish options (queue, routing_key, exchange, priority, headers, serializer,
            expires in seconds counted from the slot).
        misfire_policy / misfire_grace / catch_up_limit / catch_up_window / overlap_policy: see
            :mod:`reliable_beat.policies`.
        start_at / end_at: UTC-aware bounds of the slots, or None.
        origin: ``config`` (from ``beat_schedule``) or ``runtime`` (API / CLI).
    """

    name: str
    task: str
    schedule: sch.Schedule
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    misfire_policy: str = MisfirePolicy.FIRE_ONCE.value
    misfire_grace: timedelta = timedelta(seconds=60)
    catch_up_limit: int = 100
    catch_up_window: timedelta | None = None
    overlap_policy: str = OverlapPolicy.ALLOW.value
    start_at: datetime | None = None
    end_at: datetime | None = None
    origin: str = "runtime"

    def config_hash(self) -> str:
        """A digest of what the user defined (an interval's stored anchor excluded)."""
        spec = self.schedule.to_spec()
        if spec.get("kind") == "interval" and not getattr(self, "_explicit_anchor", False):
            spec = {k: v for k, v in spec.items() if k != "anchor"}
        body = {
            "task": self.task,
            "schedule": spec,
            "args": self.args,
            "kwargs": self.kwargs,
            "options": self.options,
            "misfire_policy": self.misfire_policy,
            "misfire_grace": self.misfire_grace.total_seconds(),
            "catch_up_limit": self.catch_up_limit,
            "catch_up_window": (
                self.catch_up_window.total_seconds() if self.catch_up_window else None
            ),
            "overlap_policy": self.overlap_policy,
            "start_at": self.start_at.isoformat() if self.start_at else None,
            "end_at": self.end_at.isoformat() if self.end_at else None,
        }
        raw = json.dumps(body, sort_keys=True, default=str).encode()
        return hashlib.sha256(raw).hexdigest()

    def first_fire_at(
        self, now: datetime, *, one_off_fired_through: object = _RECURRING
    ) -> datetime | None:
        """The first slot of a new (or changed) entry: strictly after ``now`` and at or after
        ``start_at``. Nothing between ``start_at`` and creation is treated as missed.

        A one-off (``once``) is the exception when ``one_off_fired_through`` is given (a new
        entry: None; a changed one: its ``last_fire_at``): its only slot is returned even if
        it is already past — added a second late (a slow ``entries add --at`` a few seconds
        ahead, a deploy that lands after the instant), it is due at once and meets its misfire
        policy (fired late within or past the grace, or recorded ``skipped``), instead of
        being stored ``ended`` and silently never run. Not if that slot already fired
        (``at <= one_off_fired_through``), nor outside ``start_at`` / ``end_at``. The
        run row's UNIQUE(entry, slot) keeps it to one run whatever the caller passes."""
        schedule = self.schedule
        if (one_off_fired_through is not _RECURRING and isinstance(schedule, sch.OneOffSchedule)
                and schedule.at <= now):
            at: datetime = schedule.at
            fired = one_off_fired_through
            if ((fired is None or (isinstance(fired, datetime) and at > fired))
                    and (self.start_at is None or at >= self.start_at)
                    and (self.end_at is None or at <= self.end_at)):
                return at
        base = now
        if self.start_at is not None and self.start_at - timedelta(seconds=1) > base:
            base = self.start_at - timedelta(seconds=1)
        nxt = self.schedule.next_after(base)
        if nxt is not None and self.end_at is not None and nxt > self.end_at:
            return None
        return nxt

    def row_values(self) -> dict[str, Any]:
        """Column values of ``reliable_beat_entries`` for this definition."""
        return {
            "name": self.name,
            "task": self.task,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "options": dict(self.options),
            "schedule_kind": self.schedule.kind,
            "schedule": self.schedule.to_spec(),
            "timezone": self.schedule.timezone,
            "misfire_policy": self.misfire_policy,
            "misfire_grace_seconds": self.misfire_grace.total_seconds(),
            "catch_up_limit": self.catch_up_limit,
            "catch_up_window_seconds": (
                self.catch_up_window.total_seconds() if self.catch_up_window else None
            ),
            "overlap_policy": self.overlap_policy,
            "origin": self.origin,
            "config_hash": self.config_hash(),
            "start_at": self.start_at,
            "end_at": self.end_at,
        }


def _seconds(value: Any, what: str) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return timedelta(seconds=float(value))
    raise ConfigurationError(f"{what}={value!r}: expected seconds (number >= 0) or a timedelta")


def _instant(value: Any, what: str) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as exc:
            raise ConfigurationError(f"{what}={value!r}: not an ISO 8601 instant") from exc
    if not isinstance(value, datetime):
        raise ConfigurationError(f"{what}={value!r}: expected a tz-aware datetime")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ConfigurationError(
            f"{what}={value.isoformat()!r} is naive: give a tz-aware datetime (UTC offset)"
        )
    return value.astimezone(timezone.utc)


def _check_custom_headers(headers: Any, bad: Callable[[str], None]) -> None:
    """``options["headers"]`` must be an object of custom headers: a Celery protocol header
    (``task``, ``id``, ``eta``, ``retries``, ``root_id``, ...) would override the message's
    own (an entry for task A sent with ``task=B`` ran B)."""
    if headers is None:
        return
    if not isinstance(headers, Mapping):
        bad(f"options['headers'] must be a dict of custom headers, got {type(headers).__name__}")
        return
    reserved = sorted(str(k) for k in headers if str(k).lower() in CELERY_PROTOCOL_HEADERS)
    if reserved:
        bad(f"options['headers'] may not set Celery protocol header(s) {', '.join(reserved)}: "
            "they belong to the message itself (use the entry's 'task', 'expires', ... "
            "instead, or rename the custom header)")


def _encoded_arguments(
    args: list[Any], kwargs: dict[str, Any], bad: Callable[[str], None]
) -> tuple[list[Any], dict[str, Any]]:
    """An entry's args / kwargs as Celery's JSON serializer sends them (stock beat does).

    ``datetime``, ``Decimal``, ``UUID`` ... are stored in kombu's ``{"__type__", "__value__"}``
    form (:func:`reliable_beat.values.to_json_value`), which the worker's JSON decoder turns
    back into the same values; anything else is reported through ``bad``, naming the
    argument (``args[1]``, ``kwargs['when']``).
    """
    try:
        encoded_args = rb_values.to_json_value(args, "args")
    except ValueError as exc:
        bad(str(exc))
        encoded_args = []
    try:
        encoded_kwargs = rb_values.to_json_value(kwargs, "kwargs")
    except ValueError as exc:
        bad(str(exc))
        encoded_kwargs = {}
    return encoded_args, encoded_kwargs


def arguments_problem(
    task: str, function: Callable[..., Any] | None, args: list[Any], kwargs: dict[str, Any]
) -> str | None:
    """Why ``args`` / ``kwargs`` cannot be passed to ``function`` (task ``task``'s body, a
    bound task's ``self`` already bound), or None when they fit or nothing can be checked
    (no function, no readable signature). ``*args`` / ``**kwargs`` in the signature take
    anything, as they do when the worker calls the task. The signature read is the function's
    own, not the one ``functools.wraps`` points to: a decorator that supplies arguments itself
    takes what its wrapper takes (Celery checks the same way)."""
    if function is None:
        return None
    try:
        signature = inspect.signature(function, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        shown = signature.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty)
                        for p in signature.parameters.values()],
            return_annotation=inspect.Signature.empty)
        # the values are not shown: they may hold secrets (an api_key keyword)
        given = (f"{len(args)} positional argument(s)"
                 + (f" and keyword(s) {', '.join(map(repr, kwargs))}" if kwargs else ""))
        return (f"its args / kwargs ({given}) do not fit task {task!r}, which takes "
                f"{shown} ({exc}); every run would fail with a TypeError: give args / kwargs "
                "that the task takes")
    return None


def definition_from_celery(
    name: str,
    raw: Mapping[str, Any],
    *,
    default_timezone: str,
    settings: Settings,
    now: datetime,
    origin: str = "config",
    is_idempotent: Callable[[str], bool | None] | None = None,
    task_function: Callable[[str], Callable[..., Any] | None] | None = None,
) -> EntryDefinition:
    """Build an :class:`EntryDefinition` from one ``beat_schedule`` item.

    Args:
        name: the entry name (the ``beat_schedule`` key).
        raw: the item: ``task``, ``schedule`` (crontab / schedule / seconds / timedelta / cron
            string / a :class:`~reliable_beat.schedules.Schedule`), ``args``, ``kwargs``,
            ``options`` (with optional ``options["reliable_beat"]``), optional top-level
            ``reliable_beat``.
        default_timezone: the zone for entries that set none (Celery's ``timezone`` or UTC).
        settings: policy defaults.
        now: UTC-aware instant used as the default interval anchor.
        is_idempotent: task name -> True (IdempotentTask), False (plain task), None (unknown);
            used to refuse overlap policies that need run tracking on plain tasks.
        task_function: task name -> the function the worker calls with the entry's args /
            kwargs (None: not registered here, not checked); arguments that cannot bind to
            its signature are refused.

    Raises:
        EntryValidationError: every problem of this entry, each naming the entry and the fix.
    """
    problems: list[str] = []

    def bad(msg: str) -> None:
        problems.append(f"entry {name!r}: {msg}")

    if not isinstance(raw, Mapping):
        raise EntryValidationError([f"entry {name!r}: expected a dict, got {type(raw).__name__}"])
    task = raw.get("task")
    if not isinstance(task, str) or not task:
        bad("'task' must be the registered task name (a non-empty string)")
        task = "?"
    options = dict(raw.get("options") or {})
    rb = dict(options.pop("reliable_beat", None) or {})
    rb.update(raw.get("reliable_beat") or {})
    for key in sorted(set(rb) - ENTRY_OPTION_KEYS):
        bad(f"unknown reliable_beat option {key!r}; valid: {', '.join(sorted(ENTRY_OPTION_KEYS))}")
    for key in sorted(set(options) - PUBLISH_OPTION_KEYS):
        supported = ", ".join(sorted(PUBLISH_OPTION_KEYS))
        bad(f"unsupported publish option {key!r}; supported: {supported}")
    _check_custom_headers(options.get("headers"), bad)
    args = list(raw.get("args") or [])
    kwargs = dict(raw.get("kwargs") or {})
    if "expires" in options:
        exp = options["expires"]
        if isinstance(exp, timedelta):
            options["expires"] = exp.total_seconds()
        elif not isinstance(exp, (int, float)) or isinstance(exp, bool) or exp <= 0:
            bad(f"options['expires']={exp!r}: give seconds (> 0) counted from the slot")

    # the shapes a trigger needs (the beat checks stored rows the same way, reliable_beat.rows)
    expires_bad = any("options['expires']" in p for p in problems)
    for problem in check_options(options):
        if not (expires_bad and problem.startswith("options.expires")):
            bad(problem)
    for problem in rb_values.entry_name_problems(name):
        bad(problem)
    for key in ("queue", "routing_key", "exchange"):
        value = options.get(key)
        if isinstance(value, str) and value != value.strip():
            bad(f"options[{key!r}]={value!r} has leading or trailing whitespace: the broker "
                f"takes it as written, a name other than {value.strip()!r}; give "
                f"{value.strip()!r}")
    if task_function is not None and task != "?":
        misfit = arguments_problem(task, task_function(task), args, kwargs)
        if misfit is not None and origin == "config":
            # loud, never fatal: a configured schedule's other entries keep firing, and a
            # signature this check misreads cannot stop a working beat; each run of it is a
            # dead letter naming the TypeError
            log.error("entry %r: %s", name, misfit)
        elif misfit is not None:
            bad(misfit)
    args, kwargs = _encoded_arguments(args, kwargs, bad)
    try:
        json.dumps(options)
    except (TypeError, ValueError) as exc:
        bad(f"options are not JSON-serialisable ({exc}); pass plain JSON values")
    size = sum(len(json.dumps(v, separators=(",", ":"), ensure_ascii=False, default=str)
                   .encode()) for v in (args, kwargs, options))
    if size > settings.max_payload_bytes:
        bad(f"args + kwargs + options are {size} bytes as JSON, over "
            f"reliable_beat_max_payload_bytes ({settings.max_payload_bytes}); they are copied "
            "into every run, trigger and broker message: pass a reference (an id, a key) "
            "and load the data in the task")
    tz = rb.get("timezone") or default_timezone
    try:
        tz = sch.validate_timezone(tz)
    except ConfigurationError as exc:
        bad(str(exc))
        tz = "UTC"
    anchor = now.replace(microsecond=0)
    explicit_anchor = False
    if "anchor" in rb:
        try:
            anchor = _instant(rb["anchor"], "anchor")
            explicit_anchor = True
        except ConfigurationError as exc:
            bad(str(exc))
    schedule: sch.Schedule | None = None
    if "schedule" not in raw:
        bad("'schedule' is missing")
    else:
        try:
            # 'relative' as Celery reads it: it changes a number/timedelta (refused there),
            # and is ignored on a crontab or a schedule object, as Celery ignores it
            schedule = sch.from_celery(
                raw["schedule"], timezone=tz, anchor=anchor, entry=name,
                relative=bool(raw.get("relative", False)),
            )
            if rb.get("timezone") and schedule.timezone != tz:
                bad(f"timezone={tz!r} conflicts with the schedule's own zone "
                    f"{schedule.timezone!r} (a crontab's nowfun/tz or a Schedule object); "
                    "set the zone in one place")
            if schedule.kind == "cron" and (rb.get("dst_nonexistent") or rb.get("dst_repeated")):
                spec = schedule.to_spec()
                spec["nonexistent"] = rb.get("dst_nonexistent") or spec.get("nonexistent")
                spec["repeated"] = rb.get("dst_repeated") or spec.get("repeated")
                schedule = sch.schedule_from_spec(spec)
            elif rb.get("dst_nonexistent") or rb.get("dst_repeated"):
                bad("dst_nonexistent / dst_repeated apply to cron schedules only")
        except ConfigurationError as exc:
            bad(str(exc).replace(f"entry {name!r}: ", ""))

    misfire = rb.get("misfire_policy", settings.misfire_policy)
    if misfire not in {p.value for p in MisfirePolicy}:
        bad(f"misfire_policy={misfire!r}: expected one of catch_up, fire_once, skip")
    overlap = rb.get("overlap_policy", settings.overlap_policy)
    if overlap not in {p.value for p in OverlapPolicy}:
        bad(f"overlap_policy={overlap!r}: expected one of allow, skip, buffer_one")
    elif overlap != "allow" and is_idempotent is not None and is_idempotent(task) is False:
        bad(
            f"overlap_policy={overlap!r} needs run tracking, which only IdempotentTask keeps; "
            f"task {task!r} is a plain Celery task: use base=IdempotentTask or overlap 'allow'"
        )
    grace = timedelta(seconds=settings.misfire_grace_seconds)
    window = (
        timedelta(seconds=settings.catch_up_window_seconds)
        if settings.catch_up_window_seconds is not None
        else None
    )
    limit = settings.catch_up_limit
    try:
        if "misfire_grace" in rb:
            grace = _seconds(rb["misfire_grace"], "misfire_grace")
        if rb.get("catch_up_window") is not None:
            window = _seconds(rb["catch_up_window"], "catch_up_window")
    except ConfigurationError as exc:
        bad(str(exc))
    if "catch_up_limit" in rb:
        limit = rb["catch_up_limit"]
        limit_problem = catch_up_limit_problem(limit)
        if limit_problem is not None:
            bad(limit_problem)
            limit = 0
    start_at = end_at = None
    try:
        start_at = _instant(rb["start_at"], "start_at") if rb.get("start_at") else None
        end_at = _instant(rb["end_at"], "end_at") if rb.get("end_at") else None
    except ConfigurationError as exc:
        bad(str(exc))
    if problems or schedule is None:
        raise EntryValidationError(problems)
    definition = EntryDefinition(
        name=name,
        task=task,
        schedule=schedule,
        args=args,
        kwargs=kwargs,
        options=options,
        misfire_policy=misfire,
        misfire_grace=grace,
        catch_up_limit=limit,
        catch_up_window=window,
        overlap_policy=overlap,
        start_at=start_at,
        end_at=end_at,
        origin=origin,
    )
    object.__setattr__(definition, "_explicit_anchor", explicit_anchor)
    if rb.get("task_elsewhere") not in (None, False, True):
        raise EntryValidationError([f"entry {name!r}: reliable_beat option task_elsewhere="
                                    f"{rb['task_elsewhere']!r}: give True or False"])
    object.__setattr__(definition, "_task_elsewhere", bool(rb.get("task_elsewhere")))
    return definition


def is_task_elsewhere(definition: EntryDefinition) -> bool:
    """The entry says its task is registered only by workers elsewhere (``task_elsewhere``)."""
    return bool(getattr(definition, "_task_elsewhere", False))


def definitions_from_beat_schedule(
    beat_schedule: Mapping[str, Any],
    *,
    default_timezone: str,
    settings: Settings,
    now: datetime,
    is_idempotent: Callable[[str], bool | None] | None = None,
    task_function: Callable[[str], Callable[..., Any] | None] | None = None,
) -> list[EntryDefinition]:
    """Validate every ``beat_schedule`` item; all problems of all entries in one error.

    Raises:
        EntryValidationError: lists every problem, each naming its entry.
    """
    problems: list[str] = []
    out: list[EntryDefinition] = []
    for name, raw in beat_schedule.items():
        try:
            out.append(
                definition_from_celery(
                    name, raw, default_timezone=default_timezone, settings=settings, now=now,
                    is_idempotent=is_idempotent, task_function=task_function,
                )
            )
        except EntryValidationError as exc:
            problems.extend(exc.problems)
    if problems:
        raise EntryValidationError(problems)
    return out
