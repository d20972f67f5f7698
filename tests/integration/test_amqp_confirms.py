"""Publisher confirms on a real RabbitMQ node: "published" means the broker has the message.

:func:`publish_celery_batch` (the beat's fast path, the relay's ``celery`` handler, the
re-dispatcher) publishes a batch on a confirm-mode channel and awaits the broker's confirms
once per batch. A row counts as sent only when its message was acked: a nacked message
(here: a queue at ``x-max-length`` with ``x-overflow=reject-publish``, which RabbitMQ nacks)
or an unconfirmed one (the node died) leaves the row pending for the relay.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Queue

from harness.servers import RabbitMQServer
from reliable_beat.handlers import (
    DestinationUnavailableError,
    celery_task_id,
    publish_celery_batch,
)
from reliable_beat.outbox import OutboxMessage

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


def _messages(n: int, queue: str, start: int = 1) -> list[OutboxMessage]:
    return [
        OutboxMessage(id=i, message_id=f"trigger:e{i}@2030", destination="celery",
                      payload={"task": "rb.echo", "args": [i], "options": {"queue": queue}})
        for i in range(start, start + n)
    ]


def _depth(url: str, queue: str) -> int:
    with Connection(url) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def _drain(url: str, queue: str) -> list[dict[str, Any]]:
    """Every message of ``queue`` (headers), acked."""
    out = []
    with Connection(url) as conn:
        channel = conn.default_channel
        while (msg := channel.basic_get(queue)) is not None:
            out.append(dict(msg.headers))
            channel.basic_ack(msg.delivery_tag)
    return out


@pytest.fixture
def app(amqp_url: str, test_queue: str) -> Iterator[Celery]:
    app = Celery("confirms", broker=amqp_url)
    app.conf.task_queues = [Queue(test_queue)]
    app.conf.broker_connection_retry_on_startup = False
    yield app
    app.close()


def test_batch_counts_published_only_what_the_broker_confirmed(
        app: Celery, amqp_url: str, test_queue: str) -> None:
    messages = _messages(50, test_queue)
    results = publish_celery_batch(app, messages, now=NOW)
    assert [mid for mid, _ in results] == [m.id for m in messages]
    assert [err for _, err in results] == [None] * 50
    got = _drain(amqp_url, test_queue)
    assert sorted(h["id"] for h in got) == sorted(celery_task_id(m) for m in messages)


def test_nacked_publishes_stay_pending(app: Celery, amqp_url: str, test_queue: str) -> None:
    """RabbitMQ nacks publishes to a full ``reject-publish`` queue: those rows must not be
    reported published (before confirms, all five were "sent" and two were lost)."""
    with Connection(amqp_url) as conn:
        Queue(test_queue, queue_arguments={"x-max-length": 3, "x-overflow": "reject-publish"},
              channel=conn.default_channel).declare()
    app.conf.task_queues = [Queue(test_queue, queue_arguments={
        "x-max-length": 3, "x-overflow": "reject-publish"})]
    results = publish_celery_batch(app, _messages(5, test_queue), now=NOW)
    errors = [err for _, err in results]
    assert errors[:3] == [None, None, None]
    assert all(isinstance(e, DestinationUnavailableError) for e in errors[3:]), errors
    assert "nacked" in str(errors[3])
    assert _depth(amqp_url, test_queue) == 3
    # the queue has room again: the relay's retry of the pending rows goes through
    _drain(amqp_url, test_queue)
    retry = publish_celery_batch(app, _messages(2, test_queue, start=4), now=NOW)
    assert [err for _, err in retry] == [None, None]


def test_confirmed_messages_survive_a_broker_crash(
        app: Celery, amqp_url: str, test_queue: str,
        rabbitmq_node: RabbitMQServer | None) -> None:
    """Durable queue + persistent messages + confirm: a SIGKILLed node still has every
    message it confirmed; while it is down a batch fails fast as unavailable (rows pending)
    and goes through once it is back."""
    if rabbitmq_node is None:
        pytest.skip("RELIABLE_BEAT_TEST_AMQP_URL: cannot restart an outside broker")
    first = _messages(200, test_queue)
    assert all(err is None for _, err in publish_celery_batch(app, first, now=NOW))
    rabbitmq_node.stop(kill=True)
    try:
        started = time.monotonic()
        down = publish_celery_batch(app, _messages(3, test_queue, start=201), now=NOW)
        assert all(isinstance(e, DestinationUnavailableError) for _, e in down), down
        assert time.monotonic() - started < 30
    finally:
        rabbitmq_node.start()
    second = _messages(3, test_queue, start=201)
    again = publish_celery_batch(app, second, now=NOW)
    assert [err for _, err in again] == [None] * 3
    ids = [h["id"] for h in _drain(amqp_url, test_queue)]
    assert sorted(ids) == sorted(celery_task_id(m) for m in first + second)
