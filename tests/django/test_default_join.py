"""``self.transaction()`` without ``using=`` in a Django project keeps exactly-once (design.md
invariant 10): the block joins Django's connection when the store is a Django database, and
an ORM write on another connection inside it is refused naming ``using=``. Checked with the
testing kit (``fail_then_retry``, ``die_mid_run``, ``stale_runner``) on the child's real
PostgreSQL, psycopg 3 and psycopg2 (run by tests/integration/test_django.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import connections, transaction
from djshop.models import Payout
from djtables import meta
from djtables import payouts as payouts_t

from reliable_beat import runs, testing
from reliable_beat.contrib.django import conf
from reliable_beat.contrib.django.join import is_write
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import outbox as outbox_t
from reliable_beat.errors import ConfigurationError


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
    ("SELECT 1; INSERT INTO side VALUES (4242)", True),
    ("EXPLAIN ANALYZE INSERT INTO side VALUES (1)", True),
    ("CALL add_side(1)", True),
    ("DO $$ BEGIN INSERT INTO side VALUES (1); END $$", True),
    ("COPY side FROM PROGRAM 'echo 1'", True),
    ("PREPARE p AS INSERT INTO side VALUES (1); EXECUTE p", True),
    ("SELECT 1 AS v INTO side_copy", True),
    ("CREATE TABLE side_copy AS SELECT * FROM side", True),
    ("SELECT set_config('default_transaction_read_only', 'off', false)", True),
    ("SET default_transaction_read_only = off", True),
    ("BEGIN READ WRITE", True),
    ("SELECT 1; COMMIT", True),
    ("ROLLBACK", True),
    ("START TRANSACTION READ ONLY; SELECT 1", True),
    ("SELECT 1 AS it''s_ok -- INSERT INTO t\n", False),
    (object(), True),  # a statement whose text cannot be read
    ('SELECT "id" FROM "dj_payouts" FOR NO KEY UPDATE SKIP LOCKED', False),
    ("SELECT replace(note, 'insert into', '') FROM side WHERE note = 'delete'", False),
    ('SELECT "update", "into" FROM "side"', False),
    ("BEGIN", False),  # Django's SQLite backend opens atomic() so
    ('ROLLBACK TO SAVEPOINT "s1_x1"', False),
    ("EXPLAIN ANALYZE SELECT 1", False),
    ('SET "transaction_read_only" = off; SELECT fn_ins()', True),
    ('SET "default_transaction_read_only" = off', True),
    ('SET SESSION "Transaction_Read_Only" TO off', True),
    ("SET @@session.`transaction_read_only` = 0", True),
    ('SELECT "pg_catalog"."set_config"(\'transaction_read_only\', \'off\', true)', True),
    ('SET U&"\\0074ransaction_read_only" = off', True),
    ('SELECT "dj_payouts"."id", "dj_payouts"."key" FROM "dj_payouts" WHERE "key" = %s', False),
    ("SELECT E'a\\''; SET default_transaction_read_only = off; COMMIT; "
     "INSERT INTO side VALUES (1); SELECT 'x'", True),
    ("SELECT 'C:\\'; INSERT INTO side VALUES (1); SELECT 'x'", True),
    ("SELECT E'it\\'s', 'a\\\\b' FROM side", False),
])
def test_write_statements_are_told_from_reads(sql: Any, write: bool) -> None:
    assert is_write(sql) is write


@pytest.fixture(scope="module")
def side() -> Iterator[str]:
    """Table ``rb_side`` and plpgsql function ``rb_side_insert(v)`` writing it, in another
    database (Django alias ``elsewhere``); yields the alias."""
    with connections["elsewhere"].cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS rb_side (v integer)")
        cur.execute("CREATE OR REPLACE FUNCTION rb_side_insert(n integer) RETURNS integer "
                    "LANGUAGE plpgsql AS $$ BEGIN INSERT INTO rb_side VALUES (n); "
                    "RETURN n; END $$")
    try:
        yield "elsewhere"
    finally:
        with connections["elsewhere"].cursor() as cur:
            cur.execute("DROP FUNCTION IF EXISTS rb_side_insert(integer)")
            cur.execute("DROP TABLE IF EXISTS rb_side, rb_side_copy")


def side_rows(v: int) -> int:
    with connections["elsewhere"].cursor() as cur:
        cur.execute("SELECT count(*) FROM rb_side WHERE v = %s", [v])
        return int(cur.fetchone()[0])


@pytest.mark.parametrize(("case", "statements", "composed", "by_database"), [
    ("multi", ["SELECT 1; INSERT INTO rb_side VALUES (4201)"], False, False),
    ("function", ["SELECT rb_side_insert(4202)"], False, True),
    ("explain", ["EXPLAIN ANALYZE INSERT INTO rb_side VALUES (4203)"], False, False),
    ("composed", ["INSERT INTO rb_side VALUES (4204)"], True, False),
    ("do", ["DO $$ BEGIN INSERT INTO rb_side VALUES (4205); END $$"], False, False),
    ("read-then-function", ["SELECT count(*) FROM rb_side", "SELECT rb_side_insert(4206)"],
     False, True),
    ("function-composed", ["SELECT rb_side_insert(4207)"], True, True),
    ("escaped-string", ["SELECT E'a\\''; SET default_transaction_read_only = off; COMMIT; "
                        "SELECT rb_side_insert(4208); SELECT 'x'"], False, False),
])
def test_a_hidden_write_on_another_alias_is_refused_and_not_written(
        side: str, case: str, statements: list[str], composed: bool, by_database: bool) -> None:
    """Raw SQL on another alias's cursor in the block: a write the statement check sees
    (anywhere in the text) is refused before the database; one it cannot see (a function
    that inserts) is refused by the database, which runs the statement read-only. Either
    way a ConfigurationError naming ``using=`` and the alias, and no row there."""
    from djtask_app import pay_then_sql

    key = f"hidden-{case}"
    value = int(re.findall(r"\d{4}", statements[-1])[0])
    for atomic in (False, True):
        res = pay_then_sql.apply(args=[f"{key}-{atomic}", side, statements],
                                 kwargs={"composed": composed, "atomic": atomic})
        assert res.failed(), (case, atomic, res.result)
        assert isinstance(res.result, ConfigurationError), res.result
        message = str(res.result)
        assert f"Django database {side!r} inside self.transaction()" in message, message
        assert "using=" in message
        assert ("the database refused it" in message) is by_database, message
        assert side_rows(value) == 0
        assert not Payout.objects.filter(key=f"pay:{key}-{atomic}").exists()
        assert runs.get_run(conf.store(), f"pay:{key}-{atomic}")["state"] == "dead"


@pytest.mark.parametrize("setting", ["transaction_read_only",
                                     "default_transaction_read_only"])
def test_read_only_switched_off_through_a_quoted_setting_is_refused(
        side: str, setting: str) -> None:
    """``SET "transaction_read_only" = off; SELECT fn_that_inserts()`` on another alias in
    the block: the quoted setting name is seen, the statement refused, no row written; an
    ORM read there (every column quoted) still passes."""
    from djtask_app import pay_then_sql, pay_via

    statement = f'SET "{setting}" = off; SELECT rb_side_insert(4601)'
    for atomic in (False, True):
        key = f"quoted-{setting}-{atomic}"
        res = pay_then_sql.apply(args=[key, side, [statement]], kwargs={"atomic": atomic})
        assert isinstance(res.result, ConfigurationError), (atomic, res.result)
        assert f"Django database {side!r} inside self.transaction()" in str(res.result)
        assert side_rows(4601) == 0
        assert not Payout.objects.filter(key=f"pay:{key}").exists()
    res = pay_via.apply(args=[f"quoted-read-{setting}", "default"], kwargs={"read_on": "other"})
    assert res.successful(), res.traceback


def test_reads_on_another_alias_work_in_the_block_and_it_is_writable_after(side: str) -> None:
    """Reads there pass (autocommit, and inside ``atomic(using=...)``), and the read-only
    mode ends with the block: the alias's own writes after it go through."""
    from djtask_app import pay_then_sql

    read = ["SELECT count(*) FROM rb_side", "SELECT 7 AS seven"]
    for atomic in (False, True):
        res = pay_then_sql.apply(args=[f"reads-{atomic}", side, read],
                                 kwargs={"atomic": atomic})
        assert res.successful(), res.traceback
        assert res.get() == [[7]]
        assert Payout.objects.filter(key=f"pay:reads-{atomic}").count() == 1
        with connections[side].cursor() as cur:  # the same connection, after the block
            cur.execute("SHOW default_transaction_read_only")
            assert cur.fetchone()[0] == "off"
            cur.execute("SELECT rb_side_insert(4300)")
        assert side_rows(4300) == 1
        with connections[side].cursor() as cur:
            cur.execute("DELETE FROM rb_side WHERE v = 4300")


def test_the_read_only_mode_holds_after_an_atomic_there_rolls_back(side: str) -> None:
    """An ``atomic(using=...)`` on the other alias rolled back in the block takes the
    session's read-only default with it; the next statement there is read-only again (the
    server reports the setting with each reply, no extra round trip to check it)."""
    from djtask_app import PayTask, app

    @app.task(base=PayTask, bind=True, name="dj.test_rolled_back_then_write")
    def rolled_back_then_write(self: Any, merchant: str) -> None:
        with self.transaction():
            try:
                with transaction.atomic(using=side), connections[side].cursor() as cur:
                    cur.execute("SELECT 1")
                    raise LookupError("roll the atomic() back")
            except LookupError:
                pass
            with connections[side].cursor() as cur:
                cur.execute("SELECT rb_side_insert(4501)")

    res = rolled_back_then_write.apply(args=["rolled-back"])
    assert isinstance(res.result, ConfigurationError), res.result
    assert "the database refused it" in str(res.result)
    assert side_rows(4501) == 0


def test_the_read_only_mode_costs_a_statement_per_alias_and_block(
        side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads on another alias cost one statement before the first of them and one after
    the block (two more when the first opens an ``atomic()`` there); a block that does not
    touch another alias costs nothing."""
    from djtask_app import pay_plain, pay_then_sql

    from reliable_beat.contrib.django import readonly

    sent: list[str] = []
    real = readonly._run

    def counting(raw: Any, *statements: str) -> None:
        sent.extend(statements)
        real(raw, *statements)

    monkeypatch.setattr(readonly, "_run", counting)
    assert pay_then_sql.apply(args=["cost-1", side, ["SELECT 1"] * 5]).successful()
    assert sent == ["SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
                    "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE"]
    sent.clear()
    assert pay_then_sql.apply(args=["cost-2", side, ["SELECT 1"] * 5],
                              kwargs={"atomic": True}).successful()
    assert sent == ["SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
                    "SET TRANSACTION READ ONLY",
                    "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE"]
    sent.clear()
    assert pay_plain.apply(args=["cost-3"]).successful()
    assert sent == []


def test_an_alias_inside_its_own_atomic_keeps_the_statement_check_only(side: str) -> None:
    """An alias already in ``atomic()`` when the block opens (Django's TestCase, a request
    with ATOMIC_REQUESTS): its transaction is not made read-only (that would last past the
    block); the statement check still refuses plain writes, and reads and its own writes
    after the block work."""
    from djtask_app import pay_then_sql

    with transaction.atomic(using=side):
        res = pay_then_sql.apply(args=["outer-read", side, ["SELECT count(*) FROM rb_side"]])
        assert res.successful(), res.traceback
        refused = pay_then_sql.apply(args=["outer-write", side,
                                           ["SELECT 1; INSERT INTO rb_side VALUES (4401)"]])
        assert isinstance(refused.result, ConfigurationError), refused.result
        with connections[side].cursor() as cur:
            cur.execute("SELECT rb_side_insert(4402)")
        assert side_rows(4402) == 1
        transaction.set_rollback(True, using=side)
    assert side_rows(4402) == 0


@pytest.fixture
def manual_other(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Alias ``other`` with ``AUTOCOMMIT: False`` and a persistent connection."""
    wrapper = connections["other"]
    wrapper.close()
    monkeypatch.setitem(wrapper.settings_dict, "AUTOCOMMIT", False)
    monkeypatch.setitem(wrapper.settings_dict, "CONN_MAX_AGE", 600)
    try:
        yield "other"
    finally:
        wrapper.close()


def test_an_alias_without_autocommit_is_writable_after_the_block(manual_other: str) -> None:
    """An ``AUTOCOMMIT: False`` alias manages its own transactions (the user commits in the
    block, rolls back after it): it keeps the statement check only, and its connection is
    read-write after the block."""
    from djtask_app import PayTask, app

    @app.task(base=PayTask, bind=True, name="dj.test_manual_commit")
    def manual_commit(self: Any, merchant: str) -> None:
        with self.transaction():
            with connections[manual_other].cursor() as cur:
                cur.execute("select 1")
            connections[manual_other].commit()
            with pytest.raises(ConfigurationError), connections[manual_other].cursor() as cur:
                cur.execute("INSERT INTO dj_payouts (key) VALUES ('x')")

    res = manual_commit.apply(args=["manual"])
    assert res.successful(), res.traceback
    wrapper = connections[manual_other]
    wrapper.rollback()
    with wrapper.cursor() as cur:
        cur.execute("SHOW default_transaction_read_only")
        assert cur.fetchone()[0] == "off"
    Payout.objects.using(manual_other).create(key="pay:manual-after", fence=1, run_id=1, pid=0)
    wrapper.commit()
    assert Payout.objects.filter(key="pay:manual-after").count() == 1


def test_sqlite_alias_runs_query_only_until_restored() -> None:
    """The read-only mode on a real SQLite connection: PRAGMA query_only, restored."""
    from reliable_beat.contrib.django.readonly import ReadOnly, refused_by_database

    wrapper = connections["lite"]
    with wrapper.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS rb_side (v integer)")
    try:
        ro = ReadOnly(wrapper)
        ro.before()
        with pytest.raises(Exception) as refused, wrapper.cursor() as cur:
            cur.execute("INSERT INTO rb_side VALUES (1)")
        assert refused_by_database(refused.value), refused.value
        with wrapper.cursor() as cur:
            cur.execute("SELECT count(*) FROM rb_side")
            assert cur.fetchone()[0] == 0
        ro.restore()
        with wrapper.cursor() as cur:
            cur.execute("INSERT INTO rb_side VALUES (1)")
            cur.execute("SELECT count(*) FROM rb_side")
            assert cur.fetchone()[0] == 1
    finally:
        with wrapper.cursor() as cur:
            cur.execute("DROP TABLE IF EXISTS rb_side")
        wrapper.close()


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
