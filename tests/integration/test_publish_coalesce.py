"""A Redis batch's consecutive ``LPUSH``es to one queue go out as one multi-value ``LPUSH``
(``reliable_beat.celery.wire._coalesce_pushes``): the queues hold exactly what one ``LPUSH``
per message leaves (the same bytes in the same order), with the batch's queues interleaved,
a priority queue, and a queue with ``x-expires`` (whose ``PEXPIRE`` after each message ends
a run)."""

from __future__ import annotations

import re
from typing import Any

import kombu.transport.redis as _kredis
import pytest
import redis
from celery import Celery
from kombu import Queue

from reliable_beat.celery import wire
from reliable_beat.celery.publishing import publish_celery_batch
from reliable_beat.outbox import OutboxMessage

pytestmark = pytest.mark.skipif(
    not hasattr(_kredis, "PublishBatch"),
    reason="kombu < 5.7: no Producer.batch(), nothing to coalesce")

_TAG = re.compile(rb'"delivery_tag": "[0-9a-f-]{36}"')


def _rows() -> list[OutboxMessage]:
    """Runs of one queue, then another, back and forth; one queue with a priority, one with
    x-expires."""
    plan = ["celery"] * 4 + ["q2"] * 3 + ["celery"] * 2 + ["qx"] * 3 + ["q2"] + ["celery"] * 3
    out = []
    for i, queue in enumerate(plan, start=1):
        options: dict[str, Any] = {} if queue == "celery" else {"queue": queue}
        if queue == "q2" and i % 2:
            options["priority"] = 6
        out.append(OutboxMessage(
            id=i, message_id=f"trigger:e{i}@2030", destination="celery",
            payload={"task": "rb.echo", "args": [i], "kwargs": {"n": i},
                     "headers": {"reliable_beat_key": f"e{i}@2030"}, "options": options}))
    return out


def _lists(url: str) -> dict[str, list[bytes]]:
    client = redis.Redis.from_url(url)
    try:
        found = {key.decode(): [_TAG.sub(b"<tag>", raw) for raw in client.lrange(key, 0, -1)]
                 for key in client.scan_iter(_type="list")}
        if found:
            client.delete(*found)
        return found
    finally:
        client.close()


def test_consecutive_pushes_to_a_queue_are_one_lpush_and_leave_the_same_lists(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = Celery("coalesce", broker=redis_url)
    app.conf.task_queues = [Queue("celery"), Queue("q2", queue_arguments={"x-max-priority": 9}),
                            Queue("qx", expires=60)]
    try:
        rows = _rows()
        merged: list[int] = []
        real = wire._coalesce_pushes

        def counting(producer: Any) -> int:
            merged.append(real(producer))
            return merged[-1]

        monkeypatch.setattr(wire, "_coalesce_pushes", counting)
        _lists(redis_url)
        assert [e for _, e in publish_celery_batch(app, rows)] == [None] * len(rows)
        coalesced = _lists(redis_url)
        # the reference: the same batch, one LPUSH per message
        monkeypatch.setattr(wire, "_coalesce_pushes", lambda producer: 0)
        assert [e for _, e in publish_celery_batch(app, rows)] == [None] * len(rows)
        reference = _lists(redis_url)

        assert sum(len(v) for v in reference.values()) == len(rows)
        assert coalesced == reference
        # runs: celery 4, q2 3 (two priority keys: 1 + 1 + 1 pushes), celery 2, qx 3 (each
        # followed by its PEXPIREs: no run), q2 1, celery 3 -> 3 + 1 + 2 merged away
        assert merged == [6]
    finally:
        app.close()
