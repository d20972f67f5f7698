"""Structured log events: a stable event name plus key=value fields.

Every event is one log record whose message starts with the event name followed by
``key=value`` pairs, and whose ``extra`` carries the same fields (``record.event``,
``record.entry``, ``record.fire_at``, ``record.key``, ``record.fence_token`` ...), so a JSON
log formatter can emit them as fields. Event names are part of the public interface: they do
not change without a note in the changelog. The list is in ``docs/reference.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RepeatedLog", "event"]

#: Seconds between two lines of one repeated outage message (see :class:`RepeatedLog`).
REPEAT_EVERY_SECONDS = 30.0


class RepeatedLog:
    """One recurring message (an outage retried every second) logged first, then every 30 s.

    The first call logs at once; calls within ``every_seconds`` of the last line logged are
    counted, not logged; the next line logged after that says how many were suppressed
    (``... [N similar suppressed in S s]``). :meth:`reset` (the condition cleared: the
    database is back) makes the next occurrence log at once again. Nothing is lost: every
    line still logged carries the latest values, and the count says how often it happened.

    Args:
        logger: where to log.
        every_seconds: minimum seconds between two lines (default 30).
        clock: a monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(self, logger: logging.Logger, every_seconds: float = REPEAT_EVERY_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.every_seconds = every_seconds
        self._clock = clock
        self._last: float | None = None
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless a line was logged in the last interval.

        Returns:
            True when a line was logged, False when it was counted as suppressed.
        """
        now = self._clock()
        if self._last is not None and now - self._last < self.every_seconds:
            self._suppressed += 1
            return False
        if self._suppressed:
            msg += " [%d similar suppressed in %.0f s]"
            args = (*args, self._suppressed, now - self._last if self._last is not None else 0.0)
        self.logger.log(level, msg, *args)
        self._last = now
        self._suppressed = 0
        return True

    def reset(self) -> None:
        """The condition cleared: the next occurrence is logged at once."""
        self._last = None
        self._suppressed = 0


def event(logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` (values are rendered with ``str``; None is omitted).

    Args:
        logger: where to log.
        level: a :mod:`logging` level.
        name: the stable event name, e.g. ``slot.fired``.
        **fields: entry, fire_at, key, fence_token, count, error, ...
    """
    if not logger.isEnabledFor(level):
        return
    shown = {k: v for k, v in fields.items() if v is not None}
    text = " ".join(f"{k}={v}" for k, v in shown.items())
    logger.log(level, "%s %s", name, text,
               extra={"event": name, "event_fields": tuple(shown), **shown})
