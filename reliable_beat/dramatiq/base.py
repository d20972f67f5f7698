"""The names every part of the Dramatiq adapter shares: the trigger destination, the message
option that carries a run's key, :class:`DeadLettered`, Dramatiq's broker-connection error and
the reading of an instant a message option carries.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from reliable_beat import slots

__all__ = ["OPTION", "OUTBOX_MESSAGE_OPTION", "TRIGGER_DESTINATION", "DeadLettered"]

#: The outbox destination of Dramatiq triggers (a member of beat.TRIGGER_DESTINATIONS).
TRIGGER_DESTINATION = "dramatiq"
#: The message option carrying ``{"key", "entry", "fire_at", "trigger"}``; survives retries.
OPTION = "reliable_beat"
#: The message option carrying an outbox row's stable message id (set by the relay's
#: ``dramatiq`` handler); an ``IdempotentActor`` message without a key runs under it.
OUTBOX_MESSAGE_OPTION = "reliable_beat_message_id"


class DeadLettered(Exception):
    """Raised after a dead letter was recorded: listed in ``throws``, so Dramatiq fails the
    message (no retry) and its broker keeps it in ``<queue>.XQ``."""


# the public path, as before the adapter was a package of modules (span events, tracebacks)
DeadLettered.__module__ = "reliable_beat.dramatiq"


def _parse_instant(value: Any, what: str = "fire_at") -> datetime | None:
    """A trigger's instant: :func:`reliable_beat.slots.parse_fire_at` (no zone: UTC)."""
    return slots.parse_fire_at(value, what)


def _broker_errors() -> tuple[type[BaseException], ...]:
    import dramatiq.errors as errors

    # dramatiq >= 2.1 renamed ConnectionError to BrokerConnectionError (the old name warns).
    if hasattr(errors, "BrokerConnectionError"):
        return (errors.BrokerConnectionError,)
    return (errors.ConnectionError,)  # pragma: no cover (dramatiq < 2.1)
