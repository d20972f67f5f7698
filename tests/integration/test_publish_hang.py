"""publish_celery_batch against a real Redis that hangs (``CLIENT PAUSE ... ALL`` on a
private ``redis-server``): bounded by the socket timeout, then fail-fast until a background
probe gets an answer, then publishing resumes."""

from __future__ import annotations

import time

import redis
from celery import Celery

from harness.servers import RedisServer
from reliable_beat.celery.publishing import bound_broker_wait, publish_celery_batch
from reliable_beat.handlers import DestinationUnavailableError
from reliable_beat.outbox import OutboxMessage


def _msg(i: int) -> OutboxMessage:
    return OutboxMessage(id=i, message_id=f"hang-{i}", destination="celery",
                         payload={"task": "t", "args": [i], "options": {"queue": "hangq"}})


def test_hung_redis_bounded_then_fail_fast_then_resumes() -> None:
    with RedisServer() as server:
        app = Celery("hang", broker=server.url, set_as_current=False)
        assert bound_broker_wait(app, 1.0)
        client = redis.Redis.from_url(server.url)
        try:
            assert publish_celery_batch(app, [_msg(1)]) == [(1, None)]
            client.execute_command("CLIENT", "PAUSE", "6000", "ALL")
            started = time.monotonic()
            [(_, first)] = publish_celery_batch(app, [_msg(2)])
            took = time.monotonic() - started
            assert isinstance(first, DestinationUnavailableError), first
            assert "did not answer within 1 s" in str(first) and server.url in str(first)
            assert took < 4.0, took  # main: blocked for the whole 6 s pause
            started = time.monotonic()
            [(_, second)] = publish_celery_batch(app, [_msg(3)])
            fast = time.monotonic() - started
            assert isinstance(second, DestinationUnavailableError) and fast < 0.2, fast
            deadline = time.monotonic() + 30
            results = publish_celery_batch(app, [_msg(2), _msg(3)])
            while any(r is not None for _, r in results) and time.monotonic() < deadline:
                time.sleep(0.5)
                results = publish_celery_batch(app, [_msg(2), _msg(3)])
            assert results == [(2, None), (3, None)], results
            print(f"\n[publish hang] first publish {took:.2f} s, then {fast * 1000:.1f} ms "
                  "while hung; resumed after the pause")
        finally:
            client.close()
            app.close()
