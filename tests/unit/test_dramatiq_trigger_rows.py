"""A malformed Dramatiq trigger row is caught like a Celery one (issue 14): ``check_outbox``
checks the trigger payload of every trigger destination, so the relay and the beat's sweep
dead-letter it as ``malformed`` at claim instead of retrying it up to the attempt budget
(seen in the Dramatiq fault run: ``KeyError: 'task'`` retried by the relay)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from reliable_beat.beat import TRIGGER_DESTINATIONS
from reliable_beat.rows import check_outbox

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)


def _row(destination: str, payload: Any) -> dict[str, Any]:
    return {"message_id": "trigger:x@1", "destination": destination, "headers": {},
            "ordering_key": None, "run_id": 1, "attempts": 0, "available_at": NOW,
            "created_at": NOW, "payload": payload}


@pytest.mark.parametrize("destination", sorted(TRIGGER_DESTINATIONS))
def test_a_trigger_payload_that_is_not_an_object_is_malformed(destination: str) -> None:
    problems = check_outbox(_row(destination, ["not", "a", "trigger"]))
    assert problems and f"a {destination} trigger needs a JSON object" in problems[0]


@pytest.mark.parametrize("destination", sorted(TRIGGER_DESTINATIONS))
def test_a_trigger_payload_without_a_task_is_malformed(destination: str) -> None:
    problems = check_outbox(_row(destination, {"args": [], "kwargs": {}}))
    assert any(p.startswith("payload.task") for p in problems), problems


def test_a_well_formed_dramatiq_trigger_passes() -> None:
    payload = {"task": "pay", "args": [], "kwargs": {}, "options": {}, "headers": {},
               "task_id": "abc", "expires_at": None}
    assert check_outbox(_row("dramatiq", payload)) == []


def test_other_destinations_payloads_are_their_handlers_business() -> None:
    assert check_outbox(_row("webhook", ["anything"])) == []


def test_rabbitmq_url_spells_the_default_vhost_for_pika() -> None:
    """kombu's ``//`` (vhost ``/``) is read by pika as the vhost ``""`` (refused by
    RabbitMQ); ``rabbitmq_url`` spells it ``%2F``."""
    pytest.importorskip("dramatiq")
    from reliable_beat.dramatiq import rabbitmq_url

    assert rabbitmq_url("amqp://guest:guest@h:5672//") == "amqp://guest:guest@h:5672/%2F"
    assert rabbitmq_url("amqp://u:p@h:5672/prod") == "amqp://u:p@h:5672/prod"
    assert rabbitmq_url("redis://h:6379/0") == "redis://h:6379/0"
    pika = pytest.importorskip("pika")
    assert pika.URLParameters(rabbitmq_url("amqp://g:g@h:1//")).virtual_host == "/"


def test_a_dramatiq_application_message_is_not_checked_as_a_trigger() -> None:
    """The ``dramatiq`` destination also carries ``{"actor", ...}`` application messages
    (``rb.outbox.add(tx, "dramatiq", {...})``): never dead-lettered as malformed triggers
    (a regression the RabbitMQ run of the relay test caught)."""
    assert check_outbox(_row("dramatiq", {"actor": "write_effect", "args": ["x"]})) == []
    # a celery row is always a trigger, whatever it holds
    assert check_outbox(_row("celery", {"actor": "write_effect"}))
