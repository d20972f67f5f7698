"""Celery app of the Django test project, for real ``celery worker`` processes.

Environment: ``RB_BROKER_URL`` (Redis), ``RB_DATABASE_URL`` (PostgreSQL: Django's database
and the store), ``RB_DJANGO_DRIVER`` (``psycopg`` or ``psycopg2``), ``RB_LEASE_SECONDS``.
Celery's Django fix-up is active (``DJANGO_SETTINGS_MODULE`` is set), so prefork children
close inherited Django connections as in a real Django project.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djsettings")

import django

django.setup()

from celery import Celery  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from djshop.models import Audit, Payout  # noqa: E402
from djtables import progress  # noqa: E402

from reliable_beat.celery.task import IdempotentTask  # noqa: E402

app = Celery("djtask_app", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.update(
    broker_transport_options={"visibility_timeout": 5, "unacked_restore_interval": 1,
                              "unacked_restore_throttle": 1, "unacked_mutex_expire": 3},
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    reliable_beat_database_url=os.environ["RB_STORE_URL"],
    reliable_beat_lease_seconds=float(os.environ.get("RB_LEASE_SECONDS", "2")),
    reliable_beat_retry_base_seconds=1.0,
)

def _mark(task: IdempotentTask, what: str) -> None:
    """Committed at once on the store's own connection (visible while the body waits)."""
    with task.store.begin() as conn:
        conn.execute(progress.insert().values(
            key=task.idempotency_key, fence=task.fence_token, pid=os.getpid(), what=what))


class PayTask(IdempotentTask):
    def idempotency_key_for(self, merchant: str, *args: Any, **kwargs: Any) -> str | None:
        return f"pay:{merchant}"


@app.task(base=PayTask, bind=True, name="dj.pay")
def pay(self: IdempotentTask, merchant: str, sleep_first_attempt: float = 0.0) -> dict[str, Any]:
    """One payout through the ORM (+ a signal's write, a nested savepoint's bulk_create, a
    row lock, an outbox row), all in Django's transaction with the key."""
    with self.transaction(using="default") as tx:
        payout = Payout.objects.create(key=self.idempotency_key, fence=self.fence_token,
                                       run_id=self.run_id, pid=os.getpid())
        with transaction.atomic():  # a savepoint in user code
            Audit.objects.bulk_create([
                Audit(key=self.idempotency_key, fence=self.fence_token, what=f"line{i}")
                for i in (1, 2)
            ])
        locked = list(Payout.objects.select_for_update().filter(pk=payout.pk))
        assert locked and locked[0].fence == self.fence_token
        self.outbox.add(tx, "hook", {"merchant": merchant, "payout": payout.pk})
        _mark(self, "in_body")
        if self.attempt == 1 and sleep_first_attempt:
            deadline = time.monotonic() + sleep_first_attempt
            while time.monotonic() < deadline:
                time.sleep(0.05)
    return {"merchant": merchant, "payout": payout.pk, "fence": self.fence_token}


@app.task(base=PayTask, bind=True, name="dj.pay_on")
def pay_on(self: IdempotentTask, merchant: str, alias: str) -> dict[str, Any]:
    """One payout written on Django database ``alias`` (``using=`` as a router would pick)."""
    with self.transaction(using=alias):
        Payout.objects.using(alias).create(key=self.idempotency_key, fence=self.fence_token,
                                           run_id=self.run_id, pid=os.getpid())
        seen = {name: connections[name].in_atomic_block for name in ("default", alias)}
    return seen


@app.task(base=PayTask, bind=True, name="dj.pay_plain")
def pay_plain(self: IdempotentTask, merchant: str) -> int:
    """The README's form, ``self.transaction()`` without ``using=``: a payout through the ORM
    (and its signal's write) and an outbox row."""
    with self.transaction() as tx:
        payout = Payout.objects.create(key=self.idempotency_key, fence=self.fence_token,
                                       run_id=self.run_id, pid=os.getpid())
        self.outbox.add(tx, "hook", {"merchant": merchant, "payout": payout.pk})
        self.returns(payout.pk)
    return int(payout.pk)


@app.task(base=PayTask, bind=True, name="dj.pay_via")
def pay_via(self: IdempotentTask, merchant: str, alias: str, read_on: str = "") -> str:
    """``self.transaction()`` without ``using=``, the payout written on Django database
    ``alias`` (after a read and a savepoint on ``read_on``); returns the block's alias."""
    with self.transaction():
        block = next((a for a in ("default", "other", "second")
                      if connections[a].in_atomic_block), "")
        if read_on:
            with transaction.atomic(using=read_on):
                Payout.objects.using(read_on).filter(key=self.idempotency_key).count()
        Payout.objects.using(alias).create(key=self.idempotency_key, fence=self.fence_token,
                                           run_id=self.run_id, pid=os.getpid())
    return block


@app.task(base=PayTask, bind=True, name="dj.pay_then_sql")
def pay_then_sql(self: IdempotentTask, merchant: str, alias: str, statements: list[str],
                 composed: bool = False, atomic: bool = False) -> list[list[Any]]:
    """``self.transaction()`` without ``using=``: a payout through the ORM, then each of
    ``statements`` as raw SQL on Django database ``alias``'s cursor (as psycopg's
    ``sql.SQL`` with ``composed``; inside ``atomic(using=alias)`` with ``atomic``); returns
    the rows the last one read."""
    from django.db.backends.postgresql.psycopg_any import sql

    with self.transaction():
        Payout.objects.create(key=self.idempotency_key, fence=self.fence_token,
                              run_id=self.run_id, pid=os.getpid())
        scope = transaction.atomic(using=alias) if atomic else contextlib.nullcontext()
        with scope, connections[alias].cursor() as cur:
            for statement in statements:
                cur.execute(sql.SQL(statement) if composed else statement)
            rows = [list(row) for row in cur.fetchall()] if cur.description else []
    return rows


@app.task(name="dj.notify")
def notify(**fields: Any) -> None:
    """A plain task taking any keyword arguments (the admin's secrets tests give it an
    ``api_key``)."""
