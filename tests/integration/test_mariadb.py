"""What the MySQL/MariaDB dialect layer adds, on a real MariaDB (``mariadb_store``).

The generic invariant tests run on MariaDB through the ``store`` fixture; these check the
MySQL-specific choices themselves: the composite indexes standing for the partial ones
(``EXPLAIN``), ``INSERT IGNORE`` ignoring duplicates and nothing else, ``DATETIME(6)``, the
session setup (READ COMMITTED, lock wait, idle-in-transaction bound, simultaneous SET
assignment) and ``UPDATE ... RETURNING`` emulated under row locks.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store, update_returning
from reliable_beat.db.migrate import upgrade, upgrade_sql
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.relay import claim_outbox_batch, mark_sent

pytestmark = pytest.mark.mariadb

SPEC = json.dumps({"kind": "interval", "every_seconds": 60, "anchor": "2000-01-01T00:00:00Z",
                   "timezone": "UTC"})


def _explain(store: Store, statement: str, params: Any) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.exec_driver_sql("EXPLAIN " + statement, params)]


def _rows_read(store: Store, statement: str, params: Any) -> int:
    """Index and table rows the server read running ``statement`` (its Handler_read_*
    counters), rolled back afterwards. EXPLAIN's ``rows`` is an estimate; this is the work."""
    with store.engine.connect() as conn:
        conn.exec_driver_sql("FLUSH STATUS")
        conn.exec_driver_sql(statement, params).all()
        counters = dict(conn.exec_driver_sql("SHOW SESSION STATUS LIKE 'Handler_read%%'").all())
        conn.rollback()
    return sum(int(counters[k]) for k in ("Handler_read_key", "Handler_read_next",
                                          "Handler_read_prev", "Handler_read_rnd_next"))


def _capture(store: Store, needle: str, action: Any) -> list[tuple[str, Any]]:
    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, context: Any,
                executemany: bool) -> None:
        if needle in statement and statement.lstrip().startswith("SELECT"):
            statements.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", capture)
    try:
        action()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", capture)
    return statements


def test_claim_uses_the_due_index(mariadb_store: Store) -> None:
    """20,000 entries, half of them disabled or paused and due long ago, the others due
    tomorrow: the claim and the earliest-next-fire read are ranges of
    ix_reliable_beat_entries_due_mysql that read a handful of index entries (not a scan,
    nor a walk of the plain next_fire_at index through the disabled rows)."""
    store = mariadb_store
    with store.begin() as conn:
        conn.execute(sa.text(
            """
            INSERT INTO reliable_beat_entries
              (name, task, args, kwargs, options, schedule_kind, schedule, enabled, paused,
               origin, next_fire_at, created_at, updated_at)
            SELECT CONCAT('e-', seq), 't', '[]', '{}', '{}', 'interval', :spec,
                   seq % 4 <> 0, seq % 4 = 1, 'runtime',
                   CASE WHEN seq % 4 IN (0, 1) THEN UTC_TIMESTAMP(6) - INTERVAL 1 DAY
                        ELSE UTC_TIMESTAMP(6) + INTERVAL 1 DAY + INTERVAL seq SECOND END,
                   UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)
            FROM seq_1_to_20000
            """), {"spec": SPEC})
        conn.execute(sa.text("ANALYZE TABLE reliable_beat_entries"))
    for ahead in (0.0, 0.5):
        beat = Beat(store, owner="t", claim_ahead=timedelta(seconds=ahead))
        statements = _capture(store, "reliable_beat_entries", beat.tick)
        with store.begin() as conn:  # the due-looking rows are all disabled or paused
            assert conn.execute(sa.select(sa.func.count()).select_from(runs)).scalar() == 0
        claim = [s for s in statements if "SKIP LOCKED" in s[0]]
        earliest = [s for s in statements if "min(" in s[0].lower()]
        assert len(claim) == 1 and len(earliest) == (2 if ahead else 1)
        for statement, params in (*claim, *earliest):
            plan = _explain(store, statement, params)
            assert plan[0]["key"] == "ix_reliable_beat_entries_due_mysql" or (
                plan[0]["Extra"] == "Select tables optimized away"), plan
            read = _rows_read(store, statement, params)
            assert read <= 5, (statement, read)


def test_relay_claim_reads_only_pending_rows(mariadb_store: Store) -> None:
    """20,000 sent rows and 20 pending: the claim reads the pending rows through
    ix_reliable_beat_outbox_state_sent_at (state = 'pending' is a ref), not the sent ones."""
    store = mariadb_store
    with store.begin() as conn:
        conn.execute(sa.text(
            """
            INSERT INTO reliable_beat_outbox
              (message_id, destination, payload, headers, state, attempts, available_at,
               created_at, sent_at)
            SELECT CONCAT('m-', seq), 'd', '{}', '{}', IF(seq % 1000 = 0, 'pending', 'sent'),
                   0, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, UTC_TIMESTAMP(6),
                   IF(seq % 1000 = 0, NULL, UTC_TIMESTAMP(6))
            FROM seq_1_to_20000
            """))
        conn.execute(sa.text("ANALYZE TABLE reliable_beat_outbox"))
    claimed: list[Any] = []

    def claim() -> None:
        with store.begin() as conn:
            claimed.extend(claim_outbox_batch(store, conn, owner="r", now=store.now(conn),
                                              lease=timedelta(seconds=30), limit=100))

    statements = _capture(store, "reliable_beat_outbox", claim)
    assert len(claimed) == 20
    (statement, params), = [s for s in statements if "SKIP LOCKED" in s[0]]
    plan = _explain(store, statement, params)
    assert plan[0]["key"] == "ix_reliable_beat_outbox_state_sent_at", plan
    assert plan[0]["type"] == "ref", plan
    with store.begin() as conn:  # pending again, to measure the same claim
        conn.execute(outbox.update().values(available_at=store.now(conn) - timedelta(hours=1)))
    read = _rows_read(store, statement, params)
    assert read < 200, read


def _run_row(key: str, **extra: Any) -> dict[str, Any]:
    now = datetime.now(timezone.utc)
    return {"idempotency_key": key, "entry_name": "e", "fire_at": now, "task": "t",
            "args": [], "kwargs": {}, "state": "scheduled", "created_at": now,
            "updated_at": now, **extra}


def test_insert_ignore_skips_duplicates_only(mariadb_store: Store) -> None:
    """A duplicate key is a no-op (nothing returned); any other error IGNORE would turn
    into a warning (here a task name too long for its column, silently truncated by plain
    INSERT IGNORE) raises instead, and nothing is stored."""
    store = mariadb_store
    ins = store.insert_ignore(runs).returning(runs.c.id)
    with store.begin() as conn:
        first = conn.execute(ins, [_run_row("k1")]).all()
        again = conn.execute(ins, [_run_row("k1")]).all()
    assert len(first) == 1 and again == []
    with pytest.raises(IntegrityError, match="other than a duplicate key"), store.begin() as conn:
        conn.execute(ins, [_run_row("k2", task="x" * 300)])
    with store.begin() as conn:
        keys = conn.execute(sa.select(runs.c.idempotency_key)).scalars().all()
    assert keys == ["k1"]


def test_instants_keep_microseconds_in_utc(mariadb_store: Store) -> None:
    store = mariadb_store
    at = datetime(2026, 3, 29, 1, 30, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    with store.begin() as conn:
        conn.execute(runs.insert().values(**_run_row("k", fire_at=at)))
        stored = conn.execute(sa.select(runs.c.fire_at)).scalar_one()
        now = store.now(conn)
    assert stored == at and stored.tzinfo == timezone.utc
    assert stored.isoformat() == "2026-03-28T23:30:00.123456+00:00"
    assert abs(now - datetime.now(timezone.utc)) < timedelta(seconds=5)


def test_session_setup_per_role(mariadb_url: str) -> None:
    upgrade(Store.from_url(mariadb_url))
    beat = Store.from_url(mariadb_url, role="beat")
    worker = Store.from_url(mariadb_url, role="worker")
    try:
        with beat.connect() as conn:
            iso, lock, idle, mode, tz = conn.execute(sa.text(
                "SELECT @@tx_isolation, @@innodb_lock_wait_timeout, "
                "@@idle_transaction_timeout, @@sql_mode, @@time_zone")).one()
        assert (iso, lock, idle, tz) == ("READ-COMMITTED", 5, 5, "+00:00")
        assert {"STRICT_ALL_TABLES", "SIMULTANEOUS_ASSIGNMENT"} <= set(mode.split(","))
        with worker.connect() as conn:
            lock, idle = conn.execute(sa.text(
                "SELECT @@innodb_lock_wait_timeout, @@idle_transaction_timeout")).one()
        assert (lock, idle) == (30, 0)
    finally:
        beat.dispose()
        worker.dispose()


def test_update_returning_gives_rows_changed_with_new_values(mariadb_store: Store) -> None:
    """Emulated UPDATE ... RETURNING: only the rows matched, their values after the update;
    SET reads the old values of the row (SIMULTANEOUS_ASSIGNMENT), as PostgreSQL does."""
    store = mariadb_store
    with store.begin() as conn:
        conn.execute(runs.insert(), [_run_row(f"k{i}", fire_at=datetime(2026, 1, 1, i,
                                                                        tzinfo=timezone.utc))
                                     for i in range(4)])
        conn.execute(runs.update().where(runs.c.idempotency_key == "k3")
                     .values(state="dispatched"))
    with store.begin() as conn:
        got = update_returning(
            conn,
            runs.update().where(runs.c.state == "scheduled")
            .values(state="dispatched",
                    reason=sa.case((runs.c.state == "scheduled", "was scheduled"),
                                   else_="saw the new state")),
            runs, (runs.c.idempotency_key, runs.c.state, runs.c.reason),
        )
    assert [tuple(r) for r in got] == [(f"k{i}", "dispatched", "was scheduled")
                                       for i in range(3)]


def test_frozen_beat_loses_its_locks_after_the_idle_bound(mariadb_store: Store) -> None:
    """A beat frozen inside its claim transaction (GC pause, SIGSTOP) holds the entry rows
    only for idle_transaction_timeout (5 s for the beat role); then another beat claims them."""
    url = mariadb_store.url
    frozen = Store.from_url(url, role="beat")
    other = Store.from_url(url, role="beat")
    now = datetime.now(timezone.utc)
    with mariadb_store.begin() as conn:
        conn.execute(entries.insert().values(
            name="e", task="t", args=[], kwargs={}, options={}, schedule_kind="interval",
            schedule=json.loads(SPEC), origin="runtime", next_fire_at=now - timedelta(hours=1),
            created_at=now, updated_at=now))
    locked = threading.Event()

    def freeze() -> None:
        with frozen.engine.connect() as conn:
            conn.begin()
            conn.execute(sa.select(entries.c.id).with_for_update())
            locked.set()
            time.sleep(8)  # frozen: no statement, transaction open
            with pytest.raises(sa.exc.DBAPIError):
                conn.execute(sa.select(1))  # the server ended the session
            conn.invalidate()

    t = threading.Thread(target=freeze)
    t.start()
    try:
        assert locked.wait(30)
        skip = sa.select(entries.c.id).with_for_update(skip_locked=True)
        with other.begin() as conn:
            assert conn.execute(skip).all() == []  # held by the frozen beat
        deadline = time.monotonic() + 30
        got: list[Any] = []
        while not got and time.monotonic() < deadline:
            time.sleep(0.5)
            with other.begin() as conn:
                got = conn.execute(skip).all()
        assert got, "the frozen beat kept its row locks"
    finally:
        t.join(30)
        frozen.dispose()
        other.dispose()


def test_upgrade_sql_emits_mysql_ddl() -> None:
    sql = upgrade_sql("mysql+pymysql://u@h/db")
    assert "DATETIME(6)" in sql and " JSON " in sql
    assert "CREATE INDEX ix_reliable_beat_entries_due_mysql" in sql
    assert "WHERE enabled" not in sql  # no partial index on MySQL
    pg = upgrade_sql("postgresql+psycopg://u@h/db")
    assert "_mysql" not in pg
    assert outbox.name in pg


def test_unreachable_server_is_store_unavailable() -> None:
    """A MySQL URL nobody answers is StoreUnavailableError (the loops' "database down"), not a
    bare driver error."""
    from harness.servers import free_port
    from reliable_beat.errors import StoreUnavailableError

    store = Store.from_url(f"mysql+pymysql://root@127.0.0.1:{free_port()}/x", role="beat")
    try:
        with pytest.raises(StoreUnavailableError, match="unavailable"), store.begin() as conn:
            store.now(conn)
    finally:
        store.dispose()


def test_config_syncs_at_the_same_instant_are_serialised(mariadb_store: Store) -> None:
    """Eight beats syncing the same new config at the same instant (a barrier, not process
    start-up luck): one inserts, the others find it current; no duplicate-key error."""
    from reliable_beat.entries import definitions_from_beat_schedule, sync_config_entries
    from reliable_beat.settings import Settings

    conf = {f"e{i}": {"task": "t", "schedule": "* * * * *"} for i in range(30)}
    defs = definitions_from_beat_schedule(conf, default_timezone="UTC",
                                          settings=Settings(database_url="sqlite://"),
                                          now=datetime.now(timezone.utc))
    stores = [Store.from_url(mariadb_store.url, role="beat") for _ in range(8)]
    for s in stores:  # connected before the barrier, so the syncs start together
        with s.begin() as conn:
            s.now(conn)
    barrier = threading.Barrier(len(stores))
    results: list[Any] = []
    errors: list[BaseException] = []

    def sync(s: Store) -> None:
        barrier.wait()
        try:
            results.append(sync_config_entries(s, defs))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sync, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in stores:
        s.dispose()
    assert errors == []
    assert sum(r["inserted"] for r in results) == 30
    with mariadb_store.begin() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(entries)).scalar() == 30


def test_mark_sent_locks_only_its_own_rows(mariadb_store: Store) -> None:
    """Relay r2 marks its row sent while relay r1 holds another pending row (r1 settling its
    own batch): r2's ``SELECT ... FOR UPDATE`` of ``update_returning`` goes by primary key.
    It once went through ix_reliable_beat_outbox_state_sent_at (``state = 'pending'`` is a
    ref of it), locked every pending row it scanned, waited on r1's rows while r1 waited on
    its own, and MariaDB rolled one settle back as a deadlock victim (1213): its delivered
    rows stayed claimed for the 60 s lease and were delivered again (the flaky
    test_ordering_key_respected_under_two_relays[mariadb])."""
    store = mariadb_store
    with store.begin() as conn:  # as test_ordering_key_respected_under_two_relays has them
        ids = [outbox_add(conn, f"{k}{seq}", k) for seq in range(30) for k in "ABCD"]
    for i in ids[:100]:  # sent one settle at a time, as relays do
        with store.begin() as conn:
            mark_sent(conn, [i], store.now(conn))
    held, mine = ids[-1], ids[105:108]
    with store.begin() as r1:  # r1's settle: its row is locked until r1 commits
        r1.execute(outbox.update().where(outbox.c.id == held).values(last_error="r1"))
        with store.begin() as r2:
            r2.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
            statements = _capture(store, "FOR UPDATE", lambda: mark_sent(r2, mine,
                                                                        store.now(r2)))
            r2.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 5")
            (statement, params), = statements
            plan = _explain(store, statement, params)  # the rows are still pending there
    assert "FORCE INDEX (PRIMARY)" in statement, statement  # not up to the optimizer
    assert plan[0]["key"] == "PRIMARY", plan
    with store.begin() as conn:
        states = dict(conn.execute(sa.select(outbox.c.id, outbox.c.state)).all())
    assert [states[i] for i in mine] == ["sent"] * 3 and states[held] == "pending"


def outbox_add(conn: sa.Connection, key: str, ordering_key: str) -> int:
    from reliable_beat import outbox as outbox_mod

    outbox_mod.add(conn, "rec", {"k": key}, key=key, ordering_key=ordering_key)
    return int(conn.execute(sa.select(outbox.c.id).where(outbox.c.message_id == key))
               .scalar_one())
