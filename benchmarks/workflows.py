"""Durable workflows: replay cost vs history length, and the idle cost of sleeping workflows.

* **replay**: a workflow of *n* inline steps then ``wait_signal`` is driven to its wait; then
  (a) ``replay_check`` (load the history + replay it, no writes) and (b) a full advance on a
  spurious wake (claim, load, replay, release) are timed, median of 5: µs per replayed event.
* **idle**: *k* workflows asleep on timers an hour away (their rows, timer events and outbox
  wake rows inserted in bulk, as ``ctx.sleep`` writes them); the relay's claim of due rows
  (``claim_outbox_batch``, nothing due) is timed, median of 20, and the table sizes shown.
  No process holds anything for them: the cost is rows and one index scan per relay poll.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from benchmarks.common import Env, median, table
from reliable_beat.db.dialects import Store
from reliable_beat.relay import claim_outbox_batch
from reliable_beat.workflows import engine
from reliable_beat.workflows.context import WorkflowContext

REPLAY_SIZES = {"smoke": [100, 500], "full": [100, 500, 1000, 2000]}
IDLE_SIZES = {"smoke": [10_000], "full": [10_000, 100_000]}


def _noop(i: int) -> int:
    return i


def _steps(ctx: WorkflowContext, n: int) -> Any:
    for i in range(n):
        ctx.step(_noop, i, name="noop")
    return ctx.wait_signal("never")


def _replay(store: Store, n: int) -> list[Any]:
    engine.register(engine.WorkflowDefinition(name="bench.steps", fn=_steps,
                                              history_limit=10_000))
    wid = f"bench-{n}"
    engine.start(store, "bench.steps", wid, [n])
    t0 = time.perf_counter()
    assert engine.advance(store, wid, owner="bench") == "waiting"
    first = time.perf_counter() - t0
    checks, advances = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        assert engine.replay_check(store, wid) is None
        checks.append(time.perf_counter() - t0)
        with store.begin() as conn:  # a spurious wake
            conn.execute(sa.text("UPDATE reliable_beat_workflows SET wake_seq = wake_seq + 1 "
                                 "WHERE workflow_id = :w"), {"w": wid})
        t0 = time.perf_counter()
        assert engine.advance(store, wid, owner="bench") == "waiting"
        advances.append(time.perf_counter() - t0)
    c, a = median(checks), median(advances)
    return [n, f"{first:.2f}", f"{first / n * 1e3:.2f}", f"{c * 1e3:.1f}",
            f"{c / n * 1e6:.0f}", f"{a * 1e3:.1f}", f"{a / n * 1e6:.0f}"]


def _idle(store: Store, k: int) -> list[Any]:
    with store.begin() as conn:  # sizes grow in one database: add what is missing
        have = conn.execute(sa.text("SELECT count(*) FROM reliable_beat_workflows "
                                    "WHERE name = 'bench.sleeper'")).scalar_one()
        conn.execute(sa.text("""
            INSERT INTO reliable_beat_workflows (workflow_id, name, run_no, state, args, kwargs,
                random_seed, fence_token, wake_seq, claimed_wake_seq, history_len,
                history_bytes, advances, created_at, updated_at)
            SELECT 'idle-' || g, 'bench.sleeper', 1, 'waiting', '[]', '{}', g, 1, 1, 1, 1, 40,
                   1, now(), now()
            FROM generate_series(CAST(:a AS integer), CAST(:k AS integer)) g"""),
            {"a": have + 1, "k": k})
        conn.execute(sa.text("""
            INSERT INTO reliable_beat_workflow_events (workflow_pk, run_no, seq, kind,
                args_digest, args, state, fire_at, fence_token, created_at)
            SELECT id, 1, 1, 'timer', '0123456789abcdef', '["sleep", 3600]', 'scheduled',
                   now() + interval '1 hour', 1, now()
            FROM reliable_beat_workflows WHERE name = 'bench.sleeper'
            ON CONFLICT DO NOTHING"""))
        conn.execute(sa.text("""
            INSERT INTO reliable_beat_outbox (message_id, destination, payload, headers, state,
                attempts, available_at, created_at)
            SELECT 'wake:' || workflow_id || ':' || '1t1', 'celery',
                   json_build_object('task', 'reliable_beat.workflow.advance',
                                     'args', json_build_array(workflow_id), 'kwargs', '{}')::jsonb,
                   '{}', 'pending', 0, now() + interval '1 hour', now()
            FROM reliable_beat_workflows WHERE name = 'bench.sleeper'
            ON CONFLICT DO NOTHING"""))
    with store.begin() as conn:
        conn.execute(sa.text("ANALYZE"))
    times = []
    for _ in range(20):
        with store.begin() as conn:
            now = store.now(conn)
            t0 = time.perf_counter()
            got = claim_outbox_batch(store, conn, owner="bench", now=now,
                                     lease=timedelta(seconds=30), limit=500)
            times.append(time.perf_counter() - t0)
            assert got == []
    with store.connect() as conn:
        size = conn.execute(sa.text(
            "SELECT pg_total_relation_size('reliable_beat_workflows') + "
            "pg_total_relation_size('reliable_beat_workflow_events') + "
            "pg_total_relation_size('reliable_beat_outbox')")).scalar_one()
    return [f"{k:,}", f"{median(times) * 1e3:.2f}", f"{size / k:.0f}", "0"]


def run(env: Env) -> str:
    """The markdown of this part."""
    rows, idle = [], []
    with env.database("wfbench") as url:
        store = Store.from_url(url, role="worker")
        try:
            for n in REPLAY_SIZES.get(env.size.name, REPLAY_SIZES["smoke"]):
                rows.append(_replay(store, n))
            for k in IDLE_SIZES.get(env.size.name, IDLE_SIZES["smoke"]):
                idle.append(_idle(store, k))
        finally:
            store.dispose()
    return "\n\n".join([
        "### Workflows: replay cost vs history length (PostgreSQL)",
        table(["events n", "first run s (n record txns)", "ms per recorded step",
               "replay_check ms", "µs/event", "advance on a wake ms", "µs/event"], rows),
        "### Workflows: idle cost of sleeping workflows (timers an hour away)",
        table(["sleeping workflows", "relay claim, nothing due (ms, median of 20)",
               "bytes per workflow (3 tables + indexes)", "workers / messages held"], idle),
    ])
