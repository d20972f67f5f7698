"""How many messages wait ready in the queues of a Dramatiq broker: the re-dispatch sweep's
backlog check (:data:`reliable_beat.redispatch.QueueDepthFn`), as
:mod:`reliable_beat.celery.backlog` is for Celery.

A trigger queued behind a backlog (a stopped or slow worker) and a trigger the broker lost
look the same from the database (``dispatched``, no worker claimed it). Before re-sending,
the sweep asks the broker how deep each destination queue is, read-only:

* ``RedisBroker``: Dramatiq keeps a queue's ready messages as a list of message ids at
  ``<namespace>:<queue>`` (the bodies in the hash ``<namespace>:<queue>.msgs``; see
  ``dramatiq/brokers/redis/dispatch.lua``): its ``LLEN``. Messages a worker fetched and has
  not acknowledged (``<namespace>:__acks__.<worker>.<queue>``) and delayed ones
  (``<queue>.DQ``, e.g. a retry not yet due) are not counted, as RabbitMQ's
  ``message_count`` does not count unacknowledged ones. A queue Redis does not hold is 0.
* ``RabbitmqBroker``: AMQP's ``queue.declare(passive=True)`` and its ``message_count``
  (ready messages) on a pika connection opened for the purpose with the broker's connection
  parameters (one channel per queue: a 404 closes it). A queue that does not exist holds 0.
* ``StubBroker`` (tests): the size of its in-memory queue.

Anything else (another broker class, an unreachable broker) is an unknown depth: the sweep
then re-sends as without the check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from reliable_beat.redaction import get_logger

if TYPE_CHECKING:
    from reliable_beat.outbox import OutboxMessage

__all__ = ["queue_depths", "trigger_queue"]

log = get_logger("reliable_beat.dramatiq.backlog")


def trigger_queue(broker: Any, message: OutboxMessage) -> str:
    """The name of the queue ``broker`` enqueues outbox row ``message`` on: a trigger's
    ``options.queue_name`` / ``options.queue`` (as
    :func:`reliable_beat.dramatiq.message_for_trigger` reads them), an application message's
    ``queue``, else its actor's ``queue_name``; ``default`` (Dramatiq's default queue) when the
    broker declares no such actor.
    """
    payload = message.payload if isinstance(message.payload, Mapping) else {}
    options = payload.get("options") if isinstance(payload.get("options"), Mapping) else {}
    assert isinstance(options, Mapping)
    queue = options.get("queue_name") or options.get("queue") or payload.get("queue")
    if queue:
        return str(queue)
    actor_name = str(payload.get("task") or payload.get("actor") or "")
    actor = (getattr(broker, "actors", None) or {}).get(actor_name)
    return str(getattr(actor, "queue_name", None) or "default")


def _depth_probe(broker: Any) -> tuple[Callable[[str], int | None], Callable[[], None]]:
    """``(depth(queue) -> ready messages or None, close())`` for ``broker``'s class.

    Raises:
        Exception: the broker cannot be reached (RabbitMQ: opening the connection).
    """
    cls = {c.__name__ for c in type(broker).__mro__}
    if "RedisBroker" in cls:
        client, namespace = broker.client, str(broker.namespace)

        def redis_depth(queue: str) -> int | None:
            return int(client.llen(f"{namespace}:{queue}"))

        return redis_depth, lambda: None
    if "RabbitmqBroker" in cls:
        import pika

        # the broker's own parameters (a list: pika tries each in turn), one attempt each
        conn = pika.BlockingConnection(broker.parameters)

        def amqp_depth(queue: str) -> int | None:
            channel = conn.channel()
            try:
                ok = channel.queue_declare(queue=queue, passive=True)
                return int(ok.method.message_count)
            except pika.exceptions.ChannelClosedByBroker as exc:
                return 0 if exc.reply_code == 404 else None
            finally:
                with suppress(Exception):  # a 404 closed the channel already
                    channel.close()

        def close() -> None:
            with suppress(Exception):
                conn.close()

        return amqp_depth, close
    if "StubBroker" in cls:
        queues = broker.queues

        def stub_depth(queue: str) -> int | None:
            q = queues.get(queue)
            return 0 if q is None else int(q.qsize())

        return stub_depth, lambda: None
    return (lambda _queue: None), lambda: None


def queue_depths(broker: Any, messages: Sequence[OutboxMessage]
                 ) -> list[tuple[str, int | None]]:
    """``(queue, ready messages or None)`` per message, in order (each queue asked once; see
    the module docstring for what each broker counts). None: this broker cannot tell.

    Args:
        broker: the Dramatiq broker (the adapter's "app").
        messages: outbox rows the sweep would re-send (trigger or ``dramatiq`` rows).

    Raises:
        Exception: the broker cannot be reached (the caller re-sends as without the check).
    """
    names = [trigger_queue(broker, m) for m in messages]
    depth: dict[str, int | None] = {}
    probe, close = _depth_probe(broker)
    try:
        for name in dict.fromkeys(names):
            depth[name] = probe(name)
    finally:
        close()
    return [(n, depth[n]) for n in names]
