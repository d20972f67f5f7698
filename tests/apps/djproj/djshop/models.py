"""The test shop's tables: created by the tests (SQLAlchemy), not by Django migrations."""

from __future__ import annotations

from django.db import models
from django.db.models.signals import post_save
from django.dispatch import receiver


class Payout(models.Model):
    key = models.CharField(max_length=200)
    fence = models.IntegerField()
    run_id = models.IntegerField()
    pid = models.IntegerField()

    class Meta:
        managed = False
        db_table = "dj_payouts"


class Audit(models.Model):
    key = models.CharField(max_length=200)
    fence = models.IntegerField()
    what = models.CharField(max_length=50)

    class Meta:
        managed = False
        db_table = "dj_audit"


@receiver(post_save, sender=Payout)
def _audit_payout(sender: type, instance: Payout, created: bool, **kwargs: object) -> None:
    """A signal handler's write: it must commit or roll back with the payout."""
    if created:  # on the payout's database (a write elsewhere would leave its transaction)
        Audit.objects.using(str(kwargs["using"])).create(key=instance.key, fence=instance.fence,
                                                         what="signal")
