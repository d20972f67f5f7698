"""``self.transaction()`` without ``using=`` in a Django project keeps exactly-once (design.md
invariant 10): the block joins Django's connection when the store is a Django database, and
an ORM write on another connection inside it is refused naming ``using=``. Checked with the
testing kit (``fail_then_retry``, ``die_mid_run``, ``stale_runner``) on the child's real
PostgreSQL, psycopg 3 and psycopg2 (run by tests/integration/test_django.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import connections
from djshop.models import Payout
from djtables import meta
from djtables import payouts as payouts_t

from reliable_beat import runs, testing
from reliable_beat.contrib.django import conf
from reliable_beat.contrib.django.join import is_write
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import outbox as outbox_t


@pytest.fixture(scope="module", autouse=True)
def tables() -> None:
    call_command("migrate", verbosity=0)
    meta.create_all(conf.store().engine)


def probe(key: str) -> sa.Select[Any]:
    return sa.select(sa.func.count()).select_from(payouts_t).where(payouts_t.c.key == key)


def outbox_rows(key: str) -> int:
    with conf.store().engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(outbox_t).where(
            outbox_t.c.message_id.like(f"{key}#%"))).scalar_one())


def test_fail_then_retry_without_using_gives_one_effect() -> None:
    from djtask_app import pay_plain

    ev = testing.fail_then_retry(pay_plain, ["retry1"], effects=probe("pay:retry1"))
    assert ev.effects == 1 and outbox_rows("pay:retry1") == 1
    assert [a["outcome"] for a in ev.attempts] == ["retrying", "succeeded"]


def test_die_mid_run_before_commit_without_using_gives_one_effect() -> None:
    from djtask_app import pay_plain

    ev = testing.die_mid_run(pay_plain, ["crash1"], effects=probe("pay:crash1"),
                             at="before_commit")
    assert ev.effects == 1 and ev.outcomes == ["crashed", "succeeded"]
    # the crashed attempt's ORM row did not commit: the one left is the redelivery's
    [row] = Payout.objects.filter(key="pay:crash1")
    assert row.fence == runs.get_run(conf.store(), "pay:crash1")["fence_token"] > 1


def test_stale_runner_without_using_leaves_nothing() -> None:
    from djtask_app import pay_plain

    ev = testing.stale_runner(pay_plain, ["stale1"], effects=probe("pay:stale1"))
    assert ev.effects == 0 and ev.outcomes == ["fenced_out"]
    assert outbox_rows("pay:stale1") == 0


def test_the_block_runs_on_the_store_alias_and_reads_elsewhere_pass() -> None:
    from djtask_app import pay_via

    # a read and a savepoint on another alias inside the block are let through
    res = pay_via.apply(args=["via1", "default"], kwargs={"read_on": "other"})
    assert res.successful(), res.traceback
    assert res.get() == "default"
    assert runs.get_run(conf.store(), "pay:via1")["state"] == "succeeded"
    assert Payout.objects.filter(key="pay:via1").count() == 1


@pytest.mark.parametrize("alias", ["other", "elsewhere"])
def test_a_write_on_another_alias_inside_the_block_is_refused_naming_using(
        alias: str) -> None:
    """``other`` is the store's database on another connection, ``elsewhere`` another
    database: either way the write would commit outside the key's transaction."""
    from djtask_app import pay_via

    key = f"via-{alias}"
    res = pay_via.apply(args=[key, alias])
    assert res.failed()
    message = str(res.result)
    assert f"Django database {alias!r} inside self.transaction()" in message, message
    assert "using=" in message and "runs in Django's transaction on 'default'" in message
    assert "INSERT INTO" in message
    assert Payout.objects.filter(key=f"pay:{key}").count() == 0
    run = runs.get_run(conf.store(), f"pay:{key}")
    assert run["state"] == "dead", run  # a ConfigurationError: no retry can help
    if alias == "other":  # nothing reached the other connection either
        assert not Payout.objects.using("other").filter(key=f"pay:{key}").exists()


@pytest.fixture(scope="module")
def second_store() -> Iterator[Store]:
    """The store on Django's second database (``DATABASES["second"]``), not ``default``."""
    cfg = connections.settings["second"]
    admin = sa.create_engine(sa.engine.make_url(conf.store_url()), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if not conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"),
                            {"n": cfg["NAME"]}).scalar():
            conn.execute(sa.text(f'CREATE DATABASE "{cfg["NAME"]}"'))
    url = sa.engine.make_url(conf.store_url()).set(database=cfg["NAME"])
    store = Store.from_url(url.render_as_string(hide_password=False), role="cli")
    upgrade(store)
    meta.create_all(store.engine)
    try:
        yield store
    finally:
        store.dispose()
        connections["second"].close()
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :n"), {"n": cfg["NAME"]})
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{cfg["NAME"]}"'))
        admin.dispose()


def test_store_on_the_second_alias_joins_it_and_refuses_writes_on_default(
        second_store: Store) -> None:
    from djtask_app import app, pay_via

    with testing.use_store(app, second_store):
        ev = testing.fail_then_retry(pay_via, ["two1", "second"], effects=probe("pay:two1"))
        assert ev.effects == 1
        assert Payout.objects.using("second").filter(key="pay:two1").count() == 1
        res = pay_via.apply(args=["two2", "default"])
    assert res.failed()
    message = str(res.result)
    assert "Django database 'default' inside self.transaction()" in message, message
    assert "runs in Django's transaction on 'second'" in message
    assert not Payout.objects.filter(key="pay:two2").exists()


def test_a_store_that_is_no_django_database_refuses_orm_writes_in_the_block() -> None:
    from djtask_app import app, pay_plain

    with testing.throwaway_store() as store, testing.use_store(app, store):
        res = pay_plain.apply(args=["lite1"])
        assert res.failed()
        message = str(res.result)
        assert "Django database 'default' inside self.transaction()" in message, message
        assert "not on Django's" in message and "self.transaction(using='default')" in message
        assert runs.get_run(store, "pay:lite1")["state"] == "dead"
    assert not Payout.objects.filter(key="pay:lite1").exists()


@pytest.mark.parametrize(("sql", "write"), [
    ('INSERT INTO "dj_payouts" ("key") VALUES (%s) RETURNING "id"', True),
    ('  UPDATE "dj_payouts" SET "fence" = %s', True),
    ('/* a comment */ DELETE FROM "dj_payouts" WHERE "id" = %s', True),
    ("-- note\nTRUNCATE dj_audit", True),
    ("WITH x AS (DELETE FROM dj_audit RETURNING id) SELECT count(*) FROM x", True),
    ('SELECT "id" FROM "dj_payouts" WHERE "key" = %s FOR UPDATE', False),
    ("WITH x AS (SELECT 1 AS updated) SELECT * FROM x", False),
    ('SAVEPOINT "s1_x1"', False),
    ('RELEASE SAVEPOINT "s1_x1"', False),
    ("SET TIME ZONE 'UTC'", False),
    (b"INSERT INTO t VALUES (1)", True),
])
def test_write_statements_are_told_from_reads(sql: Any, write: bool) -> None:
    assert is_write(sql) is write


@pytest.fixture
def dramatiq_stub() -> Iterator[Any]:
    """A Dramatiq ``StubBroker`` and a real ``Worker`` on the Django project's store."""
    dramatiq = pytest.importorskip("dramatiq")
    from dramatiq.brokers.stub import StubBroker

    from reliable_beat.dramatiq import ReliableBeat

    broker = StubBroker()
    broker.add_middleware(ReliableBeat(settings={
        "database_url": conf.store_url(), "retry_max_attempts": 3,
        "retry_base_seconds": 0.01, "retry_cap_seconds": 0.02, "lease_seconds": 2}))
    dramatiq.set_broker(broker)
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        yield broker
    finally:
        worker.stop()
        broker.close()


def test_dramatiq_actor_transaction_without_using_joins_and_refuses(
        dramatiq_stub: Any) -> None:
    """``current().transaction()`` of an ``IdempotentActor``: the payout written through the
    ORM before a transient failure inside the block rolls back with it (one payout after
    the retry), and a write on another alias is refused naming ``using=``."""
    import dramatiq

    from reliable_beat.dramatiq import IdempotentActor, current

    @dramatiq.actor(actor_class=IdempotentActor, broker=dramatiq_stub, queue_name="dj")
    def dq_pay(merchant: str, alias: str) -> None:
        run = current()
        with run.transaction():
            Payout.objects.using(alias).create(key=run.idempotency_key,
                                               fence=run.fence_token, run_id=run.run_id, pid=0)
            if run.attempt == 1 and alias == "default":
                raise ConnectionError("the network blinked before the commit")

    dq_pay.send_with_key("dq:m1", "m1", "default")
    dq_pay.send_with_key("dq:m2", "m2", "other")
    dramatiq_stub.join("dj", fail_fast=False)
    store = conf.store()
    assert runs.get_run(store, "dq:m1")["state"] == "succeeded"
    assert Payout.objects.filter(key="dq:m1").count() == 1
    assert runs.get_run(store, "dq:m2")["state"] == "dead"
    [dead] = runs.list_attempts(store, runs.get_run(store, "dq:m2")["id"])[-1:]
    assert "Django database 'other' inside current().transaction()" in str(dead["error"])
    assert "current().transaction(using='other')" in str(dead["error"])
    assert not Payout.objects.filter(key="dq:m2").exists()
