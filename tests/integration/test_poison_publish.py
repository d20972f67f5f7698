"""One poison Celery trigger fails alone (issue 12, "one bad row never stops the others").

A trigger whose queue name is a Redis key of another type makes Redis answer ``WRONGTYPE``
to its ``LPUSH``. In a pipelined batch that error used to fail the whole batch as "broker
unavailable", forever, without charging the poison row an attempt: all Celery delivery
stopped and the row never dead-lettered. Now the batch is published again message by
message, the culprit alone fails (an ordinary error: charged, backed off, dead-lettered
after ``outbox_max_attempts``) and the others are delivered. Real Redis, real store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Queue
from sqlalchemy import select, update

from reliable_beat import outbox as ob
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, outbox
from reliable_beat.handlers import CeleryHandler, DestinationUnavailableError, publish_celery_batch
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


def _message(i: int, queue: str) -> OutboxMessage:
    return OutboxMessage(id=i, message_id=f"trigger:e{i}@2030", destination="celery",
                         payload={"task": "rb.echo", "args": [i], "kwargs": {},
                                  "options": {"queue": queue}})


def _queued(url: str, queue: str) -> list[Any]:
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(raw)["headers"]["argsrepr"] for raw in client.lrange(queue, 0, -1)]
    finally:
        client.close()


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    client = redis.Redis.from_url(redis_url)
    client.set("poison", "a string, not a list")  # the queue name hits a key of another type
    client.close()
    app = Celery("poison", broker=redis_url)
    app.conf.task_queues = [Queue("celery"), Queue("poison")]
    yield app
    app.close()


def test_wrongtype_queue_fails_only_its_message(app: Celery, redis_url: str) -> None:
    messages = [_message(1, "celery"), _message(2, "poison"), _message(3, "celery")]
    results = dict(publish_celery_batch(app, messages, now=NOW))
    assert results[1] is None and results[3] is None
    err = results[2]
    assert err is not None and not isinstance(err, DestinationUnavailableError)
    assert "WRONGTYPE" in repr(err)
    assert sorted(_queued(redis_url, "celery")) == ["[1]", "[3]"]


def test_relay_dead_letters_the_poison_trigger_and_serves_the_rest(
    app: Celery, redis_url: str, sqlite_store: Store
) -> None:
    store = sqlite_store
    with store.begin() as conn:
        for i in range(6):
            queue = "poison" if i == 2 else "celery"
            ob.add(conn, "celery", {"task": "rb.echo", "args": [i], "kwargs": {},
                                    "options": {"queue": queue}}, key=f"trigger:e{i}")
    settings = Settings(outbox_max_attempts=3, outbox_retry_base_seconds=0.01,
                        outbox_retry_cap_seconds=0.01)
    relay = Relay(store, app, handlers={"celery": CeleryHandler(app)}, settings=settings)
    for _ in range(10):
        relay.run_once()
        with store.begin() as conn:  # no waiting for the backoff in a test
            conn.execute(update(outbox).where(outbox.c.state == "pending")
                         .values(available_at=datetime(2000, 1, 1, tzinfo=timezone.utc)))
    with store.engine.connect() as conn:
        states = dict(conn.execute(select(outbox.c.message_id, outbox.c.state)).all())
        dead = conn.execute(select(dead_letters.c.key, dead_letters.c.reason,
                                   dead_letters.c.attempts, dead_letters.c.error)).all()
    assert states == {f"trigger:e{i}": ("dead" if i == 2 else "sent") for i in range(6)}
    assert [(d.key, d.reason, d.attempts) for d in dead] == [("trigger:e2", "exhausted", 3)]
    assert "WRONGTYPE" in dead[0].error
    # every good trigger went out (at least once; once here: the batch flush failed whole)
    assert sorted(set(_queued(redis_url, "celery"))) == [f"[{i}]" for i in range(6) if i != 2]
