"""A Dramatiq "app" for ``reliable-beat -A tests.apps.dq_kind_app ...`` (the CLI's task kind
and settings through the Dramatiq adapter): a ``StubBroker`` (no server) with the
ReliableBeat middleware, one :class:`~reliable_beat.dramatiq.IdempotentActor`
(``kind_tracked``, ``lease_seconds=7``) and one plain actor (``kind_plain``). Declared on
this module's own broker, never ``dramatiq.set_broker``, so importing it changes no global.
"""

from __future__ import annotations

import dramatiq
from dramatiq.brokers.stub import StubBroker

from reliable_beat.dramatiq import IdempotentActor, ReliableBeat

broker = StubBroker()
broker.add_middleware(ReliableBeat(settings={"database_url": "sqlite:///dq-kind-unused.db",
                                             "lease_seconds": 30}))


@dramatiq.actor(broker=broker, actor_class=IdempotentActor, queue_name="kinds",
                lease_seconds=7)
def kind_tracked() -> None:
    """An idempotent actor (its key from the trigger)."""


@dramatiq.actor(broker=broker, queue_name="kinds")
def kind_plain() -> None:
    """A plain actor (effects at-least-once)."""
