"""The shape of a row a pipeline reads: every column it uses, every JSON shape.

Each check returns one problem string per problem, naming the column and what is expected
(:func:`column_of` reads the column back); an empty list: the row is usable.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from reliable_beat import schedules as sch
from reliable_beat.db.types import infinity_text
from reliable_beat.policies import catch_up_limit_problem
from reliable_beat.rows.decode import _short, raw_repr
from reliable_beat.triggers import TRIGGER_DESTINATIONS

__all__ = [
    "KNOWN_RUN_STATES",
    "MAX_SECONDS",
    "check_entry",
    "check_options",
    "check_outbox",
    "check_run_call",
    "check_run_row",
    "column_of",
    "entry_checker",
    "stored_config_hashes",
]

#: Largest duration (seconds, about 31 years) a row may hold; beyond it ``timedelta`` overflows.
MAX_SECONDS = 1e9
#: Every ``reliable_beat_runs.state`` this library writes. A run in any other state (a
#: typo by SQL, a newer version's state) is malformed: a claim that finds it dead-letters it
#: (reason ``malformed``) instead of running it or treating its slot as fired.
KNOWN_RUN_STATES = frozenset({
    "scheduled", "dispatched", "running", "retrying", "succeeded", "dead", "skipped",
    "buffered",
})
_MISFIRE = frozenset({"catch_up", "fire_once", "skip"})
_OVERLAP = frozenset({"allow", "skip", "buffer_one"})


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
    """The digests :meth:`reliable_beat.definitions.EntryDefinition.config_hash` gives for the
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


def column_of(problem: str) -> str:
    """The column a problem string names (its leading identifier)."""
    match = re.match(r"[A-Za-z_]+", problem)
    return match.group() if match else ""
