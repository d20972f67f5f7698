"""The payouts example on Dramatiq: the same entry, tables and body as the Celery app
(:mod:`examples.payouts.app`), with a Dramatiq ``IdempotentActor``.

Every slot of ``pay-merchants`` (every 5 s in demo mode; nightly in real config) pays each
merchant exactly once (:func:`examples.payouts.ledger.pay`). Processes::

    reliable-beat dramatiq beat  --broker examples.payouts.dq_app:broker   # any number
    dramatiq examples.payouts.dq_app
    reliable-beat dramatiq relay --broker examples.payouts.dq_app:broker

Configuration from the environment: ``RELIABLE_BEAT_DATABASE_URL``, ``PAYOUTS_BROKER_URL``
(a Redis URL: Dramatiq has no embedded broker that works across processes -- its
``StubBroker`` lives in one process -- so ``python -m examples.payouts --framework
dramatiq`` starts a private ``redis-server`` when none is given), ``PAYOUTS_WEBHOOK_URL``,
``PAYOUTS_SCHEDULE``. Imports no Celery.
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from examples.payouts.ledger import DATABASE_URL, SCHEDULE, WEBHOOK_BASE, pay
from reliable_beat.dramatiq import IdempotentActor, ReliableBeat, current

__all__ = ["broker", "pay_merchants"]

BROKER_URL = os.environ.get("PAYOUTS_BROKER_URL", "redis://127.0.0.1:6379/0")

# A killed worker's messages come back after 15 s (Dramatiq's default: 60 s, and only when
# a maintenance roll happens; here every command rolls), like the Celery app's visibility
# timeout; the re-dispatch sweep (20 s) is the second line.
broker = RedisBroker(url=BROKER_URL, namespace="payouts", heartbeat_timeout=15_000,
                     maintenance_chance=1_000_000)
broker.add_middleware(ReliableBeat(settings={
    "database_url": DATABASE_URL,
    "webhook_destinations": {"merchants": {"base_url": WEBHOOK_BASE}},
    "lease_seconds": float(os.environ.get("PAYOUTS_LEASE_SECONDS", "10")),
    "redispatch_seconds": 20.0,
}))
dramatiq.set_broker(broker)  # before any actor is declared (actor option validation)


@dramatiq.actor(actor_class=IdempotentActor, actor_name="payouts.pay_merchants",
                queue_name="payouts", periodic=SCHEDULE, periodic_name="pay-merchants",
                reliable_beat={"timezone": "Europe/Berlin", "misfire_policy": "catch_up",
                               "catch_up_limit": 50})
def pay_merchants() -> dict[str, int]:
    """Pay every merchant for this run's slot, exactly once."""
    result: dict[str, Any] = pay(current())
    return result
