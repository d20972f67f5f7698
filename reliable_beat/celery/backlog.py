"""How many messages wait ready in the queues of a Celery app's broker: the re-dispatch
sweep's backlog check (:data:`reliable_beat.redispatch.QueueDepthFn`).

A trigger queued behind a backlog and a trigger the broker lost look the same from the
database (``dispatched``, no worker claimed it). Before re-sending, the sweep asks the broker
how deep each destination queue is: kombu's passive ``queue_declare``, which changes nothing
on the broker. On RabbitMQ it is AMQP's ``queue.declare(passive=True)`` and its
``message_count`` (messages ready for delivery, not the unacknowledged ones a worker holds);
on Redis, kombu's virtual transport answers with the queue's list length (``LLEN``, summed
over its priority lists). A queue that does not exist holds 0. Anything else the broker says
(unreachable, refused) is an unknown depth: the sweep then re-sends as without the check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from reliable_beat.redaction import get_logger

if TYPE_CHECKING:
    from reliable_beat.outbox import OutboxMessage

__all__ = ["queue_depths", "trigger_queue"]

log = get_logger("reliable_beat.celery.backlog")


def trigger_queue(app: Any, message: OutboxMessage) -> str:
    """The name of the queue ``app`` publishes trigger row ``message`` to: its payload's
    ``options`` (``queue``, ``routing_key``, ``exchange``) through the app's router
    (``task_routes``, custom routers), as ``send_task`` routes it; ``task_default_queue``
    when the router names none."""
    payload = message.payload if isinstance(message.payload, Mapping) else {}
    options = {k: v for k, v in dict(payload.get("options") or {}).items()
               if k in ("queue", "routing_key", "exchange") and v is not None}
    queue: Any = None
    try:
        routed = app.amqp.router.route(options, str(payload.get("task") or ""),
                                       list(payload.get("args") or []),
                                       dict(payload.get("kwargs") or {}))
        queue = routed.get("queue")
    except Exception as exc:  # a router that refuses: the default queue, said at DEBUG
        log.debug("routing %s for the backlog check failed: %r", message.message_id, exc)
    if queue is None:
        return str(app.conf.task_default_queue)
    return str(getattr(queue, "name", queue))


def _is_not_found(exc: BaseException) -> bool:
    """AMQP 404 NOT_FOUND (py-amqp's ``NotFound``, kombu's virtual ``ChannelError``)."""
    code = getattr(exc, "reply_code", None) or getattr(exc, "code", None)
    return str(code) == "404" or "NOT_FOUND" in str(exc)


def queue_depths(app: Any, messages: Sequence[OutboxMessage]) -> list[tuple[str, int | None]]:
    """``(queue, ready messages or None)`` per message, in order: each queue asked once, on
    one broker connection opened for the purpose (one connect attempt, no retry loop).

    Raises:
        Exception: the broker cannot be reached (the caller re-sends as without the check).
    """
    names = [trigger_queue(app, m) for m in messages]
    depth: dict[str, int | None] = {}
    conn = app.connection_for_write()
    try:
        conn.connect()  # one attempt; kombu's default_channel would retry for ever
        for name in dict.fromkeys(names):
            channel = conn.channel()
            try:
                ok = channel.queue_declare(queue=name, passive=True)
                depth[name] = int(ok.message_count)
            except Exception as exc:
                if isinstance(exc, conn.connection_errors):
                    raise
                depth[name] = 0 if _is_not_found(exc) else None
            finally:
                with suppress(Exception):  # a 404 on AMQP closed the channel already
                    channel.close()
    finally:
        conn.release()
    return [(n, depth[n]) for n in names]
