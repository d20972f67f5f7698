"""The trigger payload of a Dramatiq trigger row is framework-neutral (no Celery message
fields the Dramatiq publisher has to dig its run out of), and rows of both shapes stay
readable: during a rolling deploy old and new beats and relays share one database.

* new rows: ``{"task", "args", "kwargs", "message_id", "reliable_beat": {key, entry,
  fire_at, trigger, store}, "options", "expires_at"}`` plus, for readers of the previous
  version, ``task_id`` and the four ``reliable_beat_*`` identity headers;
* old rows (written before): the Celery shape, identity in ``headers``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from reliable_beat.beat import build_trigger_payload, task_id_for, trigger_identity
from reliable_beat.rows import check_outbox
from reliable_beat.settings import Settings

pytest.importorskip("dramatiq")

SLOT = datetime(2026, 12, 1, 2, 0, tzinfo=timezone.utc)
KEY = "nightly@2026-12-01T02:00:00Z"

#: A ``dramatiq`` trigger row's payload as the previous version wrote it (Celery-shaped).
OLD_ROW = {
    "task": "kind_tracked", "args": [1], "kwargs": {"a": 2},
    "task_id": task_id_for(KEY),
    "headers": {"reliable_beat_key": KEY, "reliable_beat_entry": "nightly",
                "reliable_beat_fire_at": "2026-12-01T02:00:00Z",
                "reliable_beat_trigger": "schedule", "reliable_beat_store": "s-1"},
    "options": {}, "expires_at": "2026-12-01T02:00:30Z",
}


def _new(**options: Any) -> dict[str, Any]:
    return build_trigger_payload(
        task="kind_tracked", args=[1], kwargs={"a": 2}, options={"expires": 30, **options},
        key=KEY, entry="nightly", fire_at=SLOT, trigger="schedule", store_id="s-1",
        destination="dramatiq")


def test_a_dramatiq_trigger_payload_is_neutral() -> None:
    p = _new(queue="kinds")
    assert p["message_id"] == task_id_for(KEY)
    assert p["reliable_beat"] == {"key": KEY, "entry": "nightly",
                                  "fire_at": "2026-12-01T02:00:00Z", "trigger": "schedule",
                                  "store": "s-1"}
    assert p["options"] == {"queue": "kinds"} and p["expires_at"] == "2026-12-01T02:00:30Z"
    # the Celery-named fields are only the previous version's copy of the identity
    assert p["task_id"] == p["message_id"]
    assert p["headers"] == {"reliable_beat_key": KEY, "reliable_beat_entry": "nightly",
                            "reliable_beat_fire_at": "2026-12-01T02:00:00Z",
                            "reliable_beat_trigger": "schedule"}
    # a celery row is unchanged: a Celery message description
    c = build_trigger_payload(task="t", args=[], kwargs={}, options={"headers": {"x": "1"}},
                              key=KEY, entry="nightly", fire_at=SLOT, trigger="schedule")
    assert set(c) == {"task", "args", "kwargs", "task_id", "headers", "options", "expires_at"}
    assert c["headers"]["x"] == "1" and c["headers"]["reliable_beat_key"] == KEY


def test_trigger_identity_reads_both_shapes() -> None:
    new = trigger_identity(_new())
    old = trigger_identity(OLD_ROW)
    assert new == old == {"key": KEY, "entry": "nightly", "fire_at": "2026-12-01T02:00:00Z",
                          "trigger": "schedule", "store": "s-1"}
    assert trigger_identity({"task": "t"})["key"] is None


def test_old_and_new_rows_make_the_same_dramatiq_message() -> None:
    from reliable_beat.dramatiq import OPTION, message_for_trigger
    from tests.apps.dq_kind_app import broker

    new = message_for_trigger(broker, _new())
    old = message_for_trigger(broker, OLD_ROW)
    for m in (new, old):
        assert m.message_id == task_id_for(KEY)
        assert m.queue_name == "kinds" and m.actor_name == "kind_tracked"
        assert m.args == (1,) and m.kwargs == {"a": 2}
        assert m.options[OPTION] == {"key": KEY, "entry": "nightly",
                                     "fire_at": "2026-12-01T02:00:00Z", "trigger": "schedule"}
        assert m.options["max_age"] == 30_000
        assert m.message_timestamp == int(SLOT.timestamp() * 1000)


def test_rows_of_both_shapes_pass_the_claim_check_a_bad_identity_does_not() -> None:
    def row(payload: Any) -> dict[str, Any]:
        return {"message_id": "trigger:" + KEY, "destination": "dramatiq", "headers": {},
                "ordering_key": None, "run_id": 1, "attempts": 0, "available_at": SLOT,
                "created_at": SLOT, "payload": payload}

    assert check_outbox(row(_new())) == []
    assert check_outbox(row(OLD_ROW)) == []
    bad = dict(_new(), reliable_beat={"entry": "nightly"})
    assert any(p.startswith("payload.reliable_beat=") for p in check_outbox(row(bad)))
    assert any(p.startswith("payload.message_id=")
               for p in check_outbox(row(dict(_new(), message_id=5))))


@pytest.mark.parametrize("option", ["priority", "routing_key", "headers"])
def test_a_celery_only_option_on_a_dramatiq_entry_is_refused(option: str) -> None:
    from reliable_beat.dramatiq import definitions
    from reliable_beat.errors import ConfigurationError
    from tests.apps.dq_kind_app import broker

    value: Any = {"x": "1"} if option == "headers" else (5 if option == "priority" else "rk")
    schedule = {"nightly": {"actor": "kind_plain", "schedule": "0 2 * * *",
                            "options": {option: value}},
                "fine": {"actor": "kind_plain", "schedule": "0 3 * * *",
                         "options": {"queue": "kinds", "expires": 10}}}
    with pytest.raises(ConfigurationError) as err:
        definitions(broker, schedule, now=SLOT, settings=Settings())
    text = str(err.value)
    assert f"nightly: publish option(s) '{option}' are Celery message fields" in text
    assert "fine" not in text
