"""The message headers of an ``IdempotentTask`` trigger, and how the worker reads them.

A trigger (from a beat, ``entries trigger``, ``backfill``, ``delay_with_key``) carries its
idempotency key and, for a scheduled slot, its entry, instant and trigger kind as custom
Celery headers; an internal retry adds how many waits led to it. :func:`_header` reads one
wherever the Celery version put it; :func:`_parse_fire_at` reads the slot's instant.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from reliable_beat import slots, tracing

__all__ = [
    "ENTRY_HEADER", "FIRE_AT_HEADER", "KEY_HEADER", "OUTBOX_MESSAGE_HEADER", "TRIGGER_HEADER",
    "WAITS_HEADER",
]

KEY_HEADER = "reliable_beat_key"
#: An outbox row's stable message id, set by the relay on the message it publishes; an
#: ``IdempotentTask`` message without a key runs under it.
OUTBOX_MESSAGE_HEADER = "reliable_beat_message_id"
#: The form of a scheduled slot's key (:func:`reliable_beat.slots.idempotency_key`).
_SLOT_KEY = slots.SLOT_KEY_FORM
ENTRY_HEADER = "reliable_beat_entry"
FIRE_AT_HEADER = "reliable_beat_fire_at"
TRIGGER_HEADER = "reliable_beat_trigger"
#: Internal retries (busy lease, store unreachable) that led to a message; not a try.
WAITS_HEADER = "reliable_beat_waits"
# (traceparent: a retry's message stays in its slot's trace)
_HEADERS = (KEY_HEADER, ENTRY_HEADER, FIRE_AT_HEADER, TRIGGER_HEADER, tracing.TRACEPARENT)


def _header(request: Any, name: str) -> Any:
    """A custom message header, wherever this Celery version put it.

    Celery 5.3+ copies custom headers both onto ``request.headers`` (a dict of the
    non-Celery keys) and, through the request dict, as attributes (``request.<name>``);
    eager ``apply(headers=...)`` sets ``request.headers`` only. Both are read.
    """
    headers = getattr(request, "headers", None)
    if isinstance(headers, Mapping) and headers.get(name) is not None:
        return headers[name]
    return getattr(request, name, None)


def _parse_fire_at(value: Any) -> datetime | None:
    """The fire-time header: :func:`reliable_beat.slots.parse_fire_at` (no zone: UTC)."""
    return slots.parse_fire_at(value, FIRE_AT_HEADER)
