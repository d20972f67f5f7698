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


def test_broker_killed_mid_batch_keeps_every_confirmed_message(
        app: Celery, amqp_url: str, test_queue: str,
        rabbitmq_node: RabbitMQServer | None) -> None:
    """The node SIGKILLed while a large batch is being published: what the batch reports
    published is exactly what the broker confirmed, and all of it is there after the
    restart; the rest is reported unavailable (rows stay pending), never "sent" and lost."""
    import threading

    if rabbitmq_node is None:
        pytest.skip("RELIABLE_BEAT_TEST_AMQP_URL: cannot restart an outside broker")
    messages = _messages(5000, test_queue)
    with app.producer_or_acquire() as producer:  # declared and connected before the timing
        producer.channel.queue_declare(test_queue, durable=True, auto_delete=False)
    results: list[Any] = []
    publisher = threading.Thread(
        target=lambda: results.extend(publish_celery_batch(app, messages, now=NOW)))
    publisher.start()
    # the batch is built first, then written back to back: kill once the writes arrive
    deadline = time.monotonic() + 120
    while _depth(amqp_url, test_queue) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    rabbitmq_node.stop(kill=True)
    publisher.join(60)
    assert not publisher.is_alive()
    rabbitmq_node.start()
    published = {celery_task_id(m) for m, (_, err) in zip(messages, results, strict=True)
                 if err is None}
    failed = [err for _, err in results if err is not None]
    assert failed, "the kill came too late to hit the batch; nothing was tested"
    assert all(isinstance(e, DestinationUnavailableError) for e in failed)
    there = {h["id"] for h in _drain(amqp_url, test_queue)}
    assert published <= there, f"{len(published - there)} reported published but lost"
    print(f"\n[mid-batch kill] {len(published)} confirmed and kept, {len(failed)} left pending, "
          f"{len(there - published)} unconfirmed but kept (re-published later, same task id)")


def test_priority_queue_delivers_higher_priority_triggers_first(
        app: Celery, amqp_url: str, test_queue: str) -> None:
    app.conf.task_queues = [Queue(test_queue, queue_arguments={"x-max-priority": 9})]
    messages = [
        OutboxMessage(id=i, message_id=f"trigger:p{i}@2030", destination="celery",
                      payload={"task": "rb.echo", "args": [i],
                               "options": {"queue": test_queue, "priority": prio}})
        for i, prio in enumerate([1, 9, 5, 1, 9], start=1)
    ]
    assert all(err is None for _, err in publish_celery_batch(app, messages, now=NOW))
    order = [h["id"] for h in _drain(amqp_url, test_queue)]
    by_id = {celery_task_id(m): m.payload["options"]["priority"] for m in messages}
    assert [by_id[i] for i in order] == [9, 9, 5, 1, 1]


def test_quorum_queue_confirms_and_counts_redeliveries(
        app: Celery, amqp_url: str, test_queue: str) -> None:
    """A quorum queue: the batch is confirmed (by a quorum of its one member here), and a
    delivery given back unacknowledged comes again with ``x-delivery-count``: the trigger
    is the same message (same task id), which the run's key deduplicates."""
    app.conf.task_queues = [Queue(test_queue, queue_arguments={"x-queue-type": "quorum"})]
    messages = _messages(3, test_queue)
    assert all(err is None for _, err in publish_celery_batch(app, messages, now=NOW))
    with Connection(amqp_url) as conn:
        channel = conn.channel()
        first = channel.basic_get(test_queue, no_ack=False)
        assert first is not None
        channel.close()  # a consumer that died holding it: the broker gives it back
    got = []
    with Connection(amqp_url) as conn:
        channel = conn.default_channel
        while (msg := channel.basic_get(test_queue)) is not None:
            got.append((msg.headers["id"], msg.headers.get("x-delivery-count")))
            channel.basic_ack(msg.delivery_tag)
    counts = dict(got)
    assert sorted(counts) == sorted(celery_task_id(m) for m in messages)
    assert counts[first.headers["id"]] == 1
    assert sorted(v or 0 for v in counts.values()) == [0, 0, 1]


def test_a_refused_message_fails_alone_and_the_rest_are_confirmed(
        app: Celery, amqp_url: str, test_queue: str) -> None:
    """RabbitMQ refuses one message's queue declaration (``PRECONDITION_FAILED``: the queue
    exists with other arguments) and closes the batch's channel: the batch is published
    again one message at a time, each confirmed, so only the culprit fails."""
    bad = f"{test_queue}-bad"
    with Connection(amqp_url) as conn:  # exists with x-max-length; Celery declares it without
        Queue(bad, queue_arguments={"x-max-length": 100}, channel=conn.default_channel).declare()
    app.conf.task_queues = [Queue(test_queue), Queue(bad)]
    messages = _messages(2, test_queue) + _messages(1, bad, start=3) + \
        _messages(2, test_queue, start=4)
    results = dict(publish_celery_batch(app, messages, now=NOW))
    assert [results[i] is None for i in (1, 2, 4, 5)] == [True] * 4, results
    assert results[3] is not None and "PRECONDITION_FAILED" in repr(results[3]), results
    got = [h["id"] for h in _drain(amqp_url, test_queue)]
    want = {celery_task_id(m) for m in messages if m.id != 3}
    assert set(got) == want  # the batch's first try may have put some there already
    with Connection(amqp_url) as conn:
        conn.default_channel.queue_delete(bad)


def _kombu_rows(routing_keys: list[str]) -> list[OutboxMessage]:
    return [OutboxMessage(id=i, message_id=f"kombu:{i}", destination="kombu",
                          payload={"exchange": "", "routing_key": rk, "body": {"n": i}})
            for i, rk in enumerate(routing_keys, start=1)]


def test_kombu_destination_is_confirmed_and_unroutable_messages_fail(
        amqp_url: str, test_queue: str) -> None:
    """The raw ``kombu`` destination on RabbitMQ: confirmed per batch, and published
    mandatory, so a message no queue is bound for fails (instead of the broker confirming
    and dropping it) while the others are delivered."""
    from reliable_beat.errors import DeliveryError
    from reliable_beat.handlers import KombuHandler

    with Connection(amqp_url) as conn:
        conn.default_channel.queue_declare(test_queue, durable=True, auto_delete=False)
    rows = _kombu_rows([test_queue, f"{test_queue}-nobody", test_queue])
    results = KombuHandler(url=amqp_url).deliver_batch(rows)
    assert results[0] is None and results[2] is None, results
    assert isinstance(results[1], DeliveryError) and "unroutable" in str(results[1])
    assert not isinstance(results[1], DestinationUnavailableError)  # charged: a config error
    with Connection(amqp_url) as conn:
        channel = conn.default_channel
        ids = []
        while (msg := channel.basic_get(test_queue)) is not None:
            ids.append(msg.properties["message_id"])
            channel.basic_ack(msg.delivery_tag)
        channel.queue_delete(test_queue)
    assert ids == ["kombu:1", "kombu:3"]
