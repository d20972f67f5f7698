"""Settings: unknown keys and wrong types are errors naming the key; defaults stand."""

from __future__ import annotations

import pytest

from reliable_beat.errors import ConfigurationError
from reliable_beat.settings import Settings


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="reliable_beat_lease_seconds") as info:
        Settings.from_mapping({"reliable_beat_lease_secs": 5})
    assert "reliable_beat_lease_secs" in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("reliable_beat_lease_seconds", "abc"), ("reliable_beat_misfire_grace_seconds", -1),
     ("reliable_beat_batch_size", 0), ("reliable_beat_batch_size", 2.5),
     ("reliable_beat_run_migrations", "yes"), ("reliable_beat_misfire_policy", "sometimes"),
     ("reliable_beat_retry_base_seconds", 0), ("reliable_beat_claim_ahead_seconds", -0.5),
     ("reliable_beat_claim_ahead_seconds", 61)],
)
def test_bad_values_name_the_setting(key: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=key):
        Settings.from_mapping({key: value})


def test_defaults_and_other_keys_ignored() -> None:
    s = Settings.from_mapping({"broker_url": "memory://", "reliable_beat_batch_size": 7})
    assert s.batch_size == 7 and s.lease_seconds == 60.0 and s.metrics_port is None


def test_claim_ahead_default_and_off() -> None:
    assert Settings.from_mapping({}).claim_ahead_seconds == 0.5
    assert Settings.from_mapping({"reliable_beat_claim_ahead_seconds": 0}).claim_ahead_seconds == 0
