"""Read what Celery / kombu published into a queue, without consuming it.

Works on both test brokers: a Redis URL reads the kombu list; an ``amqp://`` URL (RabbitMQ)
takes every message with ``basic.get`` and closes the channel without acknowledging, so the
broker puts them all back (in order).
"""

from __future__ import annotations

import json
from typing import Any

import redis


def _is_amqp(url: str) -> bool:
    return url.split(":", 1)[0] in ("amqp", "amqps", "pyamqp")


def _amqp_queued(url: str, queue: str) -> list[dict[str, Any]]:
    from kombu import Connection

    out: list[dict[str, Any]] = []
    with Connection(url) as conn:
        channel = conn.channel()
        try:
            try:
                channel.queue_declare(queue, passive=True)
            except Exception:  # no such queue (nothing was ever published to it)
                return out
            while (msg := channel.basic_get(queue, no_ack=False)) is not None:
                out.append({"headers": dict(msg.headers or {}), "properties": dict(
                    msg.properties), "body": msg.body})
        finally:
            channel.close()  # unacknowledged: every message goes back to the queue
    return out


def queued(broker_url: str, queue: str = "celery") -> list[dict[str, Any]]:
    """Every kombu message in ``queue`` (oldest first), as decoded JSON envelopes (Redis) or
    ``{"headers", "properties", "body"}`` (RabbitMQ)."""
    if _is_amqp(broker_url):
        return _amqp_queued(broker_url, queue)
    client = redis.Redis.from_url(broker_url)
    try:
        return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]
    finally:
        client.close()


def task_ids(broker_url: str, queue: str = "celery") -> list[str]:
    """The Celery task id of every message in ``queue`` (oldest first, duplicates kept)."""
    return [m["headers"]["id"] for m in queued(broker_url, queue)]


def message_ids(broker_url: str, queue: str = "celery") -> list[str]:
    """The outbox message id of every message in ``queue`` (oldest first)."""
    return [m["headers"]["reliable_beat_message_id"] for m in queued(broker_url, queue)]


def flush(broker_url: str, queue: str = "celery") -> None:
    """Empty the test's broker: the Redis database, or ``queue`` on RabbitMQ (whose node the
    session shares)."""
    if _is_amqp(broker_url):
        from kombu import Connection

        with Connection(broker_url) as conn:
            channel = conn.channel()
            try:
                channel.queue_purge(queue)
            except Exception:
                pass  # no such queue yet
            finally:
                channel.close()
        return
    client = redis.Redis.from_url(broker_url)
    try:
        client.flushdb()
    finally:
        client.close()
