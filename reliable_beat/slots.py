"""Slot helpers: the whole-second UTC instant an entry is due, and its idempotency key.

A *slot* (fire time) is the nominal instant an entry is due, never the send time.
Slots are tz-aware UTC :class:`~datetime.datetime` values with ``microsecond == 0``.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

__all__ = [
    "SlotText", "format_fire_at", "has_slot_key_form", "idempotency_key", "parse_fire_at",
    "truncate",
]

#: The form of a scheduled slot's key (:func:`idempotency_key`): ``<entry>@<UTC instant>Z``.
SLOT_KEY_FORM = re.compile(r"@\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")


def truncate(at: datetime) -> datetime:
    """Return ``at`` as a UTC instant truncated to whole seconds.

    Args:
        at: a tz-aware datetime in any offset or zone.

    Returns:
        The same instant in :data:`datetime.timezone.utc`, with ``microsecond=0``
        (truncated toward the past, never rounded).

    Raises:
        ValueError: ``at`` is naive (no ``tzinfo`` or ``utcoffset()`` is None);
            naive datetimes are rejected, never guessed.
    """
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(
            f"naive datetime {at.isoformat()!r}: reliable_beat needs tz-aware datetimes "
            "(e.g. datetime.now(timezone.utc)); naive values are never guessed"
        )
    return at.astimezone(timezone.utc).replace(microsecond=0)


def format_fire_at(fire_at: datetime) -> str:
    """Format a slot as ISO 8601 UTC with a ``Z`` suffix, e.g. ``"2026-01-10T10:05:00Z"``.

    Args:
        fire_at: tz-aware instant; truncated to whole seconds first.

    Raises:
        ValueError: ``fire_at`` is naive.
    """
    return f"{truncate(fire_at):%Y-%m-%dT%H:%M:%SZ}"


def parse_fire_at(value: object, what: str = "fire_at") -> datetime | None:
    """Read a trigger's instant (its fire time, its ``expires_at``) as a worker or publisher
    receives it: the one parser of the instants reliable_beat writes on the wire.

    The rule: ISO 8601 text, ``Z`` or a UTC offset (``+02:00``) giving the zone; **an
    instant without a zone is UTC** (never the host's local time). Every writer of a trigger
    writes :func:`format_fire_at`'s ``"2026-01-10T10:05:00Z"``, and the store keeps UTC, so
    a zone-less value can only be UTC that lost its ``Z`` on the way. A ``datetime`` is read
    the same way (a naive one is UTC). Not truncated: the instant is kept as given.

    Args:
        value: the text (or ``datetime``); None or ``""``: no instant.
        what: the value's name in the error (a header or option name).

    Returns:
        The instant as a tz-aware UTC datetime, or None.

    Raises:
        ValueError: ``value`` is not an ISO 8601 instant; the message names ``what`` and the
            value.
    """
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        text = value[:-1] + "+00:00" if value[-1:] in ("Z", "z") else value
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{what}={value!r}: not an ISO 8601 instant; expected e.g. "
                             "'2026-01-10T10:05:00Z' (without a zone: UTC)") from None
    else:
        raise ValueError(f"{what}={value!r}: expected ISO 8601 text such as "
                         f"'2026-01-10T10:05:00Z', got {type(value).__name__}")
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        return parsed.replace(tzinfo=timezone.utc)
    try:
        return parsed.astimezone(timezone.utc)
    except OverflowError:  # e.g. 0001-01-01T00:00:00+05:00: before the first UTC instant
        raise ValueError(f"{what}={value!r}: out of the range of a UTC instant") from None


def idempotency_key(entry: str, fire_at: datetime) -> str:
    """Derive the idempotency key of an entry's slot: ``"<entry>@<fire_at ISO Z>"``.

    The key is stable across processes, restarts and time zones: the same entry
    name and the same instant (in any offset) always give the same key.

    Example:
        ``idempotency_key("report", datetime(2026, 1, 10, 10, 5, tzinfo=timezone.utc))``
        is ``"report@2026-01-10T10:05:00Z"``.

    Raises:
        ValueError: ``fire_at`` is naive.
    """
    return f"{entry}@{format_fire_at(fire_at)}"


def has_slot_key_form(key: str) -> bool:
    """Whether ``key`` has the form of a scheduled slot's key (``"<entry>@<instant>Z"``).

    That form is reserved for the slots a beat fires: a run under it takes the slot's place.
    """
    return SLOT_KEY_FORM.search(key) is not None


class SlotText:
    """:func:`format_fire_at` and :func:`idempotency_key` remembered per instant, for a batch.

    A beat's tick formats the same few slots for hundreds of entries (a herd shares one
    slot): each distinct instant is formatted once. Only instants whose ``tzinfo`` is
    :data:`datetime.timezone.utc` are remembered (two datetimes of one zone that differ only
    in ``fold`` compare equal, so a zone-aware instant is always formatted afresh); the text
    is exactly what the functions above return. Bounded by the instants one batch holds:
    make one per batch, not one per process.
    """

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: dict[datetime, str] = {}

    def fire_at(self, fire_at: datetime) -> str:
        """:func:`format_fire_at` of ``fire_at``.

        Raises:
            ValueError: ``fire_at`` is naive.
        """
        if fire_at.tzinfo is not timezone.utc:
            return format_fire_at(fire_at)
        text = self._memo.get(fire_at)
        if text is None:
            text = self._memo[fire_at] = format_fire_at(fire_at)
        return text

    def key(self, entry: str, fire_at: datetime) -> str:
        """:func:`idempotency_key` of ``(entry, fire_at)``.

        Raises:
            ValueError: ``fire_at`` is naive.
        """
        return f"{entry}@{self.fire_at(fire_at)}"
