"""Read what Celery / kombu published into a Redis list, without consuming it."""

from __future__ import annotations

import json
from typing import Any

import redis


def queued(redis_url: str, queue: str = "celery") -> list[dict[str, Any]]:
    """Every kombu message in ``queue`` (oldest first), as decoded JSON envelopes."""
    client = redis.Redis.from_url(redis_url)
    try:
        return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]
    finally:
        client.close()


def task_ids(redis_url: str, queue: str = "celery") -> list[str]:
    """The Celery task id of every message in ``queue`` (oldest first, duplicates kept)."""
    return [m["headers"]["id"] for m in queued(redis_url, queue)]


def message_ids(redis_url: str, queue: str = "celery") -> list[str]:
    """The outbox message id of every message in ``queue`` (oldest first)."""
    return [m["headers"]["reliable_beat_message_id"] for m in queued(redis_url, queue)]


def flush(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
    finally:
        client.close()
