"""The acceptance tests' app (:mod:`rb_task_app`) plus the tasks of issue 12's value tests.

Run as ``celery -A values_app worker``: the app, its settings and its tables are
:mod:`rb_task_app`'s; the result backend is the broker's Redis, so a test can read what
the caller sees (``AsyncResult.get``).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any

from rb_task_app import EffectTask, _mark, app, effects

from reliable_beat.celery.task import IdempotentTask

app.conf.update(result_backend=os.environ.get("RB_BROKER_URL", "cache+memory://"))

AMOUNT = Decimal("12.50")
AT = datetime(2026, 3, 1, 12, 30, tzinfo=timezone.utc)
REF = uuid.UUID("12345678-1234-5678-1234-567812345678")


def _effect(task: IdempotentTask) -> None:
    with task.transaction() as tx:
        tx.execute(effects.insert().values(
            key=task.idempotency_key, fence=task.fence_token, run_id=task.run_id,
            pid=os.getpid()))


@app.task(base=EffectTask, bind=True, name="rb.values.typed_result", ignore_result=False)
def typed_result(self: IdempotentTask, name: str, use_transaction: bool) -> dict[str, Any]:
    """One effect (in self.transaction() or in a transaction of the body's own), then a
    result of Decimal / datetime / UUID / date."""
    if use_transaction:
        _effect(self)
    else:
        with self.store.begin() as conn:
            conn.execute(effects.insert().values(
                key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
                pid=os.getpid()))
    return {"amount": AMOUNT, "at": AT, "ref": REF, "day": AT.date()}


@app.task(base=EffectTask, bind=True, name="rb.values.echo_args", ignore_result=False)
def echo_args(
    self: IdempotentTask, name: str, when: datetime, amount: Decimal, ref: uuid.UUID,
    day: date | None = None,
) -> list[str]:
    """One effect; returns the type names of the arguments as the body received them."""
    _effect(self)
    return [type(v).__name__ for v in (when, amount, ref, day)]


@app.task(base=EffectTask, bind=True, name="rb.values.hold", max_retries=1,
          ignore_result=False)
def hold(self: IdempotentTask, name: str, seconds: float) -> str:
    """One effect; the first try keeps the lease (renewed) ``seconds`` before committing.
    ``max_retries=1``: a second message for the key waits on that lease without using it."""
    with self.transaction() as tx:
        tx.execute(effects.insert().values(
            key=self.idempotency_key, fence=self.fence_token, run_id=self.run_id,
            pid=os.getpid()))
        _mark(self, "in_body")
        if self.attempt == 1:
            time.sleep(seconds)
    return "held"


@app.task(base=EffectTask, bind=True, name="rb.values.poison", max_retries=2)
def poison(self: IdempotentTask, name: str) -> str:
    """Kills its worker process on every try (a poison message); ``max_retries=2``."""
    _mark(self, "in_body")
    os._exit(9)
