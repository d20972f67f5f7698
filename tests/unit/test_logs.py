"""Structured log events carry a stable name and their fields, in the text and the record."""

from __future__ import annotations

import logging

import pytest

from reliable_beat.logs import event


def test_event_fields_in_message_and_record(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("reliable_beat.test")
    with caplog.at_level(logging.INFO, logger="reliable_beat.test"):
        event(log, logging.INFO, "slot.fired", entry="pay", fire_at="2026-01-10T10:05:00Z",
              key="pay@2026-01-10T10:05:00Z", fence_token=None)
        event(log, logging.DEBUG, "not.shown", entry="x")
    (record,) = caplog.records
    assert record.getMessage() == (
        "slot.fired entry=pay fire_at=2026-01-10T10:05:00Z key=pay@2026-01-10T10:05:00Z"
    )
    assert record.event == "slot.fired"  # type: ignore[attr-defined]
    assert record.entry == "pay"  # type: ignore[attr-defined]
    assert not hasattr(record, "fence_token")


def test_stale_fence_token_survives_pickling() -> None:
    import pickle

    from reliable_beat.errors import StaleFenceToken

    err = pickle.loads(pickle.dumps(StaleFenceToken("k@2026-01-01T00:00:00Z", 3)))
    assert type(err) is StaleFenceToken
    assert (err.idempotency_key, err.fence_token) == ("k@2026-01-01T00:00:00Z", 3)


def test_an_events_idempotency_key_is_shown_whole_and_its_error_redacted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Operators match a ``slot.fired`` line to its run by the key: the redaction of free
    text (``key=...`` is a credential there) must not mask our own identifier field."""
    from reliable_beat.redaction import get_logger

    log = get_logger("reliable_beat.test_events")
    with caplog.at_level(logging.INFO, logger="reliable_beat.test_events"):
        event(log, logging.INFO, "slot.fired", entry="pay", key="pay@2026-01-10T10:05:00Z",
              error="refused: api_key=sk_live_123")
    (record,) = caplog.records
    text = record.getMessage()
    assert "key=pay@2026-01-10T10:05:00Z" in text
    assert "sk_live_123" not in text and text.startswith("slot.fired entry=pay ")
