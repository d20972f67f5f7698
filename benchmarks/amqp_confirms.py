"""Publishing a batch of Celery triggers to RabbitMQ: confirms per message vs per batch.

``python -m benchmarks.amqp_confirms [--messages 1000] [--amqp-url amqp://...]`` starts a
private RabbitMQ node (:class:`harness.servers.RabbitMQServer`) unless given a URL, and
prints a markdown table: messages per second for

* a raw kombu publish loop without confirms (the ceiling; "sent" proves nothing),
* a raw kombu publish loop with ``confirm_publish`` (one round trip per message),
* ``send_task`` per message with ``confirm_publish`` (what Celery does by itself),
* :func:`reliable_beat.handlers.publish_celery_batch` (one confirm wait per batch).

Every message is persistent, to a durable queue, the same shape as a trigger.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

from celery import Celery
from kombu import Connection, Exchange, Producer, Queue

from harness.servers import RabbitMQServer
from reliable_beat.handlers import publish_celery_batch
from reliable_beat.outbox import OutboxMessage


def _timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(url: str, n: int) -> str:
    rows: list[tuple[str, float]] = []
    body = {"task": "rb.echo", "args": [1], "kwargs": {}}

    def raw(confirm: bool) -> float:
        queue = Queue(f"bench-{uuid.uuid4().hex[:8]}", Exchange(""), durable=True)
        with Connection(url, transport_options={"confirm_publish": confirm}) as conn:
            producer = Producer(conn.channel())
            queue.bind(producer.channel).declare()

            def loop() -> None:
                for _ in range(n):
                    producer.publish(body, routing_key=queue.name, delivery_mode=2,
                                     serializer="json")
            elapsed = _timed(loop)
            queue.bind(conn.default_channel).delete()
        return elapsed

    rows.append(("raw kombu publish, no confirms", raw(False)))
    rows.append(("raw kombu publish, confirm per message", raw(True)))

    def celery(per_message: bool) -> float:
        name = f"bench-{uuid.uuid4().hex[:8]}"
        app = Celery("bench", broker=url)
        app.conf.task_queues = [Queue(name)]
        if per_message:
            app.conf.broker_transport_options = {"confirm_publish": True}
        messages = [OutboxMessage(id=i, message_id=f"trigger:b{i}@{name}", destination="celery",
                                  payload={**body, "options": {"queue": name}})
                    for i in range(n)]
        now = datetime.now(timezone.utc)
        with app.producer_or_acquire() as producer:  # connect outside the timing
            producer.channel.queue_declare(name, durable=True, auto_delete=False)
        if per_message:
            def loop() -> None:
                with app.producer_or_acquire() as producer:
                    for m in messages:
                        app.send_task("rb.echo", args=[1], queue=name, producer=producer,
                                      task_id=m.message_id)
            elapsed = _timed(loop)
        else:
            results: list[object] = []
            elapsed = _timed(lambda: results.extend(publish_celery_batch(app, messages, now=now)))
            assert all(err is None for _, err in results), results[:3]  # type: ignore[misc]
        with app.producer_or_acquire() as producer:
            producer.channel.queue_delete(name)
        app.close()
        return elapsed

    rows.append(("send_task per message, confirm_publish", celery(True)))
    rows.append(("publish_celery_batch, one confirm wait per batch", celery(False)))
    lines = [f"{n} persistent messages to a durable queue, RabbitMQ on loopback", "",
             "| path | seconds | messages/s |", "|---|---:|---:|"]
    lines += [f"| {name} | {s:.3f} | {n / s:,.0f} |" for name, s in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.amqp_confirms",
                                     description=__doc__)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--amqp-url", help="use this RabbitMQ instead of a private node")
    args = parser.parse_args(argv)
    if args.amqp_url:
        print(run(args.amqp_url, args.messages))
        return 0
    with RabbitMQServer() as node:
        print(run(node.url, args.messages))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
