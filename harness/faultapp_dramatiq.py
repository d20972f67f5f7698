"""The Dramatiq app the fault-injection harness runs (``python -m harness.faults
--framework dramatiq``): real ``dramatiq harness.faultapp_dramatiq`` workers,
``reliable-beat dramatiq beat|relay --broker harness.faultapp_dramatiq:broker``.

Not for applications. Configured by the JSON file named in ``RB_FAULTS_CONFIG`` (see
:mod:`harness.faultcore`): the same entries, settings, injected failures and effect body as
the Celery app (:mod:`harness.faultapp`), so both runs are checked by one ledger.

The broker is Redis (``redis://``; ``heartbeat_timeout`` 10 s and maintenance on every
command, so a SIGKILLed or SIGSTOPped worker's unacked messages come back after about 10 s,
like the Celery run's visibility timeout) or RabbitMQ (``amqp://``, publisher confirms:
a trigger marked sent is in the broker). Imports no Celery.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import dramatiq

from harness.faultcore import CONFIG, effect_body, reliable_settings
from reliable_beat.dramatiq import IdempotentActor, ReliableBeat, current, rabbitmq_url

__all__ = ["ACTOR", "QUEUE", "broker", "effect", "schedule"]

#: The effect actor's name and queue.
ACTOR = "faultapp_effect"
QUEUE = "faults"


def _broker() -> Any:
    url = str(CONFIG.get("broker_url", "redis://127.0.0.1:6379/0"))
    if url.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=rabbitmq_url(url), confirm_delivery=True)
    from dramatiq.brokers.redis import RedisBroker

    return RedisBroker(url=url, namespace="faults", heartbeat_timeout=10_000,  # type: ignore[no-untyped-call]
                       maintenance_chance=1_000_000)


def schedule() -> dict[str, Any]:
    """The run's entries as a ``BEAT_SCHEDULE`` (the Celery app's items, ``"actor"`` for
    ``"task"``): catch_up with a large limit, so every slot of the checked window fires."""
    out: dict[str, Any] = {}
    for e in CONFIG.get("entries", []):
        rb: dict[str, Any] = {
            "timezone": e["timezone"], "misfire_policy": "catch_up", "catch_up_limit": 1000,
            "misfire_grace": 600, "catch_up_window": 120,
        }
        if e["kind"] == "interval":
            rb["anchor"] = e["anchor"]
        out[e["name"]] = {
            "actor": ACTOR, "args": [e["name"]], "reliable_beat": rb,
            "schedule": e["expr"] if e["kind"] == "cron" else timedelta(seconds=int(e["every"])),
        }
    return out


broker = _broker()
broker.add_middleware(ReliableBeat(settings=reliable_settings(), schedule=schedule()))
dramatiq.set_broker(broker)


@dramatiq.actor(actor_class=IdempotentActor, actor_name=ACTOR, queue_name=QUEUE)
def effect(entry: str) -> None:
    """The effect of one slot: an effect row + an outbox message, in one transaction.
    Returns nothing (Dramatiq warns about a value without a Results middleware)."""
    effect_body(current(), entry)
