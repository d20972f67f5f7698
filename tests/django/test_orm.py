"""The ORM and reliable_beat's writes in one Django transaction, in-process (eager task,
views, nested and outer ``atomic()``), on a real PostgreSQL (run by
``tests/integration/test_django.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import transaction
from django.test import Client
from djshop.models import Audit, Payout
from djtables import meta
from djtables import payouts as payouts_t

from reliable_beat import outbox, runs
from reliable_beat.contrib.django import atomic_connection, conf
from reliable_beat.db.tables import outbox as outbox_t


@pytest.fixture(scope="module", autouse=True)
def tables() -> None:
    call_command("migrate", verbosity=0)
    meta.create_all(conf.store().engine)


def outbox_ids(like: str) -> list[str]:
    with conf.store().engine.connect() as conn:
        return list(conn.execute(sa.select(outbox_t.c.message_id).where(
            outbox_t.c.message_id.like(like))).scalars())


def payouts(key: str) -> list[dict[str, Any]]:
    with conf.store().engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            sa.select(payouts_t).where(payouts_t.c.key == key)).mappings()]


def test_orm_row_and_outbox_row_roll_back_and_commit_together() -> None:
    with pytest.raises(RuntimeError), atomic_connection() as tx:
        Payout.objects.create(key="tx:1", fence=0, run_id=0, pid=0)
        outbox.add(tx, "webhook", {"destination": "d", "path": "/n", "body": {"n": 1}}, key="tx:1")
        assert Payout.objects.filter(key="tx:1").count() == 1  # the ORM sees it inside
        raise RuntimeError("boom")
    assert payouts("tx:1") == [] and outbox_ids("tx:1") == []
    with atomic_connection("default") as tx:
        Payout.objects.create(key="tx:1", fence=0, run_id=0, pid=0)
        outbox.add(tx, "webhook", {"destination": "d", "path": "/n", "body": {"n": 1}}, key="tx:1")
    assert len(payouts("tx:1")) == 1 and outbox_ids("tx:1") == ["tx:1"]


def test_a_caught_savepoint_rollback_inside_the_block_keeps_the_rest() -> None:
    with atomic_connection() as tx:
        Payout.objects.create(key="sp:kept", fence=0, run_id=0, pid=0)
        try:
            with transaction.atomic():
                Payout.objects.create(key="sp:undone", fence=0, run_id=0, pid=0)
                raise ValueError("undo the savepoint only")
        except ValueError:
            pass
        outbox.add(tx, "webhook", {"destination": "d", "path": "/n", "body": {"n": 2}},
                   key="sp:msg")
    assert len(payouts("sp:kept")) == 1 and payouts("sp:undone") == []
    assert outbox_ids("sp:msg") == ["sp:msg"]


def test_view_under_atomic_requests_commits_order_and_message_together() -> None:
    c = Client(raise_request_exception=False)
    assert c.get("/order/o1/").status_code == 200
    assert len(payouts("order:o1")) == 1 and outbox_ids("order:o1") == ["order:o1"]
    # The view fails after its block: ATOMIC_REQUESTS rolls the request back, both go.
    assert c.get("/order/o2/?fail=1").status_code == 500
    assert payouts("order:o2") == [] and outbox_ids("order:o2") == []


def test_eager_task_inside_an_outer_atomic_commits_with_it() -> None:
    from djtask_app import pay

    store = conf.store()
    with transaction.atomic():
        res = pay.apply(args=["eager1"])
        # completed inside this open transaction: the store's own connection sees no commit
        assert runs.get_run(store, "pay:eager1")["state"] == "running"
        assert payouts("pay:eager1") == []
    assert res.successful(), res.traceback
    run = runs.get_run(store, "pay:eager1")
    assert run["state"] == "succeeded"
    [row] = payouts("pay:eager1")
    assert run["result"] == {"merchant": "eager1", "payout": row["id"], "fence": 1}
    assert sorted(Audit.objects.filter(key="pay:eager1").values_list("what", flat=True)) == [
        "line1", "line2", "signal"]


def test_eager_task_inside_an_outer_atomic_that_rolls_back_leaves_no_effect() -> None:
    from djtask_app import pay

    store = conf.store()
    with pytest.raises(RuntimeError), transaction.atomic():
        assert pay.apply(args=["eager2"]).successful()
        raise RuntimeError("the caller's transaction fails")
    run = runs.get_run(store, "pay:eager2")
    assert run["state"] == "running" and run["result"] is None  # not succeeded: redone later
    assert payouts("pay:eager2") == [] and outbox_ids("pay:eager2#%") == []


def test_eager_task_on_its_own_commits_effect_key_result_and_message() -> None:
    from djtask_app import pay

    assert pay.apply(args=["eager3"]).successful()
    run = runs.get_run(conf.store(), "pay:eager3")
    assert run["state"] == "succeeded" and run["result"]["merchant"] == "eager3"
    assert len(payouts("pay:eager3")) == 1 and outbox_ids("pay:eager3#%") == ["pay:eager3#1"]
    # called again: deduplicated, the body does not run again
    assert pay.apply(args=["eager3"]).get() == run["result"]
    assert len(payouts("pay:eager3")) == 1


def test_using_selects_the_alias_whose_connection_holds_the_transaction() -> None:
    from djtask_app import pay_on

    res = pay_on.apply(args=["alias1", "other"])
    assert res.successful(), res.traceback
    assert res.get() == {"default": False, "other": True}  # the block ran on "other"
    assert runs.get_run(conf.store(), "pay:alias1")["state"] == "succeeded"
    assert len(payouts("pay:alias1")) == 1


def test_an_alias_on_another_database_is_refused_naming_both() -> None:
    from djtask_app import pay_on

    res = pay_on.apply(args=["alias2", "elsewhere"])
    assert res.failed()
    message = str(res.result)
    assert "/postgres" in message and "not the reliable_beat store" in message, message
    assert payouts("pay:alias2") == []
    assert runs.get_run(conf.store(), "pay:alias2")["state"] in ("dead", "retrying")


def test_an_unknown_alias_is_a_clear_error() -> None:
    from reliable_beat.contrib.django import database_url
    from reliable_beat.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"'nope' is not in settings\.DATABASES"):
        database_url("nope")
    with pytest.raises(ConfigurationError, match="'nope'"), atomic_connection("nope"):
        pass


def test_default_database_url_is_the_django_database() -> None:
    from reliable_beat.contrib.django import database_url, default_database_url

    assert default_database_url() == database_url("default")


def test_using_with_bind_is_refused() -> None:
    from djtask_app import app

    from reliable_beat.celery.task import IdempotentTask

    @app.task(base=IdempotentTask, bind=True, name="dj.both", max_attempts=1)
    def both(self: IdempotentTask) -> None:
        with self.transaction(using="default", bind=conf.store().engine):
            pass

    res = both.apply(headers={"reliable_beat_key": "both:1"})
    assert res.failed() and "not both" in str(res.result)
