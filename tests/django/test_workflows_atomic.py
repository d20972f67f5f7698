"""Workflow start and signal on Django's own connection, inside ``transaction.atomic()``
(``atomic_connection()``): an order written with the ORM and its workflow start (or a
signal) commit together or roll back together, on the child's real PostgreSQL with psycopg 3
and psycopg2 (run by tests/integration/test_django.py)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import transaction
from django.test import Client
from djshop.models import Payout
from djtables import meta

from reliable_beat import workflows as wf
from reliable_beat.contrib.django import atomic_connection, conf
from reliable_beat.db.tables import outbox as outbox_t

NAME = "djshop.fulfil"


@pytest.fixture(scope="module", autouse=True)
def tables() -> None:
    call_command("migrate", verbosity=0)
    meta.create_all(conf.store().engine)


def wakes(workflow_id: str) -> list[str]:
    with conf.store().engine.connect() as conn:
        return list(conn.execute(sa.select(outbox_t.c.message_id).where(
            outbox_t.c.message_id.like(f"wake:{workflow_id}:%")).order_by(
            outbox_t.c.id)).scalars())


def status(workflow_id: str) -> dict[str, Any] | None:
    try:
        return wf.get_workflow(conf.store(), workflow_id, events=True)
    except wf.WorkflowNotFound:
        return None


def test_start_rolls_back_with_the_order_and_commits_with_it() -> None:
    with pytest.raises(RuntimeError), atomic_connection() as tx:
        Payout.objects.create(key="wf:o1", fence=0, run_id=0, pid=0)
        handle = wf.start(tx, NAME, "wf:o1", args=["o1"])
        assert handle.created
        raise RuntimeError("the order failed")
    assert status("wf:o1") is None and wakes("wf:o1") == []
    assert not Payout.objects.filter(key="wf:o1").exists()

    with atomic_connection("default") as tx:
        Payout.objects.create(key="wf:o1", fence=0, run_id=0, pid=0)
        handle = wf.start(tx, NAME, "wf:o1", args=["o1"])
        # not committed yet: the store's own connection does not see it
        assert status("wf:o1") is None
    row = status("wf:o1")
    assert row is not None and row["state"] == "pending" and row["name"] == NAME
    assert wakes("wf:o1") == ["wake:wf:o1:start"]
    assert Payout.objects.filter(key="wf:o1").count() == 1


def test_definition_start_with_conn_and_a_nested_savepoint() -> None:
    fulfil = wf.WorkflowDefinition(name=NAME, fn=lambda ctx, order: order)
    with atomic_connection() as tx:
        Payout.objects.create(key="wf:o2", fence=0, run_id=0, pid=0)
        try:
            with transaction.atomic():  # a savepoint the caller rolls back: only its rows
                Payout.objects.create(key="wf:o2-undone", fence=0, run_id=0, pid=0)
                raise ValueError("undo")
        except ValueError:
            pass
        fulfil.start("wf:o2", args=["o2"], conn=tx)
    assert status("wf:o2") is not None and wakes("wf:o2") == ["wake:wf:o2:start"]
    assert not Payout.objects.filter(key="wf:o2-undone").exists()


def test_signal_rolls_back_with_the_block_and_commits_with_it() -> None:
    wf.start(conf.store(), NAME, "wf:o3", args=["o3"])
    before = status("wf:o3")
    assert before is not None
    with pytest.raises(RuntimeError), atomic_connection() as tx:
        Payout.objects.create(key="wf:o3-approved", fence=0, run_id=0, pid=0)
        assert wf.signal(tx, "wf:o3", "approved", {"by": "alice"}, key="approve:o3")
        raise RuntimeError("the approval failed")
    after = status("wf:o3")
    assert after is not None and after["signals"] == [] and after["wake_seq"] == before[
        "wake_seq"]
    assert wakes("wf:o3") == ["wake:wf:o3:start"]

    with atomic_connection() as tx:
        Payout.objects.create(key="wf:o3-approved", fence=0, run_id=0, pid=0)
        assert wf.signal(tx, "wf:o3", "approved", {"by": "alice"}, key="approve:o3")
    after = status("wf:o3")
    assert after is not None and [s["name"] for s in after["signals"]] == ["approved"]
    assert len(wakes("wf:o3")) == 2 and Payout.objects.filter(key="wf:o3-approved").exists()
    with atomic_connection() as tx:  # the same key again: a no-op
        assert not wf.signal(tx, "wf:o3", "approved", {"by": "alice"}, key="approve:o3")
    assert len(wakes("wf:o3")) == 2


def test_view_under_atomic_requests_commits_order_and_workflow_together() -> None:
    c = Client(raise_request_exception=False)
    assert c.get("/checkout/c1/").status_code == 200
    assert status("checkout:c1") is not None and wakes("checkout:c1") == [
        "wake:checkout:c1:start"]
    assert Payout.objects.filter(key="checkout:c1").exists()
    assert c.get("/checkout/c2/?fail=1").status_code == 500
    assert status("checkout:c2") is None and wakes("checkout:c2") == []
    assert not Payout.objects.filter(key="checkout:c2").exists()


def test_an_orm_write_inside_ctx_transaction_is_refused_naming_the_fix() -> None:
    """``ctx.transaction(fn)`` runs ``fn`` on the store's own connection: an ORM write in
    it would commit on Django's, outside the history record (repeated by a re-run of the
    advance). It is refused, recorded as the step's failure, and nothing is written."""
    from reliable_beat.workflows import engine

    def write_orm(conn: Any) -> int:
        return int(Payout.objects.create(key="wf:o4", fence=0, run_id=0, pid=0).pk)

    def flow(ctx: Any) -> str:
        try:
            ctx.transaction(write_orm, name="write_orm")
        except wf.ActivityError as exc:
            return f"{exc.type}: {exc}"
        return "written"

    wf.workflow(name="djshop.orm_in_tx")(flow)
    engine.start(conf.store(), "djshop.orm_in_tx", "wf:o4")
    engine.advance(conf.store(), "wf:o4", owner="test")
    row = status("wf:o4")
    assert row is not None and row["state"] == "completed", row
    result = str(row["result"])
    assert result.startswith("ConfigurationError"), result
    assert "Django database 'default' inside ctx.transaction()" in result
    assert "write the effect through conn" in result
    assert not Payout.objects.filter(key="wf:o4").exists()
