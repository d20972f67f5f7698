"""Structured log events: a stable event name plus key=value fields.

Every event is one log record whose message starts with the event name followed by
``key=value`` pairs, and whose ``extra`` carries the same fields (``record.event``,
``record.entry``, ``record.fire_at``, ``record.key``, ``record.fence_token`` ...), so a JSON
log formatter can emit them as fields. Event names are part of the public interface: they do
not change without a note in the changelog. The list is in ``docs/reference.md``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["event"]


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
    logger.log(level, "%s %s", name, text, extra={"event": name, **shown})
