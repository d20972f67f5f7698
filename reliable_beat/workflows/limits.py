"""Limits of the workflow API, checked where a value enters, before anything is written.

* **Size**: every value the engine stores and reads back on each replay (a workflow's
  arguments at ``start`` and ``continue_as_new``, a signal's payload, the arguments of an
  activity, a compensation, a child workflow, a step or a transaction, and the result of a
  step, a transaction or the workflow) is at most
  :data:`~reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES` (1 MiB) as JSON: the limit of the
  outbox message an activity travels in, so one limit holds for all of them.
* **Timers**: ``ctx.sleep(duration)`` and ``ctx.wait_signal(timeout=...)`` take a
  ``timedelta`` from 0 to :data:`MAX_TIMER` (100 years). ``ctx.sleep_until`` takes any
  tz-aware ``datetime``.

A refused call raises :class:`~reliable_beat.workflows.errors.WorkflowValueError` (a
``ValueError``) naming the argument, its value or size, and the limit. Inside a workflow
the check runs before the call takes a position in the history, and depends only on the
arguments, so a replay refuses it again at the same place. A call the history already
records (written before these limits, or by code that had other limits) replays as it was.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from reliable_beat.values import DEFAULT_MAX_PAYLOAD_BYTES, json_size
from reliable_beat.workflows.errors import WorkflowValueError

__all__ = ["MAX_TIMER", "check_duration", "check_size", "over_size", "size_error"]

#: Longest ``ctx.sleep`` duration and ``ctx.wait_signal`` timeout: 100 years of 365 days
#: (the instant it ends must fit a ``datetime`` and every store's timestamp column).
MAX_TIMER = timedelta(days=36_500)


def over_size(*values: Any) -> int | None:
    """The JSON size of ``values`` together, in bytes, if it is over the limit; else None."""
    size = sum(json_size(v) for v in values)
    return size if size > DEFAULT_MAX_PAYLOAD_BYTES else None


def size_error(what: str, size: int) -> WorkflowValueError:
    """The error for ``what`` (e.g. ``"signal 'go' payload"``) of ``size`` bytes."""
    return WorkflowValueError(
        f"{what}: {size} bytes as JSON, over the limit of {DEFAULT_MAX_PAYLOAD_BYTES} bytes "
        "(reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES, the limit of activity messages "
        "too): the workflow engine stores this and reads it back on every replay; store the "
        "data elsewhere (a table, an object store) and pass a reference (an id, a key)"
    )


def check_size(what: str, *values: Any) -> None:
    """Refuse ``values`` (JSON, as stored) whose size together is over the limit.

    Raises:
        WorkflowValueError: over :data:`~reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES`.
    """
    size = over_size(*values)
    if size is not None:
        raise size_error(what, size)


def check_duration(what: str, value: Any) -> timedelta:
    """``value`` if it is a ``timedelta`` from 0 to :data:`MAX_TIMER`.

    Args:
        what: the argument as the user wrote it, e.g. ``"ctx.sleep duration"``.

    Raises:
        WorkflowValueError: not a ``timedelta``, negative, or longer than ``MAX_TIMER``.
    """
    if not isinstance(value, timedelta):
        raise WorkflowValueError(
            f"{what} must be a datetime.timedelta from 0 to {MAX_TIMER.days} days (100 "
            f"years), got {value!r} ({type(value).__name__}); e.g. timedelta(seconds=30)")
    if value < timedelta(0) or value > MAX_TIMER:
        seconds = value.total_seconds()
        shown = f"{int(seconds)} s" if seconds.is_integer() else f"{seconds} s"
        raise WorkflowValueError(
            f"{what} must be from 0 to {MAX_TIMER.days} days (100 years), got {shown}"
            + ("; a negative wait has no meaning: timedelta(0) polls without waiting"
               if value < timedelta(0) else
               f" ({value}), most likely a unit mistake; to wait for a signal without a "
               "deadline, call ctx.wait_signal(name) without a timeout"))
    return value
