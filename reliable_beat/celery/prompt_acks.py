"""Worker side: acknowledge a finished task's message at once, not at the next loop wake-up.

Celery's consumer (5.7) acknowledges an ``acks_late`` task's message through
``Consumer.call_soon_ack``, which, in a worker with an event loop (kombu's ``Hub``: the
``solo`` and ``prefork`` pools), queues the ``basic.ack`` with ``hub.call_soon``. The hub runs
that queue only at the top of its next iteration, and it does not wake itself for a callback
queued from its own thread. A task run from the hub's *timers* (one with an ETA or countdown:
every :class:`~reliable_beat.celery.task.IdempotentTask` retry is ``self.retry(countdown=...)``)
or from its ready queue (the consumer's start-up drain) runs after that queue was read and
before the hub blocks in ``poll``: its ack then waits for the next timer or socket event, up
to kombu's 10 s poll cap. With ``task_acks_late`` and a small prefetch
(``worker_prefetch_multiplier=1``) the unsent acks fill RabbitMQ's prefetch window, the broker
delivers nothing more, and the worker sleeps. Measured in the RabbitMQ fault run: workers
idle 4-8 s in ``epoll_wait``, then ack and run a burst in tens of milliseconds; throughput
fell to about one task per 2 s, the queue grew past 1,400 messages, and the re-dispatch
sweep took the waiting triggers for lost ones and re-sent them (more backlog).

:func:`install`, run at ``celeryd_after_setup`` in every worker of an app with an
``IdempotentTask``, makes the worker's consumer write the ack (or reject) at once when it is
called on the consumer's own thread, the one that owns the AMQP connection: what Celery
already does in a worker without a hub. Calls from other threads (the ``threads`` pool) keep
Celery's deferral to the loop thread. Nothing is acknowledged earlier than Celery decides;
only the write is no longer deferred.
"""

from __future__ import annotations

import threading
from typing import Any

from reliable_beat.redaction import get_logger

__all__ = ["install", "prompt_call_soon_ack"]

log = get_logger("reliable_beat.prompt_acks")


def prompt_call_soon_ack(consumer: Any) -> None:
    """Make ``consumer`` (a Celery worker's ``Consumer``) write acks and rejects at once on
    the calling thread, the consumer's own, when called there; calls from other threads keep
    Celery's ``call_soon_ack``. Idempotent. Call it before the consumer starts its loop (its
    task handler reads ``consumer.call_soon_ack`` when built, at each (re)connection)."""
    deferred = consumer.call_soon_ack
    if getattr(deferred, "_reliable_beat_prompt", False):
        return
    loop_thread = threading.get_ident()

    def call_soon_ack(p: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != loop_thread:
            return deferred(p, *args, **kwargs)
        try:
            p(*args, **kwargs)
        except Exception:
            # As Celery's own immediate path: an ack that cannot be written (connection
            # lost) is redelivered by the broker; log it, never fail the loop.
            log.exception("could not acknowledge a task message at once")
        return p

    call_soon_ack._reliable_beat_prompt = True  # type: ignore[attr-defined]
    consumer.call_soon_ack = call_soon_ack


def install(worker: Any) -> None:
    """``celeryd_after_setup`` (the worker's ``WorkController``, on its main thread, before
    the consumer starts): :func:`prompt_call_soon_ack` on its consumer, if it has one."""
    consumer = getattr(worker, "consumer", None)
    if consumer is not None and hasattr(consumer, "call_soon_ack"):
        prompt_call_soon_ack(consumer)
