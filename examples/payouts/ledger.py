"""The payouts example's own tables and the effect of one slot, shared by the Celery app
(:mod:`examples.payouts.app`) and the Dramatiq app (:mod:`examples.payouts.dq_app`).
Imports neither framework.

``pay(run)`` pays every merchant for the run's slot in ONE transaction with the run's
idempotency key: one payout row and two ledger rows per merchant, plus an outbox message that
notifies the merchant by webhook. ``run`` is the Celery ``IdempotentTask`` (``self``) or the
Dramatiq run context (``reliable_beat.dramatiq.current()``): both have ``idempotency_key``,
``run_id``, ``fence_token``, ``transaction()`` and ``outbox.add``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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

__all__ = [
    "DATABASE_URL", "MERCHANTS", "SCHEDULE", "WEBHOOK_BASE", "WEBHOOK_PATH", "WORKDIR",
    "create_app_tables", "ledger", "owed_cents", "pay", "payouts", "total_paid",
]

WORKDIR = Path(os.environ.get("PAYOUTS_DIR", ".payouts-demo")).resolve()
DATABASE_URL = os.environ.get(
    "RELIABLE_BEAT_DATABASE_URL", f"sqlite:///{WORKDIR / 'payouts.sqlite3'}"
)
MERCHANTS = ["acme", "globex", "initech"]
WEBHOOK_URL = os.environ.get("PAYOUTS_WEBHOOK_URL", "http://127.0.0.1:8765/hook")
# Rows name a destination; only the operator's configuration says where it is.
_hook = urlsplit(WEBHOOK_URL)
WEBHOOK_BASE, WEBHOOK_PATH = f"{_hook.scheme}://{_hook.netloc}", _hook.path or "/"
#: Demo mode: every 5 s (croniter order: seconds LAST). Real config: "0 2 * * *".
SCHEDULE = os.environ.get("PAYOUTS_SCHEDULE", "* * * * * */5")

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


def pay(run: Any) -> dict[str, int]:
    """Pay every merchant for ``run``'s slot, exactly once (see the module docstring)."""
    slot = run.idempotency_key.rsplit("@", 1)[-1]
    delay = float(os.environ.get("PAYOUTS_BODY_SECONDS", "0"))
    total = 0
    with run.transaction() as tx:
        for merchant in MERCHANTS:
            amount = owed_cents(merchant, slot)
            tx.execute(
                insert(payouts).values(
                    merchant=merchant, slot=slot, amount_cents=amount, run_id=run.run_id,
                    fence_token=run.fence_token,
                )
            )
            tx.execute(
                insert(ledger),
                [
                    {"merchant": merchant, "slot": slot, "account": "payable",
                     "delta_cents": -amount, "run_id": run.run_id},
                    {"merchant": merchant, "slot": slot, "account": "bank",
                     "delta_cents": amount, "run_id": run.run_id},
                ],
            )
            # The built-in `webhook` handler POSTs `body` to the operator-configured
            # destination's base URL + `path`, with an Idempotency-Key header derived from
            # this outbox row (stable across retries and relays).
            run.outbox.add(
                tx, "webhook",
                {"destination": "merchants", "path": WEBHOOK_PATH,
                 "body": {"merchant": merchant, "slot": slot, "amount_cents": amount}},
                ordering_key=merchant,
            )
            total += amount
        if delay:
            time.sleep(delay)  # "break it" mode: widen the window for kills and pauses
    return {"merchants": len(MERCHANTS), "total_cents": total}


def total_paid(conn: Any) -> int:
    return int(sum(r.amount_cents for r in conn.execute(select(payouts.c.amount_cents))))
