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
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    create_engine,
    insert,
    select,
)

from reliable_beat import IdempotentTask

WORKDIR = Path(os.environ.get("PAYOUTS_DIR", ".payouts-demo")).resolve()
DATABASE_URL = os.environ.get(
    "RELIABLE_BEAT_DATABASE_URL", f"sqlite:///{WORKDIR / 'payouts.sqlite3'}"
)
BROKER_URL = os.environ.get("PAYOUTS_BROKER_URL", "filesystem://")
MERCHANTS = ["acme", "globex", "initech"]
WEBHOOK_URL = os.environ.get("PAYOUTS_WEBHOOK_URL", "http://127.0.0.1:8765/hook")
# Rows name a destination; only the operator's configuration says where it is.
_hook = urlsplit(WEBHOOK_URL)
WEBHOOK_BASE, WEBHOOK_PATH = f"{_hook.scheme}://{_hook.netloc}", _hook.path or "/"

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
            # Demo mode: every 5 s (croniter order: seconds LAST). Real config: "0 2 * * *".
            "schedule": os.environ.get("PAYOUTS_SCHEDULE", "* * * * * */5"),
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

# -- the application's own tables, in the same database as reliable_beat's ---------------
metadata = MetaData()
payouts = Table(
    "payouts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("merchant", String(50), nullable=False),
    Column("slot", String(40), nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("run_id", BigInteger, nullable=False),  # stamp: a bad run can be found as a set
    Column("fence_token", BigInteger, nullable=False),
    UniqueConstraint("merchant", "slot"),
)
ledger = Table(
    "ledger",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("merchant", String(50), nullable=False),
    Column("slot", String(40), nullable=False),
    Column("account", String(20), nullable=False),  # payable | bank
    Column("delta_cents", BigInteger, nullable=False),
    Column("run_id", BigInteger, nullable=False),
)


def create_app_tables() -> None:
    """Create the example's own tables (an app would use its own migrations)."""
    engine = create_engine(DATABASE_URL)
    metadata.create_all(engine)
    engine.dispose()


def owed_cents(merchant: str, slot: str) -> int:
    """What ``merchant`` is owed for ``slot``: deterministic, so a replay computes the same."""
    return 1000 + sum(ord(c) for c in merchant + slot) % 500


@app.task(base=IdempotentTask, bind=True, name="payouts.pay_merchants")
def pay_merchants(self: Any) -> dict[str, int]:
    """Pay every merchant for this run's slot, exactly once."""
    slot = self.idempotency_key.rsplit("@", 1)[-1]
    delay = float(os.environ.get("PAYOUTS_BODY_SECONDS", "0"))
    total = 0
    with self.transaction() as tx:
        for merchant in MERCHANTS:
            amount = owed_cents(merchant, slot)
            tx.execute(
                insert(payouts).values(
                    merchant=merchant, slot=slot, amount_cents=amount, run_id=self.run_id,
                    fence_token=self.fence_token,
                )
            )
            tx.execute(
                insert(ledger),
                [
                    {"merchant": merchant, "slot": slot, "account": "payable",
                     "delta_cents": -amount, "run_id": self.run_id},
                    {"merchant": merchant, "slot": slot, "account": "bank",
                     "delta_cents": amount, "run_id": self.run_id},
                ],
            )
            # The built-in `webhook` handler POSTs `body` to the operator-configured
            # destination's base URL + `path`, with an Idempotency-Key header derived from
            # this outbox row (stable across retries and relays).
            self.outbox.add(
                tx, "webhook",
                {"destination": "merchants", "path": WEBHOOK_PATH,
                 "body": {"merchant": merchant, "slot": slot, "amount_cents": amount}},
                ordering_key=merchant,
            )
            total += amount
        if delay:
            import time

            time.sleep(delay)  # "break it" mode: widen the window for kills and pauses
    return {"merchants": len(MERCHANTS), "total_cents": total}


def total_paid(conn: Any) -> int:
    return int(sum(r.amount_cents for r in conn.execute(select(payouts.c.amount_cents))))
