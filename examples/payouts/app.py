"""The payouts Celery app.

Every slot of ``pay-merchants`` (every 5 s in demo mode; nightly in real config) pays each
merchant what it is owed for that slot: one payout row and two ledger rows per merchant, in
ONE transaction with the run's idempotency key, plus an outbox message that notifies the
merchant by webhook. A duplicate trigger, a redelivery, a retry or a zombie worker can never
pay twice: the effect and the key commit together, fenced.

Configuration comes from the environment (the runner in ``__main__`` sets it):
``RELIABLE_BEAT_DATABASE_URL``, ``PAYOUTS_BROKER_URL`` (default: a filesystem broker under
``PAYOUTS_DIR``), ``PAYOUTS_WEBHOOK_URL``, ``PAYOUTS_SCHEDULE`` (cron, default every 5 s).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from examples.payouts.ledger import (
    DATABASE_URL,
    MERCHANTS,
    SCHEDULE,
    WEBHOOK_BASE,
    WORKDIR,
    create_app_tables,
    ledger,
    metadata,
    owed_cents,
    pay,
    payouts,
    total_paid,
)
from reliable_beat import IdempotentTask

__all__ = ["MERCHANTS", "app", "create_app_tables", "ledger", "metadata", "owed_cents",
           "pay_merchants",
           "payouts", "total_paid"]

BROKER_URL = os.environ.get("PAYOUTS_BROKER_URL", "filesystem://")

app = Celery("payouts", broker=BROKER_URL)
app.conf.update(
    beat_scheduler="reliable_beat.ReliableScheduler",
    reliable_beat_database_url=DATABASE_URL,
    reliable_beat_webhook_destinations={"merchants": {"base_url": WEBHOOK_BASE}},
    reliable_beat_lease_seconds=float(os.environ.get("PAYOUTS_LEASE_SECONDS", "10")),
    reliable_beat_redispatch_seconds=20.0,  # above the 15 s visibility timeout below
    beat_max_loop_interval=5,
    timezone="Europe/Berlin",
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # Redis: a killed worker's message comes back after 15 s; kombu checks for such
    # messages every second (its default is about every 100 s), under a lock that a
    # worker killed while holding it leaves for 5 s (kombu's default: 300 s).
    broker_transport_options={"visibility_timeout": 15, "unacked_restore_interval": 1,
                              "unacked_restore_throttle": 1, "unacked_mutex_expire": 5},
    beat_schedule={
        "pay-merchants": {
            "task": "payouts.pay_merchants",
            "schedule": SCHEDULE,  # demo: every 5 s; real config: "0 2 * * *"
            "options": {"reliable_beat": {"misfire_policy": "catch_up", "catch_up_limit": 50}},
        }
    },
)
if BROKER_URL == "filesystem://":
    broker_dir = WORKDIR / "broker"
    app.conf.broker_transport_options = {
        "data_folder_in": str(broker_dir),
        "data_folder_out": str(broker_dir),
        "store_processed": False,
    }

# The application's own tables and the body live in examples.payouts.ledger (shared with
# the Dramatiq app, examples.payouts.dq_app).


@app.task(base=IdempotentTask, bind=True, name="payouts.pay_merchants")
def pay_merchants(self: Any) -> dict[str, int]:
    """Pay every merchant for this run's slot, exactly once (``ledger.pay``)."""
    return pay(self)
