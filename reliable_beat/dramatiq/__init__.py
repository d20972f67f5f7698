"""The Dramatiq adapter: ``ReliableBeat`` middleware, ``IdempotentActor``, periodic entries,
a trigger publisher for the core :class:`~reliable_beat.loop.BeatLoop`, and a ``dramatiq``
outbox destination handler. See ``docs/dramatiq.md``.

::

    broker = RedisBroker(url="redis://...")
    broker.add_middleware(ReliableBeat(settings={"database_url": "postgresql+psycopg://..."}))
    dramatiq.set_broker(broker)     # before any actor module is imported

    @dramatiq.actor(actor_class=IdempotentActor, periodic="0 2 * * *")
    def pay_merchants():
        rb = current()
        with rb.transaction() as tx:
            tx.execute(insert(payouts).values(run_id=rb.run_id))
            rb.outbox.add(tx, "webhook", {...})

The worker protocol is the core's (:mod:`reliable_beat.execution`): key -> claim (lease +
fence) -> body under the process's lease renewer -> fenced completion -> classification.
Retries are decided by us and counted in the database (``dramatiq.Retry(delay=ms)``);
Dramatiq's own retry counter is switched off on idempotent actors (``max_retries=None``).
A permanent failure or an exhausted budget is a dead letter in ``reliable_beat_dead_letters``
and the message is failed (``throws``: Dramatiq nacks it to ``<queue>.XQ``).

The package: :mod:`~reliable_beat.dramatiq.base` (shared names) <
:mod:`~reliable_beat.dramatiq.context` (``current()``) < :mod:`~reliable_beat.dramatiq.worker`
(the middleware and the actor class) < :mod:`~reliable_beat.dramatiq.publisher` (messages,
publisher, outbox handler, requeue) < :mod:`~reliable_beat.dramatiq.periodic` (entries and
the beat loop). Every public name is imported from here; periodic's on first use (it
imports the core beat loop, which a worker process never needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reliable_beat.dramatiq.base import OPTION, TRIGGER_DESTINATION, DeadLettered
from reliable_beat.dramatiq.base import _broker_errors as _broker_errors
from reliable_beat.dramatiq.base import _parse_instant as _parse_instant
from reliable_beat.dramatiq.context import RunContext, current
from reliable_beat.dramatiq.context import _message as _message
from reliable_beat.dramatiq.context import _run as _run
from reliable_beat.dramatiq.publisher import (
    DramatiqHandler,
    DramatiqPublisher,
    rabbitmq_url,
    requeue_dead_letter,
)
from reliable_beat.dramatiq.publisher import _publish_errors as _publish_errors
from reliable_beat.dramatiq.publisher import message_for_trigger as message_for_trigger
from reliable_beat.dramatiq.worker import _THROWS as _THROWS
from reliable_beat.dramatiq.worker import ACTOR_OPTIONS as ACTOR_OPTIONS
from reliable_beat.dramatiq.worker import IdempotentActor, ReliableBeat, record_skipped_message
from reliable_beat.dramatiq.worker import _interrupts as _interrupts
from reliable_beat.dramatiq.worker import _middleware as _middleware
from reliable_beat.dramatiq.worker import log as log

if TYPE_CHECKING:
    from reliable_beat.dramatiq.periodic import CELERY_ONLY_OPTIONS as CELERY_ONLY_OPTIONS
    from reliable_beat.dramatiq.periodic import beat_loop, definitions
    from reliable_beat.dramatiq.periodic import sync_entries as sync_entries

__all__ = [
    "OPTION",
    "TRIGGER_DESTINATION",
    "DeadLettered",
    "DramatiqHandler",
    "DramatiqPublisher",
    "IdempotentActor",
    "ReliableBeat",
    "RunContext",
    "beat_loop",
    "current",
    "definitions",
    "rabbitmq_url",
    "record_skipped_message",
    "requeue_dead_letter",
]

#: The beat's names, imported on first use: periodic.py imports the core beat loop and the
#: entries sync (and through them Alembic), which a worker process never needs.
_PERIODIC = frozenset({"CELERY_ONLY_OPTIONS", "beat_loop", "definitions", "sync_entries"})


def __getattr__(name: str) -> Any:
    if name in _PERIODIC:
        from reliable_beat.dramatiq import periodic

        return getattr(periodic, name)
    raise AttributeError(f"module 'reliable_beat.dramatiq' has no attribute {name!r}")
