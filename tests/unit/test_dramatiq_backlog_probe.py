"""The Dramatiq queue-depth probe without a server: which queue a row goes to, a
``StubBroker``'s in-memory queue, and a broker class it cannot read (an unknown depth, so
the sweep re-sends as without the check; ``status`` says the depth is unknown)."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_beat.cli.status import _depth_note, stalled_queue_depths
from reliable_beat.outbox import OutboxMessage

dramatiq = pytest.importorskip("dramatiq")


def _msg(payload: dict[str, Any]) -> OutboxMessage:
    return OutboxMessage(id=1, message_id="m", destination="dramatiq", payload=payload)


def test_stub_broker_depths_and_queue_names() -> None:
    from dramatiq.brokers.stub import StubBroker

    from reliable_beat.dramatiq.backlog import queue_depths, trigger_queue

    broker = StubBroker()
    broker.emit_after("process_boot")

    def work() -> None:
        return None

    actor = dramatiq.actor(work, actor_name="probe_work", queue_name="q1", broker=broker)
    actor.send()
    actor.send()
    assert trigger_queue(broker, _msg({"task": "probe_work"})) == "q1"
    assert trigger_queue(broker, _msg({"task": "probe_work",
                                       "options": {"queue": "q2"}})) == "q2"
    assert trigger_queue(broker, _msg({"actor": "probe_work", "queue": "q3"})) == "q3"
    assert trigger_queue(broker, _msg({"task": "nobody"})) == "default"
    assert queue_depths(broker, [_msg({"task": "probe_work"}), _msg({"task": "nobody"})]) == [
        ("q1", 2), ("default", 0)]
    broker.close()


def test_a_broker_class_it_cannot_read_is_an_unknown_depth() -> None:
    from reliable_beat.dramatiq.backlog import queue_depths

    class OtherBroker:
        actors: dict[str, Any] = {}

    assert queue_depths(OtherBroker(), [_msg({"task": "t", "options": {"queue_name": "x"}})]
                        ) == [("x", None)]
    depths = stalled_queue_depths(lambda ms: queue_depths(OtherBroker(), ms),
                                  [("e1", _msg({"task": "t", "options": {"queue_name": "x"}}))])
    assert depths == [{"queue": "x", "ready": None, "entries": ["e1"], "error": None}]
    assert _depth_note(depths, ["e1"]) == " The broker cannot tell how deep queue x is."
    assert _depth_note(depths, ["other"]) == ""


def test_a_queue_name_with_whitespace_is_quoted_in_the_depth_note() -> None:
    """Fails on the old code: queue ' celery' was printed `Queue  celery holds 8 ready
    messages`, indistinguishable from queue 'celery'."""
    depths = [{"queue": " celery", "ready": 8, "entries": ["e1"], "error": None},
              {"queue": "celery", "ready": 0, "entries": ["e2"], "error": None}]
    assert _depth_note(depths, ["e1"]).startswith(" Queue ' celery' holds 8 ready messages")
    assert _depth_note(depths, ["e2"]).startswith(" Queue celery holds 0 ready messages")
