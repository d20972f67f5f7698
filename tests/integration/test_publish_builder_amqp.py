"""The hand-built protocol-2 messages on RabbitMQ (kombu's ``pyamqp`` transport): byte for
byte what ``send_task`` publishes, for every publish option of
``tests/integration/test_publish_builder.py`` (its ``CASES``, shared, not copied) plus the
``rpc://`` result backend (AMQP's own: a ``reply_to`` queue declared per publish); and a
stock ``celery worker`` on RabbitMQ runs them as it runs ``send_task``'s.

The hand-built side is :func:`publish_celery_batch` as the beat and the relay call it (a
publisher-confirmed batch, :class:`~reliable_beat.celery.publishing._AmqpConfirms`); the
reference is plain ``send_task`` per message on the app's pooled producer (no confirm
channel, no builder). Both are then fetched with a raw py-amqp ``basic_get`` on a connection
whose frame reader is recorded, and compared frame by frame: the **content header frame**
(class, body size, property flags and every property: ``content_type``,
``content_encoding``, ``application_headers`` as the broker delivers their table bytes,
``delivery_mode``, ``priority``, ``correlation_id``, ``reply_to``, ``expiration``, ...), the
**body frames**, and from ``basic.get-ok`` the exchange, routing key and redelivered flag, per
queue in publish order. Normalised: only the ``expiration`` property (milliseconds left until
``expires``, taken from the clock at each publish; compared within 10 s) and, not compared,
the delivery tag and message count of ``basic.get-ok``. Task ids are equal on both sides
(``uuid5`` of the message id).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import amqp
import pytest
from celery import Celery

from reliable_beat.celery import publishing
from reliable_beat.celery.publishing import publish_celery_batch
from reliable_beat.outbox import OutboxMessage
from tests.integration.test_publish_builder import (
    CASES,
    _app,
    _count_built,
    _rows,
    check_stock_worker,
)

#: the queues every case's app knows (``_app``: celery, q2, q3 bound to ex3 / rk3)
QUEUES = ("celery", "q2", "q3")

#: AMQP-only option sets, on top of the shared ``CASES``
AMQP_CASES: dict[str, tuple[dict[str, Any], Callable[[], list[OutboxMessage]]]] = {
    "result_backend_rpc": ({"result_backend": "rpc://"}, lambda: _rows(5)),
    "rpc_and_priority_queue": ({"result_backend": "rpc://"},
                               lambda: _rows(5, options={"queue": "q2", "priority": 9})),
}


@dataclass(frozen=True)
class Delivered:
    """One message as a consumer receives it (``basic.get``), with the raw frames."""

    exchange: str
    routing_key: str
    redelivered: bool
    header: bytes  # the content header frame's payload, ``expiration`` normalised
    body: bytes  # the body frames' payloads, joined
    properties: dict[str, Any]  # decoded from ``header`` (readable diffs), expiration normalised


@contextlib.contextmanager
def _raw_channel(url: str) -> Iterator[tuple[amqp.Channel, list[tuple[int, int, bytes]]]]:
    """A plain py-amqp channel on ``url`` and the list every frame read is appended to."""
    parts = urlsplit(url)
    vhost = unquote(parts.path[1:]) or "/"
    conn = amqp.Connection(host=f"{parts.hostname}:{parts.port or 5672}",
                           userid=unquote(parts.username or "guest"),
                           password=unquote(parts.password or "guest"), virtual_host=vhost)
    conn.connect()
    frames: list[tuple[int, int, bytes]] = []
    read_frame = conn.transport.read_frame

    def recording(*args: Any, **kwargs: Any) -> Any:
        frame = read_frame(*args, **kwargs)
        frames.append((frame[0], frame[1], bytes(frame[2])))
        return frame

    conn.transport.read_frame = recording
    try:
        yield conn.channel(), frames
    finally:
        conn.close()


def _fetch(url: str, expected: int) -> tuple[dict[str, list[Delivered]], list[int]]:
    """Every message of :data:`QUEUES` in publish order (removed), once ``expected`` are in,
    and the ``expiration`` of each (ms, in fetch order)."""
    got: dict[str, list[Delivered]] = {}
    expirations: list[int] = []
    with _raw_channel(url) as (channel, frames):
        deadline = time.monotonic() + 30  # the reference's publishes are not confirmed
        while sum(channel.queue_declare(q, passive=True).message_count for q in QUEUES) \
                < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        for queue in QUEUES:
            while True:
                frames.clear()
                msg = channel.basic_get(queue, no_ack=True)
                if msg is None:
                    break
                mine = [(t, p) for t, c, p in frames if c == channel.channel_id]
                header = b"".join(p for t, p in mine if t == 2)
                body = b"".join(p for t, p in mine if t == 3)
                decoded = msg.body  # py-amqp decodes a body with a text content_encoding
                assert body == (decoded.encode(msg.properties["content_encoding"])
                                if isinstance(decoded, str) else bytes(decoded))
                props = dict(msg.properties)
                if "expiration" in props:
                    raw = str(props["expiration"]).encode()
                    field = bytes([len(raw)]) + raw  # an AMQP shortstr
                    assert header.count(field) == 1, (header, field)
                    header = header.replace(field, b"\x04<ms>")
                    expirations.append(int(raw))
                    props["expiration"] = "<ms>"
                info = msg.delivery_info
                got.setdefault(queue, []).append(Delivered(
                    info["exchange"], info["routing_key"], bool(info["redelivered"]), header,
                    body, props))
    return got, expirations


def _purge(url: str) -> None:
    """Declare the cases' queues (as ``send_task`` would) and empty them."""
    with _raw_channel(url) as (channel, _frames):
        for queue in QUEUES:
            channel.queue_declare(queue, durable=True, auto_delete=False)
            channel.queue_purge(queue)


def _amqp_app(amqp_url: str, redis_url: str, conf: dict[str, Any]) -> Celery:
    """``test_publish_builder._app`` on RabbitMQ; a ``"REDIS"`` result backend stays Redis."""
    redis_keys = [k for k, v in conf.items() if v == "REDIS"]
    app = _app(amqp_url, {k: v for k, v in conf.items() if k not in redis_keys})
    for key in redis_keys:
        app.conf[key] = redis_url
    return app


def _publish_both(app: Celery, url: str, rows: list[OutboxMessage],
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, int]:
    """(hand-built confirmed batch, ``send_task`` one by one, messages built by hand), each
    side fetched as :func:`_fetch` returns it."""
    _purge(url)
    with _count_built(monkeypatch) as built:
        results = publish_celery_batch(app, rows)
    assert [e for _, e in results] == [None] * len(rows)
    built_side = _fetch(url, len(rows))
    with monkeypatch.context() as m:  # the reference: plain send_task per message
        m.setattr(publishing, "_amqp_confirms",
                  lambda producer: contextlib.nullcontext(None))
        m.setattr(publishing._MessageBuilder, "for_batch", classmethod(lambda cls, app: None))
        results = publish_celery_batch(app, rows)
    assert [e for _, e in results] == [None] * len(rows)
    return built_side, _fetch(url, len(rows)), built[0]


ALL_CASES = {**CASES, **AMQP_CASES}


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_built_messages_equal_send_task_frame_for_frame_on_rabbitmq(
    case: str, amqp_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf, make_rows = ALL_CASES[case]
    app = _amqp_app(amqp_url, redis_url, conf)
    try:
        rows = make_rows()
        (built, b_exp), (reference, r_exp), n_built = _publish_both(
            app, amqp_url, rows, monkeypatch)
        # the builder did build: every message after each shape's first (each shape's
        # template goes through send_task)
        shapes = {(m.payload.get("task"), m.payload.get("expires_at") is None,
                   repr(sorted((m.payload.get("options") or {}).items()))) for m in rows}
        assert n_built >= len(rows) - len(shapes) > 0
        assert sum(len(v) for v in built.values()) == len(rows)
        assert sorted(built) == sorted(reference)
        for queue in built:  # readable first: exchange, routing key, properties, body
            for b, r in zip(built[queue], reference[queue], strict=True):
                assert (b.exchange, b.routing_key, b.redelivered) == \
                    (r.exchange, r.routing_key, r.redelivered), queue
                assert b.properties == r.properties, queue
                assert b.body == r.body, queue
                assert b.header == r.header, queue  # the frame's bytes
        assert built == reference
        assert len(b_exp) == len(r_exp)
        assert all(abs(a - b) < 10_000 for a, b in zip(b_exp, r_exp, strict=True))
        if "expires" in case:
            assert len(b_exp) >= 4
    finally:
        app.close()


def test_the_comparison_sees_a_one_byte_difference(
    amqp_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frame comparison above can fail: a builder that gets one header wrong (a
    ``retries`` of 1 instead of 0) makes built and reference differ in the header frame."""
    real = publishing._MessageBuilder.publish

    def off_by_one(self: Any, producer: Any, *args: Any, **kwargs: Any) -> bool:
        class Wrong:
            def __getattr__(self, name: str) -> Any:
                return getattr(producer, name)

            def publish(self, body: Any, **kw: Any) -> Any:
                kw["headers"] = dict(kw["headers"], retries=1)
                return producer.publish(body, **kw)

        return real(self, Wrong(), *args, **kwargs)

    monkeypatch.setattr(publishing._MessageBuilder, "publish", off_by_one)
    app = _amqp_app(amqp_url, redis_url, {})
    try:
        rows = _rows(4)
        (built, _), (reference, _), n_built = _publish_both(app, amqp_url, rows, monkeypatch)
        assert n_built == 3
        b, r = built["celery"], reference["celery"]
        assert b[0] == r[0]  # the template: send_task's own message
        assert all(x.body == y.body for x, y in zip(b, r, strict=True))
        assert all(x.header != y.header for x, y in zip(b[1:], r[1:], strict=True))
    finally:
        app.close()


def test_stock_worker_on_rabbitmq_runs_built_messages_like_send_task_messages(
    amqp_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``test_publish_builder.check_stock_worker`` on RabbitMQ: a stock ``celery worker``
    runs every hand-built message once, with the request fields, routing key and priority
    of ``send_task``'s message of the same shape; the expired ones are not run (RabbitMQ
    drops them at their ``expiration``)."""
    _purge(amqp_url)
    check_stock_worker(amqp_url, tmp_path, monkeypatch)
