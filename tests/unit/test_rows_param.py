"""The one-parameter JSON of Beat.tick's PostgreSQL statements (beat._rows_param)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from reliable_beat.beat import _rows_param

UTC = timezone.utc
PLUS2 = timezone(timedelta(hours=2))


def test_instants_are_iso_8601_with_their_offset_and_other_values_unchanged() -> None:
    now = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
    slot = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
    rows = [
        {"k": "a", "created_at": now, "fire_at": slot, "args": [1], "reason": None},
        {"k": "b", "created_at": now, "fire_at": slot + timedelta(seconds=1), "args": [],
         "reason": "x"},
        {"k": "c", "created_at": now.astimezone(PLUS2), "fire_at": slot, "args": [],
         "reason": None, "payload": {"nested": now}},
    ]
    got = json.loads(_rows_param(rows))
    assert [r["fire_at"] for r in got] == [
        "2030-01-01T12:00:00+00:00", "2030-01-01T12:00:01+00:00", "2030-01-01T12:00:00+00:00"]
    assert got[0]["created_at"] == got[1]["created_at"] == "2030-01-01T12:00:00.123456+00:00"
    # the same instant in another offset: any spelling of that instant is right
    assert datetime.fromisoformat(got[2]["created_at"]) == now
    assert got[2]["payload"] == {"nested": "2030-01-01T12:00:00.123456+00:00"}
    assert [(r["k"], r["args"], r["reason"]) for r in got] == [
        ("a", [1], None), ("b", [], "x"), ("c", [], None)]


def test_naive_datetimes_are_rejected_at_any_depth() -> None:
    naive = datetime(2030, 1, 1)  # the point of the test
    with pytest.raises(ValueError, match="naive"):
        _rows_param([{"created_at": naive}])
    with pytest.raises(ValueError, match="naive"):
        _rows_param([{"payload": {"at": naive}}])
    aware = naive.replace(tzinfo=UTC)
    with pytest.raises(ValueError, match="naive"):  # not served from the memo of an aware one
        _rows_param([{"a": aware}, {"a": naive}])
