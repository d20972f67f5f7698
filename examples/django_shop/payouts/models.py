"""The shop's own tables, written through the ORM by the payout task."""

from __future__ import annotations

from django.db import models

MERCHANTS = ["acme", "globex", "initech"]


class Payout(models.Model):
    merchant = models.CharField(max_length=50)
    slot = models.CharField(max_length=40)
    amount_cents = models.BigIntegerField()
    run_id = models.BigIntegerField()  # stamp: a bad run's rows can be found as a set
    fence_token = models.BigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["merchant", "slot"],
                                               name="one_payout_per_merchant_slot")]


class LedgerLine(models.Model):
    merchant = models.CharField(max_length=50)
    slot = models.CharField(max_length=40)
    account = models.CharField(max_length=20)  # payable | bank
    delta_cents = models.BigIntegerField()
    run_id = models.BigIntegerField()
