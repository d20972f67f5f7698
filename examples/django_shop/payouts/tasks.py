"""``shop.pay_merchants``: every slot pays each merchant once, through the ORM.

The payout rows, the ledger lines and the merchants' webhook notifications (outbox rows) are
written in ``self.transaction(using="default")``, i.e. ``transaction.atomic()`` on Django's
connection, which also records the run's key as succeeded, fenced. A duplicate trigger, a
redelivery, a retry or a worker that was frozen past its lease can never pay twice.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task

from examples.django_shop.payouts.models import MERCHANTS, LedgerLine, Payout
from reliable_beat.celery import IdempotentTask


def owed_cents(merchant: str, slot: str) -> int:
    """What ``merchant`` is owed for ``slot``: deterministic, so a replay computes the same."""
    return 1000 + sum(ord(c) for c in merchant + slot) % 500


@shared_task(base=IdempotentTask, bind=True, name="shop.pay_merchants")
def pay_merchants(self: Any) -> dict[str, int]:
    slot = self.idempotency_key.rsplit("@", 1)[-1]
    total = 0
    with self.transaction(using="default") as tx:
        for merchant in MERCHANTS:
            amount = owed_cents(merchant, slot)
            Payout.objects.create(merchant=merchant, slot=slot, amount_cents=amount,
                                  run_id=self.run_id, fence_token=self.fence_token)
            LedgerLine.objects.bulk_create([
                LedgerLine(merchant=merchant, slot=slot, account="payable",
                           delta_cents=-amount, run_id=self.run_id),
                LedgerLine(merchant=merchant, slot=slot, account="bank",
                           delta_cents=amount, run_id=self.run_id),
            ])
            self.outbox.add(
                tx, "webhook",
                {"destination": "merchants", "path": "/hook",
                 "body": {"merchant": merchant, "slot": slot, "amount_cents": amount}},
                ordering_key=merchant,
            )
            total += amount
        delay = float(os.environ.get("SHOP_BODY_SECONDS", "0"))
        if delay:
            time.sleep(delay)  # --break-it: widen the window for kills and pauses
    return {"merchants": len(MERCHANTS), "total_cents": total}
