"""The payouts example's task and schedule, tested with the users' testing kit (dogfood,
issue 19): the five questions on ``payouts.pay_merchants``, and its nightly entry driven
through Europe/Berlin's spring-forward day on the scheduler clock.

The real-process run of the example is ``tests/acceptance/test_example_payouts.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from examples.payouts import app as payouts
from reliable_beat import testing as rbt
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox

SLOT_KEY = "pay-merchants@2026-03-29T01:00:00Z"


@pytest.fixture
def app(rb_store: Store) -> Iterator[Any]:
    payouts.metadata.create_all(rb_store.engine)
    with rbt.use_store(payouts.app, rb_store) as app:
        yield app


def paid(key: str) -> rbt.Probe:
    """Payout rows of the slot named by ``key`` (one per merchant per slot)."""
    slot = key.rsplit("@", 1)[-1]
    return sa.select(sa.func.count()).select_from(payouts.payouts).where(
        payouts.payouts.c.slot == slot)


ONE_SET = len(payouts.MERCHANTS)  # a slot pays each merchant once


@pytest.mark.parametrize("question", ["run_twice", "run_concurrently", "die_mid_run",
                                      "fail_then_retry"])
def test_pay_merchants_answers_the_questions(app: Any, rb_store: Store, question: str) -> None:
    helper = getattr(rbt, question)
    evidence = helper(payouts.pay_merchants, key=SLOT_KEY, effects=paid(SLOT_KEY),
                      per_run=ONE_SET)
    assert evidence.effects == ONE_SET
    with rb_store.engine.connect() as conn:
        webhooks = conn.execute(sa.select(sa.func.count()).select_from(outbox).where(
            outbox.c.destination == "webhook")).scalar()
        ledger = conn.execute(sa.select(sa.func.sum(payouts.ledger.c.delta_cents))).scalar()
    assert webhooks == ONE_SET  # one notification per merchant, never two
    assert ledger == 0  # every payable has its bank row


def test_pay_merchants_stale_runner_pays_nothing(app: Any) -> None:
    evidence = rbt.stale_runner(payouts.pay_merchants, key=SLOT_KEY, effects=paid(SLOT_KEY))
    assert evidence.outcomes == ["fenced_out"]


def test_nightly_entry_on_the_spring_forward_day(rb_store: Store) -> None:
    """The example's entry with its real nightly schedule (``0 2 * * *``, the app's
    timezone Europe/Berlin): 02:00 does not exist on 2026-03-29; it fires once, at 01:00Z
    (the wall time read with the offset before the gap, docs/dst.md)."""
    entry = dict(payouts.app.conf.beat_schedule["pay-merchants"], schedule="0 2 * * *")
    clock = rbt.SchedulerClock(rb_store, datetime(2026, 3, 27, 12, tzinfo=timezone.utc))
    clock.sync({"pay-merchants": entry}, timezone=payouts.app.conf.timezone)
    window = clock.run_until(datetime(2026, 3, 31, tzinfo=timezone.utc))
    assert [f"{s:%m-%d %H:%M}Z" for s in window.fired_at("pay-merchants")] == [
        "03-28 01:00Z", "03-29 01:00Z", "03-30 00:00Z"]
    assert window.skipped == []
