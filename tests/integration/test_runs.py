"""reliable_beat.runs on both stores: claim, fenced completion, dedupe, lease expiry, races.

Lease expiry is driven by seeding ``lease_expires_at`` in the past (the DB clock decides),
never by sleeping or patching the clock. The race uses two real connections and a barrier.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.types.json import Jsonb

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters
from reliable_beat.db.tables import runs as runs_t
from reliable_beat.errors import StaleFenceToken, StoreUnavailableError

LEASE = timedelta(seconds=30)
effects = sa.Table(
    "test_effects",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
)


@pytest.fixture
def fx(store: Store) -> Store:
    effects.create(store.engine)
    return store


def claim(store: Store, key: str = "k1", owner: str = "w1") -> runs.Claim:
    return runs.claim_run(store, key, owner=owner, lease=LEASE, task="t.x", args=[1],
                          kwargs={"a": 2}, task_id=f"id-{owner}")


def outcomes(store: Store, run_id: int) -> list[tuple[int, int, str]]:
    rows = runs.list_attempts(store, run_id)
    return [(a["attempt"], a["fence_token"], a["outcome"]) for a in rows]


def count(store: Store, table: sa.Table) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def expire_lease(store: Store, key: str) -> None:
    with store.begin() as conn:
        conn.execute(sa.update(runs_t).where(runs_t.c.idempotency_key == key).values(
            lease_expires_at=datetime(2000, 1, 1, tzinfo=timezone.utc)))


def test_fresh_claim_then_complete_then_dedupe(fx: Store) -> None:
    c = claim(fx)
    assert c.acquired and c.fresh and c.fence_token == 1 and c.attempt == 1
    with fx.begin() as conn:
        conn.execute(effects.insert().values(key=c.key, fence=c.fence_token))
        runs.complete(conn, c, {"paid": 3})
    run = runs.get_run(fx, "k1")
    assert run["state"] == "succeeded" and run["result"] == {"paid": 3}
    assert run["lease_expires_at"] is None and run["trigger"] == "adhoc"
    again = claim(fx, owner="w2")
    assert again.outcome == "already_succeeded" and again.result == {"paid": 3}
    assert not again.fresh
    assert outcomes(fx, c.run_id) == [(1, 1, "succeeded"), (1, 1, "deduplicated")]
    assert count(fx, effects) == 1


def test_claim_uses_scheduler_row_and_keeps_its_fields(fx: Store) -> None:
    fire_at = datetime(2026, 1, 10, 12, 0, tzinfo=timezone.utc)
    with fx.begin() as conn:
        now = fx.now(conn)
        conn.execute(runs_t.insert().values(
            idempotency_key="e@2026-01-10T12:00:00Z", entry_name="e", fire_at=fire_at,
            trigger="catch_up", task="t.x", args=[], kwargs={}, state="dispatched",
            created_at=now, updated_at=now))
    c = runs.claim_run(fx, "e@2026-01-10T12:00:00Z", owner="w", lease=LEASE, task="t.x",
                       entry="e", fire_at=fire_at)
    assert c.acquired and not c.fresh and c.entry_name == "e" and c.fire_at == fire_at
    run = runs.get_run(fx, c.key)
    assert run["state"] == "running" and run["trigger"] == "catch_up"


def test_live_lease_is_busy_and_expired_lease_is_taken_over(fx: Store) -> None:
    a = claim(fx, owner="w1")
    b = claim(fx, owner="w2")
    assert b.outcome == "busy" and b.retry_after is not None
    assert timedelta(seconds=25) < b.retry_after <= LEASE
    expire_lease(fx, "k1")
    c = claim(fx, owner="w2")
    assert c.acquired and c.fence_token == a.fence_token + 1 and c.attempt == 2
    # The stale holder's commit is rejected and its effect rolled back.
    with pytest.raises(StaleFenceToken), fx.begin() as conn:
        conn.execute(effects.insert().values(key="k1", fence=a.fence_token))
        runs.complete(conn, a, "stale")
    runs.record_fenced_out(fx, a)
    assert count(fx, effects) == 0
    assert runs.renew_lease(fx, a, LEASE) is False
    assert runs.renew_lease(fx, c, LEASE) is True
    with fx.begin() as conn:
        conn.execute(effects.insert().values(key="k1", fence=c.fence_token))
        runs.complete(conn, c, "fresh")
    assert count(fx, effects) == 1
    assert outcomes(fx, a.run_id) == [(1, 1, "fenced_out"), (1, 1, "busy"), (2, 2, "succeeded")]


def test_clear_lease_fences_out_the_holder(fx: Store) -> None:
    a = claim(fx)
    assert runs.clear_lease(fx, "k1") == a.fence_token + 1
    assert runs.get_run(fx, "k1")["state"] == "retrying"
    assert runs.renew_lease(fx, a, LEASE) is False
    with pytest.raises(StaleFenceToken), fx.begin() as conn:
        runs.complete(conn, a, None)
    b = claim(fx, owner="w2")
    assert b.acquired and b.fence_token == a.fence_token + 2
    with pytest.raises(runs.RunNotFound):
        runs.clear_lease(fx, "nope")


def test_retry_then_dead_letter_then_requeue(fx: Store) -> None:
    a = claim(fx)
    assert runs.record_failure(fx, a, "boom", retry_in_seconds=0.7) == "retrying"
    run = runs.get_run(fx, "k1")
    assert run["state"] == "retrying" and run["lease_expires_at"] is None
    b = claim(fx)
    assert b.acquired and b.attempt == 2
    assert runs.record_failure(fx, b, "boom2", dead_reason="exhausted") == "dead"
    assert claim(fx).outcome == "dead"
    [dl] = runs.list_dead_letters(fx)
    assert dl["reason"] == "exhausted" and dl["attempts"] == 2 and dl["key"] == "k1"
    assert dl["payload"] == {"task": "t.x", "args": [1], "kwargs": {"a": 2}, "key": "k1"}
    rows = runs.list_attempts(fx, a.run_id)
    assert [r["outcome"] for r in rows] == ["retrying", "dead", "deduplicated"]
    assert rows[0]["retry_in_seconds"] == pytest.approx(0.7)
    got = runs.requeue_dead_letter(fx, dl["id"], by="ops")
    assert got["payload"]["key"] == "k1"
    with pytest.raises(ValueError):
        runs.requeue_dead_letter(fx, dl["id"], by="ops")
    assert runs.mark_dispatched(fx, "k1")
    c = claim(fx)
    assert c.acquired and c.attempt == 1 and c.fence_token == 3
    assert runs.get_dead_letter(fx, dl["id"])["requeued_by"] == "ops"
    assert count(fx, dead_letters) == 1


def test_failure_of_a_fenced_out_runner_records_nothing_else(fx: Store) -> None:
    a = claim(fx)
    expire_lease(fx, "k1")
    claim(fx, owner="w2")
    assert runs.record_failure(fx, a, "late", dead_reason="permanent") == "fenced_out"
    assert count(fx, dead_letters) == 0
    assert runs.get_run(fx, "k1")["state"] == "running"


def test_queries(fx: Store) -> None:
    for i in range(3):
        claim(fx, key=f"k{i}")
    assert len(runs.list_runs(fx)) == 3
    assert len(runs.list_runs(fx, state="running", limit=2)) == 2
    assert runs.list_runs(fx, entry="none") == []
    assert runs.list_runs(fx, since=datetime(2999, 1, 1, tzinfo=timezone.utc)) == []


def test_two_connections_racing_for_one_key_make_one_effect(fx: Store) -> None:
    """Two threads, each with its own connection, claim + write + complete the same key."""
    barrier = threading.Barrier(2)
    results: dict[str, Any] = {}

    def worker(name: str) -> None:
        barrier.wait()
        c = claim(fx, owner=name)
        results[name] = c.outcome
        if not c.acquired:
            return
        with fx.begin() as conn:
            conn.execute(effects.insert().values(key=c.key, fence=c.fence_token))
            runs.complete(conn, c, name)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("w1", "w2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results.values()) in (
        ["acquired", "busy"], ["acquired", "already_succeeded"]
    ), results
    assert count(fx, effects) == 1
    run = runs.get_run(fx, "k1")
    assert run["state"] == "succeeded" and run["fence_token"] == 1


def test_racing_claims_after_expiry_get_distinct_fences(fx: Store) -> None:
    """Many racing claims on an expired lease: exactly one acquires, fences never repeat."""
    claim(fx)
    expire_lease(fx, "k1")
    n = 6
    barrier = threading.Barrier(n)
    got: list[runs.Claim] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        barrier.wait()
        c = claim(fx, owner=f"w{i}")
        with lock:
            got.append(c)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == n
    assert [c.outcome for c in got].count("acquired") == 1
    assert {c.outcome for c in got} == {"acquired", "busy"}
    with fx.engine.connect() as conn:
        fences = conn.execute(sa.select(attempts.c.fence_token).where(
            attempts.c.outcome.in_(["running", "failed"]))).scalars().all()
    assert sorted(fences) == [1, 2]  # the expired holder's row closed as 'failed'
    assert runs.list_attempts(fx, got[0].run_id)[0]["outcome"] == "failed"


def test_racing_claims_of_a_dispatched_row_acquire_once(fx: Store) -> None:
    """The scheduler's row (``dispatched``) claimed by many racers at once: exactly one
    acquires (fence 1, attempt 1); the others see its lease. On PostgreSQL this is the
    one-statement claim racing itself."""
    with fx.begin() as conn:
        now = fx.now(conn)
        conn.execute(runs_t.insert().values(
            idempotency_key="e@1", entry_name="e", trigger="schedule", task="t.x", args=[],
            kwargs={}, state="dispatched", created_at=now, updated_at=now))
    n = 6
    barrier = threading.Barrier(n)
    got: list[runs.Claim] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        barrier.wait()
        c = claim(fx, key="e@1", owner=f"w{i}")
        with lock:
            got.append(c)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(c.outcome for c in got) == ["acquired"] + ["busy"] * (n - 1)
    [won] = [c for c in got if c.acquired]
    assert won.fence_token == 1 and won.attempt == 1 and not won.fresh
    run = runs.get_run(fx, "e@1")
    assert run["state"] == "running" and run["fence_token"] == 1 and run["attempts"] == 1
    assert sorted(o for _, _, o in outcomes(fx, won.run_id)) == ["busy"] * (n - 1) + ["running"]


def test_claim_of_a_slot_held_by_another_key_is_not_found(fx: Store) -> None:
    fire_at = datetime(2026, 1, 10, 12, 0, tzinfo=timezone.utc)
    runs.claim_run(fx, "e@a", owner="w", lease=LEASE, task="t.x", entry="e", fire_at=fire_at)
    with pytest.raises(runs.RunNotFound):
        runs.claim_run(fx, "e@b", owner="w", lease=LEASE, task="t.x", entry="e",
                       fire_at=fire_at)
    assert count(fx, runs_t) == 1 and count(fx, attempts) == 1


def test_one_statement_claim_finds_the_run_by_its_key_only(pg_store: Store) -> None:
    """The PostgreSQL claim's cached (generic) plan reaches the run through the unique key
    index, never the state index: with statistics taken while the table was small, a plan
    on ``state = 'succeeded'`` scans every succeeded run on every claim."""
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with pg_store.begin() as conn:
        conn.exec_driver_sql("ANALYZE reliable_beat_runs")  # statistics of an empty table
        conn.execute(runs_t.insert(), [
            {"idempotency_key": f"old:{i}", "task": "t.x", "args": [], "kwargs": {},
             "state": "succeeded", "created_at": now, "updated_at": now}
            for i in range(3000)])
    with pg_store.engine.connect() as conn:
        sql = str(runs._pg_claim_statement().compile(dialect=conn.dialect))
        params = {"p_key": "old:7", "p_entry": None, "p_fire_at": None, "p_trigger": "adhoc",
                  "p_task": "t.x", "p_args": Jsonb([]), "p_kwargs": Jsonb({}), "p_owner": "w",
                  "p_lease": LEASE, "p_task_id": None, "fence_token_1": 1, "attempts_1": 1}
        dbapi = conn.connection.driver_connection
        assert dbapi is not None
        dbapi.execute("SET plan_cache_mode = force_generic_plan")  # the plan psycopg caches
        plan = "\n".join(r[0] for r in dbapi.execute("EXPLAIN " + sql, params, prepare=True))
        conn.rollback()
    assert "ix_reliable_beat_runs_state" not in plan, plan
    assert "uq_reliable_beat_runs_idempotency_key" in plan, plan


def test_claim_whose_connection_dies_mid_statement_is_store_unavailable(
    pg_store: Store,
) -> None:
    """The one-statement claim waits on a row lock; its backend is terminated: the caller
    gets StoreUnavailableError (transient, retried), and the pool's connections are back
    in transactional mode for the next user."""
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        conn.execute(runs_t.insert().values(
            idempotency_key="k1", task="t.x", args=[], kwargs={}, state="dispatched",
            created_at=now, updated_at=now))
    other = sa.create_engine(pg_store.engine.url)
    got: dict[str, Any] = {}
    with other.connect() as holder:
        holder.execute(sa.select(runs_t.c.id).where(runs_t.c.idempotency_key == "k1")
                       .with_for_update())

        def claimer() -> None:
            try:
                got["claim"] = claim(pg_store)
            except BaseException as exc:  # handed to the test thread
                got["error"] = exc

        t = threading.Thread(target=claimer)
        t.start()
        with other.connect() as admin:
            deadline = time.monotonic() + 10
            killed = False
            while not killed and time.monotonic() < deadline:
                killed = bool(admin.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )).scalars().all())
                time.sleep(0.05)
            admin.commit()
        t.join(timeout=30)
        holder.rollback()
    other.dispose()
    assert killed
    assert isinstance(got.get("error"), StoreUnavailableError), got
    c = claim(pg_store)
    assert c.acquired and c.fence_token == 1
    with pg_store.engine.connect() as conn:
        assert conn.connection.driver_connection.autocommit is False  # type: ignore[union-attr]


def test_renewal_does_not_wait_long_on_a_locked_run_row(server_store: Store) -> None:
    """A renewal of a short lease gives up quickly on a row someone else holds locked (the
    role's lock_timeout is 30 s; MariaDB: innodb_lock_wait_timeout, the same 30 s, and the
    renewal's own bound of 1 s); the lease is then still ours and the next renewal works."""
    lease = timedelta(seconds=0.6)  # waits at most 0.1 s for the lock
    c = runs.claim_run(server_store, "k1", owner="w1", lease=lease, task="t.x")
    other = sa.create_engine(server_store.engine.url)
    got: dict[str, Any] = {}
    with other.connect() as holder:
        holder.execute(sa.select(runs_t.c.id).where(runs_t.c.id == c.run_id).with_for_update())

        def renew() -> None:
            try:
                got["ok"] = runs.renew_lease(server_store, c, lease)
            except sa.exc.OperationalError as exc:
                got["error"] = exc

        t = threading.Thread(target=renew)
        t.start()
        t.join(timeout=10)  # generous: the role's own lock wait would be 30 s
        gave_up = not t.is_alive()
        holder.rollback()
        t.join(timeout=60)
    other.dispose()
    assert gave_up
    assert "lock timeout" in str(got["error"]) or "Lock wait timeout" in str(got["error"])
    assert runs.renew_lease(server_store, c, lease) is True


def test_completion_of_a_run_whose_state_was_set_by_sql_logs_it_and_status_counts_it(
    fx: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Fresh-user finding 5a: `state='garbage'` set by SQL while the activity runs. The
    completion records the truth (succeeded: this runner holds the fence, the effect
    commits once) and logs an ERROR naming the run, the value and where to look (main:
    silent); a run row left with an unknown state is a status problem (main: silent,
    `status --check` exit 0)."""
    import logging

    from reliable_beat.cli.status import collect_status

    c = claim(fx)
    with fx.begin() as conn:
        conn.execute(sa.update(runs_t).values(state="garbage"))
    with caplog.at_level(logging.ERROR, logger="reliable_beat"), fx.begin() as conn:
        conn.execute(effects.insert().values(key=c.key, fence=c.fence_token))
        runs.complete(conn, c, {"paid": 3})
    assert runs.get_run(fx, "k1")["state"] == "succeeded"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("k1" in m and "garbage" in m and "runs show k1" in m for m in said), said
    assert collect_status(fx)["malformed_run_states"] == {"count": 0, "keys": []}
    # a row left with a state nobody writes (set after its completion, or of a dead worker)
    with fx.begin() as conn:
        conn.execute(sa.update(runs_t).values(state="garbage"))
    info = collect_status(fx)
    assert info["malformed_run_states"] == {"count": 1, "keys": ["k1"]}
    assert not info["ok"]
    assert any(p.startswith("MALFORMED RUN ROWS") and "k1" in p for p in info["problems"])
