"""The pipelined Redis publish of :func:`publish_celery_batch` sends the very messages
``send_task`` sends one by one: same body, headers, properties and Redis list (queue and
priority); a kombu consumer decodes them and a stock Celery worker runs them with the same
task id, headers, expiry, queue and priority."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import kombu.transport.redis as _kredis
import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Queue

from reliable_beat.celery import publishing as handlers
from reliable_beat.celery.publishing import celery_task_id, publish_celery_batch
from reliable_beat.handlers import DestinationUnavailableError, MessageExpiredError
from reliable_beat.outbox import OutboxMessage

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)

#: kombu's pipelined publish (``Producer.batch()``) exists from kombu 5.7; with an older kombu
#: (the oldest tox env) the handler publishes one by one, and only those tests apply.
needs_batch = pytest.mark.skipif(
    not hasattr(_kredis, "PublishBatch"),
    reason="this kombu has no Producer.batch() (kombu < 5.7): messages go one by one")


def _message(i: int, **payload: Any) -> OutboxMessage:
    return OutboxMessage(
        id=i, message_id=f"trigger:e{i}@2030", destination="celery",
        payload={"task": "rb.echo", "args": [i], "kwargs": {"k": i}, **payload},
    )


def _messages(expires_at: str) -> list[OutboxMessage]:
    return [
        _message(1, headers={"reliable_beat_key": "e1@2030", "reliable_beat_entry": "e1",
                             "reliable_beat_fire_at": "2030-01-01T00:00:00.000000Z",
                             "reliable_beat_trigger": "schedule"}),
        _message(2, options={"queue": "q2"}, expires_at=expires_at),
        _message(3, options={"queue": "celery", "priority": 6}),
        _message(4, expires_at="2000-01-01T00:00:00Z"),  # expired: not published
        _message(5, options={"routing_key": "q2"}, task_id="explicit-id"),
    ]


def _lists(url: str) -> dict[str, list[dict[str, Any]]]:
    client = redis.Redis.from_url(url)
    try:
        out: dict[str, list[dict[str, Any]]] = {}
        for key in client.scan_iter(_type="list"):
            msgs = [json.loads(raw) for raw in reversed(client.lrange(key, 0, -1))]
            for m in msgs:
                m["properties"].pop("delivery_tag")  # a fresh uuid per publish, by kombu
            out[key.decode()] = msgs
        return out
    finally:
        client.close()


def _flush(url: str) -> None:
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    _flush(redis_url)
    app = Celery("pipe", broker=redis_url)
    app.conf.task_queues = [Queue("celery"), Queue("q2")]
    yield app
    app.close()


@needs_batch
def test_pipelined_messages_equal_send_task_messages(
    app: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with app.producer_or_acquire() as producer:
        assert producer.supports_batch_publish  # the pipelined path is the one tested
    expires_at = (NOW + timedelta(hours=1)).isoformat()
    results = publish_celery_batch(app, _messages(expires_at), now=NOW)
    assert [i for i, _ in results] == [1, 2, 3, 4, 5]
    assert [type(e) for _, e in results] == [type(None)] * 3 + [MessageExpiredError] + [
        type(None)]
    pipelined = _lists(redis_url)

    _flush(redis_url)
    monkeypatch.setattr(handlers, "_publish_batch",
                        lambda producer, size: contextlib.nullcontext(()))
    publish_celery_batch(app, _messages(expires_at), now=NOW)
    one_by_one = _lists(redis_url)

    # ``expiration`` (ms left until ``expires``, set by Celery at publish) moves with time.
    p_exp = [m["properties"].pop("expiration", None)
             for k in sorted(pipelined) for m in pipelined[k]]
    o_exp = [m["properties"].pop("expiration", None)
             for k in sorted(one_by_one) for m in one_by_one[k]]
    assert [e is None for e in p_exp] == [e is None for e in o_exp]
    assert all(abs(int(a) - int(b)) < 10_000
               for a, b in zip(p_exp, o_exp, strict=True) if a is not None)
    assert pipelined == one_by_one
    assert sorted(pipelined) == ["celery", "celery\x06\x166", "q2"]
    assert [m["headers"]["id"] for m in pipelined["celery"]] == [
        celery_task_id(_message(1)), "explicit-id"]
    assert [m["headers"]["id"] for m in pipelined["q2"]] == [celery_task_id(_message(2))]
    assert pipelined["q2"][0]["headers"]["expires"] == expires_at
    assert pipelined["celery\x06\x166"][0]["properties"]["priority"] == 6


def test_kombu_consumer_decodes_pipelined_messages(app: Celery, redis_url: str) -> None:
    publish_celery_batch(app, _messages((NOW + timedelta(hours=1)).isoformat()), now=NOW)
    got: list[tuple[Any, dict[str, Any]]] = []

    def on_message(body: Any, msg: Any) -> None:
        got.append((body, msg.headers))
        msg.ack()

    with Connection(redis_url) as conn, Consumer(
        conn, [Queue("celery"), Queue("q2")], accept=["json"], callbacks=[on_message]
    ):
        for _ in range(20):
            with contextlib.suppress(TimeoutError, OSError):
                conn.drain_events(timeout=0.2)
            if len(got) == 4:
                break
    assert sorted(h["id"] for _, h in got) == sorted(
        [celery_task_id(_message(i)) for i in (1, 2, 3)] + ["explicit-id"])
    for body, headers in got:
        args, kwargs, _embed = body
        assert headers["task"] == "rb.echo" and kwargs == {"k": args[0]}
    assert {h["reliable_beat_key"] for _, h in got if "reliable_beat_key" in h} == {"e1@2030"}


def test_worker_runs_pipelined_messages(app: Celery, redis_url: str) -> None:
    from celery.contrib.testing.worker import start_worker

    seen: dict[str, dict[str, Any]] = {}
    done = threading.Event()

    @app.task(shared=False, name="rb.echo", bind=True)
    def echo(self: Any, i: int, k: int) -> None:
        req = self.request
        seen[req.id] = {"i": i, "headers": dict(req.headers or {}) | {
            k2: getattr(req, k2, None) for k2 in ("reliable_beat_key", "reliable_beat_entry")},
            "expires": req.expires, "queue": req.delivery_info.get("routing_key"),
            "priority": req.delivery_info.get("priority")}
        if len(seen) == 4:
            done.set()

    expires_at = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING",
                      queues=["celery", "q2"], shutdown_timeout=10):
        results = publish_celery_batch(app, _messages(expires_at))
        assert [e is None for _, e in results] == [True, True, True, False, True]
        assert done.wait(20), seen
    assert set(seen) == {celery_task_id(_message(i)) for i in (1, 2, 3)} | {"explicit-id"}
    first = seen[celery_task_id(_message(1))]
    assert first["headers"]["reliable_beat_key"] == "e1@2030"
    assert first["headers"]["reliable_beat_entry"] == "e1"
    second = seen[celery_task_id(_message(2))]
    assert second["queue"] == "q2" and second["expires"] == expires_at
    assert seen[celery_task_id(_message(3))]["priority"] == 6


def test_broker_down_fails_the_whole_batch(redis_url: str) -> None:
    app = Celery("down", broker="redis://127.0.0.1:1/0")
    app.conf.broker_connection_retry = False
    app.conf.task_publish_retry = False
    try:
        results = publish_celery_batch(app, [_message(1), _message(2)], now=NOW)
    finally:
        app.close()
    assert [i for i, _ in results] == [1, 2]
    assert all(isinstance(e, DestinationUnavailableError) for _, e in results)


@needs_batch
def test_failed_flush_publishes_nothing_and_counts_nothing_sent(
    app: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kombu.transport import redis as kredis

    def boom(self: Any) -> None:
        raise ConnectionError("flush failed")

    monkeypatch.setattr(kredis.PublishBatch, "flush", boom)
    results = publish_celery_batch(app, _messages(NOW.isoformat()), now=NOW)
    assert [i for i, _ in results] == [1, 2, 3, 4, 5]
    assert isinstance(results[3][1], MessageExpiredError)  # 2 and 4 expired
    assert isinstance(results[1][1], MessageExpiredError)
    for i in (0, 2, 4):
        assert isinstance(results[i][1], DestinationUnavailableError)
    assert _lists(redis_url) == {}



def test_pipelined_batch_declares_the_routed_queues_like_send_task(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue bound once per batch is still declared before its messages are published,
    the same queues with the same exchange and routing key as ``send_task`` one by one."""
    import kombu.entity

    declared: list[tuple[str, str, str, bool]] = []
    real_declare = kombu.entity.Queue.declare

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        declared.append((self.name, self.exchange.name, self.routing_key, self.is_bound))
        return real_declare(self, *args, **kwargs)

    monkeypatch.setattr(kombu.entity.Queue, "declare", spy)

    def publish(pipelined: bool) -> list[tuple[str, str, str, bool]]:
        declared.clear()
        with app.producer_or_acquire() as producer:  # kombu caches declarations per
            producer.connection.declared_entities.clear()  # connection: start afresh
        with monkeypatch.context() as m:
            if not pipelined:
                m.setattr(handlers, "_publish_batch",
                          lambda producer, size: contextlib.nullcontext(()))
            results = publish_celery_batch(
                app, _messages((NOW + timedelta(hours=1)).isoformat()), now=NOW)
        assert [e is None for _, e in results] == [True, True, True, False, True]
        return list(declared)

    pipelined = publish(True)
    assert sorted(name for name, *_ in pipelined) == ["celery", "q2"]
    assert pipelined == publish(False)

def test_bound_queue_router_routes_like_the_app_router(app: Celery) -> None:
    """Every message is routed by the app's own router (task_routes included); the routed
    queue is swapped for one bound copy per queue and batch."""
    app.conf.task_routes = {"rb.routed": {"queue": "q2"}}
    with app.producer_or_acquire() as producer:
        router = handlers._BoundQueueRouter(app.amqp.router, producer)
        first = router.route({}, "rb.routed")["queue"]
        again = router.route({}, "rb.routed")["queue"]
        default = router.route({}, "rb.other")["queue"]
        explicit = router.route({"queue": "celery"}, "rb.routed")["queue"]
        channel = producer.channel
    assert first is again and first.is_bound and first.channel is channel
    assert first.name == "q2" and first == app.amqp.queues["q2"]
    assert default is explicit and default.name == "celery"
    assert not app.amqp.queues["q2"].is_bound  # the app's own queues are left alone


@needs_batch
def test_broker_down_costs_the_pipelined_batch_no_more_reconnects_than_send_task(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the broker down and Celery's default publish retry policy, the pipelined batch
    makes exactly the reconnect attempts (and waits) ``send_task`` makes one by one: the
    first message connects under that policy, not under kombu's longer default."""
    from kombu.utils import functional

    waits: list[float] = []
    monkeypatch.setattr(functional, "sleep", waits.append)

    def publish(pipelined: bool) -> list[float]:
        waits.clear()
        app = Celery("down", broker="redis://127.0.0.1:1/0")
        try:
            with monkeypatch.context() as m:
                if not pipelined:
                    m.setattr(handlers, "_publish_batch",
                              lambda producer, size: contextlib.nullcontext(()))
                results = publish_celery_batch(app, [_message(1), _message(2)], now=NOW)
        finally:
            app.close()
        assert all(isinstance(e, DestinationUnavailableError) for _, e in results)
        return list(waits)

    assert publish(True) == publish(False)
@pytest.mark.parametrize("pipelined", [pytest.param(True, marks=needs_batch), False],
                         ids=["pipelined", "one_by_one"])
def test_wait_runs_before_any_message_reaches_the_broker(
    app: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch, pipelined: bool
) -> None:
    """The beat's claim-ahead sleeps in ``wait`` until the slot: no message may be in Redis
    while it waits, every message is there once the call returns; the messages are built
    before it when the transport buffers them (so they leave together at the instant)."""
    if not pipelined:
        monkeypatch.setattr(handlers, "_publish_batch",
                            lambda producer, size: contextlib.nullcontext(()))
    built_before_wait: list[int] = []
    seen_in_wait: list[dict[str, list[dict[str, Any]]]] = []
    sends: list[str] = []
    real_send = handlers._send_one

    def counting_send(*args: Any, **kwargs: Any) -> None:
        sends.append("send")
        real_send(*args, **kwargs)

    monkeypatch.setattr(handlers, "_send_one", counting_send)

    def wait() -> None:
        built_before_wait.append(len(sends))
        seen_in_wait.append(_lists(redis_url))

    msgs = [m for m in _messages((NOW + timedelta(hours=1)).isoformat()) if m.id != 4]
    results = publish_celery_batch(app, msgs, now=NOW, wait=wait)
    assert [e for _, e in results] == [None] * 4
    assert seen_in_wait == [{}]  # called once, and nothing had reached the broker
    assert built_before_wait == [4 if pipelined else 0]
    assert sum(len(v) for v in _lists(redis_url).values()) == 4
