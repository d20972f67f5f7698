"""The beat's per-batch memos give exactly what the functions they stand for give.

Invariant 1 (slot identity): the idempotency key and the trigger's headers of a slot are the
same whether formatted afresh or remembered for a batch (:class:`reliable_beat.slots.
SlotText`), and the task id is the same ``uuid5`` (:func:`reliable_beat.beat.task_id_for`).
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reliable_beat.beat import task_id_for
from reliable_beat.db.types import INFINITY, NEG_INFINITY, infinity_text
from reliable_beat.messages import OutboxMessage
from reliable_beat.slots import SlotText, format_fire_at, idempotency_key
from reliable_beat.triggers import Trigger

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")

instants = st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
                        timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)),
                                                   BERLIN, ZoneInfo("America/New_York")]))


@given(name=st.text(min_size=1, max_size=40), at=instants)
def test_slot_text_is_format_fire_at_and_idempotency_key(name: str, at: datetime) -> None:
    memo = SlotText()
    for _ in range(2):  # formatted, then remembered
        assert memo.fire_at(at) == format_fire_at(at)
        assert memo.key(name, at) == idempotency_key(name, at)


def test_slot_text_keeps_folds_apart() -> None:
    # 2026-10-25 02:30 happens twice in Berlin; the two compare equal within the zone
    first = datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN)
    second = first.replace(fold=1)
    assert first == second and format_fire_at(first) != format_fire_at(second)
    memo = SlotText()
    assert memo.key("e", first) == "e@2026-10-25T00:30:00Z"
    assert memo.key("e", second) == "e@2026-10-25T01:30:00Z"
    utc_first = first.astimezone(UTC)
    assert memo.key("e", utc_first) == "e@2026-10-25T00:30:00Z"
    assert memo.key("e", second.astimezone(UTC)) == "e@2026-10-25T01:30:00Z"


def test_slot_text_rejects_naive_instants_every_time() -> None:
    memo = SlotText()
    aware = datetime(2030, 1, 1, tzinfo=UTC)
    memo.key("e", aware)
    for _ in range(2):
        with pytest.raises(ValueError, match="naive"):
            memo.key("e", aware.replace(tzinfo=None))


@given(key=st.text(max_size=200))
def test_task_id_is_uuid5_of_the_key(key: str) -> None:
    try:
        expected = str(uuid.uuid5(uuid.NAMESPACE_URL, "reliable_beat:" + key))
    except UnicodeEncodeError:  # a lone surrogate: both refuse it
        with pytest.raises(UnicodeEncodeError):
            task_id_for(key)
        return
    assert task_id_for(key) == expected


@pytest.mark.parametrize("value", [
    INFINITY, NEG_INFINITY, INFINITY.replace(tzinfo=None), INFINITY.replace(tzinfo=BERLIN),
    NEG_INFINITY.replace(tzinfo=timezone(timedelta(hours=-3))),
])
def test_infinity_text_still_finds_both_ends(value: datetime) -> None:
    assert infinity_text(value) == ("infinity" if value.year == 9999 else "-infinity")


@pytest.mark.parametrize("value", [
    datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC),  # not datetime.max: an instant
    datetime(1, 1, 1, 0, 0, 1, tzinfo=UTC), datetime(2030, 1, 1, tzinfo=UTC), None, "x",
])
def test_infinity_text_leaves_instants_alone(value: object) -> None:
    assert infinity_text(value) is None


def test_fast_trigger_and_message_constructors_equal_init() -> None:
    """``Trigger.due`` and ``OutboxMessage.of_trigger`` (the beat's per-slot objects, made
    without the frozen dataclass's ``__init__``) equal what ``__init__`` makes, every field
    included: a field added to either class with a default must be added to them too."""
    at = datetime(2026, 12, 7, 5, 0, tzinfo=timezone.utc)
    payload = {"task": "t", "args": [], "kwargs": {}}
    for tp in (None, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"):
        fast = Trigger.due(7, "e@k", payload, at, tp)
        assert fast == Trigger(None, 7, "e@k", payload, at, traceparent=tp)
        assert vars(fast) == {f.name: getattr(fast, f.name) for f in dataclasses.fields(Trigger)}
        assert fast.id == -7
        msg = OutboxMessage.of_trigger(-7, "trigger:e@k", "celery", payload, 7, tp)
        assert msg == OutboxMessage(id=-7, message_id="trigger:e@k", destination="celery",
                                    payload=payload, run_id=7, traceparent=tp)
        assert vars(msg) == {f.name: getattr(msg, f.name)
                             for f in dataclasses.fields(OutboxMessage)}
        assert hash(msg.id) == hash(-7) and msg.headers == {}
