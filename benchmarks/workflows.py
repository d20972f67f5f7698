"""Durable workflows: replay cost vs history length, and the idle cost of sleeping workflows.

* **replay**: a workflow of *n* inline steps then ``wait_signal`` is driven to its wait; then
  (a) ``replay_check`` (load the history + replay it, no writes) and (b) a full advance on a
  spurious wake (claim, load, replay, release) are timed, median of 5: µs per replayed event.
* **idle**: *k* workflows asleep on timers an hour away (their rows, timer events and outbox
  wake rows inserted in bulk, as ``ctx.sleep`` writes them); the relay's claim of due rows
  (``claim_outbox_batch``, nothing due) is timed, median of 20, and the table sizes shown.
  No process holds anything for them: the cost is rows and one index scan per relay poll.
* **round trips** (also alone: ``python -m benchmarks --only workflow_round_trips``): a
  workflow of *k* sequential activities against a Celery chain of *k* plain links, on one
  solo worker and one relay, side by side in the same run; ``WFB_REPEAT`` runs (default 3),
  each on a fresh database, ``WFB_K`` activities (default 20; 200 at ``--size full``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from benchmarks.common import Env, median, table
from reliable_beat.db.dialects import Store
from reliable_beat.relay import claim_outbox_batch
from reliable_beat.workflows import engine
from reliable_beat.workflows.context import WorkflowContext

REPLAY_SIZES = {"smoke": [100], "full": [100, 500, 1000, 2000]}
IDLE_SIZES = {"smoke": [1_000], "full": [10_000, 100_000]}
RT_SIZES = {"smoke": int(os.environ.get("WFB_K", "20")), "full": 200}


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
    with store.begin() as conn:  # driven by hand here: its start message is not needed
        conn.execute(sa.text("UPDATE reliable_beat_outbox SET state = 'sent' "
                             "WHERE message_id = :m"), {"m": f"wake:{wid}:start"})
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
    rows, idle, trips = [], [], []
    with env.database("wfbench") as url:
        store = Store.from_url(url, role="worker")
        try:
            for n in REPLAY_SIZES.get(env.size.name, REPLAY_SIZES["smoke"]):
                rows.append(_replay(store, n))
            for k in IDLE_SIZES.get(env.size.name, IDLE_SIZES["smoke"]):
                idle.append(_idle(store, k))
            trips = [_round_trips(env, url, RT_SIZES.get(env.size.name, 20))]
        finally:
            store.dispose()
    return "\n\n".join([
        "### Workflows: replay cost vs history length (PostgreSQL)",
        table(["events n", "first run s (n record txns)", "ms per recorded step",
               "replay_check ms", "µs/event", "advance on a wake ms", "µs/event"], rows),
        "### Workflows: idle cost of sleeping workflows (timers an hour away)",
        table(["sleeping workflows", "relay claim, nothing due (ms, median of 20)",
               "bytes per workflow (3 tables + indexes)", "workers / messages held"], idle),
        "### Workflows: activity round trips vs a plain Celery chain (1 solo worker, 1 relay)",
        table(["steps k", "chain links/s", "workflow activities/s",
               "ms per activity round trip"], trips),
    ])


def run_round_trips(env: Env) -> str:
    """The markdown of the round-trip part alone: ``WFB_REPEAT`` runs, the range of each."""
    k = RT_SIZES.get(env.size.name, 20)
    rows = []
    for _ in range(int(os.environ.get("WFB_REPEAT", "3"))):
        with env.database("wfrt") as url:
            rows.append(_round_trips(env, url, k))
    chain = [float(r[1]) for r in rows]
    wf = [float(r[2]) for r in rows]
    ratio = [w / c for w, c in zip(wf, chain, strict=True)]
    ms = sorted(float(r[3]) for r in rows)
    rows.append(["range", f"{min(chain):.0f}-{max(chain):.0f}", f"{min(wf):.1f}-{max(wf):.1f}",
                 f"workflow/chain {min(ratio):.2f}-{max(ratio):.2f}; ms median "
                 f"{ms[len(ms) // 2]:.1f} ({ms[0]:.1f}-{ms[-1]:.1f})",
                 *[""] * (len(rows[0]) - 4)])
    return "\n\n".join([
        f"### Workflows: activity round trips vs a plain Celery chain ({len(rows) - 1} runs, "
        "1 solo worker, 1 relay)",
        table(["steps k", "chain links/s", "workflow activities/s",
               "ms per activity round trip", *_CPU_COLUMNS][:len(rows[0])], rows),
    ])


#: With WFB_CPU set, the round trips' extra columns (per workflow step).
_CPU_COLUMNS = ["worker CPU ms", "relay CPU ms", "PostgreSQL CPU ms", "Redis CPU ms",
                "LPUSH (messages)", "BRPOP"]


def _round_trips(env: Env, url: str, k: int) -> list[Any]:
    """One workflow of ``k`` sequential activities vs a Celery chain of ``k`` links, on one
    solo worker and one relay: round trips per second of each."""
    import subprocess
    import tempfile

    from celery import chain

    from benchmarks.common import PY, ROOT

    os.environ["WB_BROKER"], os.environ["WB_DB"] = env.redis_url, url
    from benchmarks import workflow_app as wa

    wa.done_table.create(sa.create_engine(url), checkfirst=True)
    env.flush_redis()
    tmp = tempfile.mkdtemp(prefix="wfbench")
    penv = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    for name, args in (
        ("worker", ["-m", "celery", "-A", "benchmarks.workflow_app:app", "worker", "-Q",
                    wa.QUEUE, "--pool", "solo",
                    f"--loglevel={os.environ.get('WFB_WORKER_LOG', 'WARNING')}", "--without-gossip",
                    "--without-mingle", "--without-heartbeat", "-n", "wfb@%h"]),
        ("relay", ["-m", "reliable_beat.cli", "-A", "benchmarks.workflow_app:app", "relay",
                   "--loglevel", os.environ.get("WFB_LOG", "WARNING")]),
    ):
        log = open(os.path.join(tmp, f"{name}.log"), "ab")  # noqa: SIM115
        procs.append(subprocess.Popen([PY, *args], env=penv, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    store = Store.from_url(url, role="cli")
    eng = sa.create_engine(url)
    try:
        time.sleep(3)  # let the worker and relay start (outside the clock)
        t0 = time.perf_counter()
        chain(*[wa.link.si(i) for i in range(k)], wa.done.si("c")).apply_async()
        deadline = time.monotonic() + 300
        while True:
            with eng.connect() as conn:
                if conn.execute(sa.text("SELECT count(*) FROM bench_chain_done")).scalar():
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"chain did not finish (logs in {tmp})")
            time.sleep(0.002)
        chain_s = time.perf_counter() - t0
        measure = bool(os.environ.get("WFB_CPU"))  # needs psutil (not a dependency)
        cpu0 = _cpu(procs, eng, env.redis_url) if measure else {}
        t0 = time.perf_counter()
        handle = wa.wf_chain.start("rt", args=(k,), store=store)
        assert handle.result(timeout=600, interval=0.005) == k * (k - 1) // 2
        wf_s = time.perf_counter() - t0
        cpu = ({n: (v - cpu0[n]) / k for n, v in _cpu(procs, eng, env.redis_url).items()}
               if measure else {})
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        store.dispose()
        eng.dispose()
    row = [k, f"{k / chain_s:.0f}", f"{k / wf_s:.1f}", f"{wf_s / k * 1e3:.1f}"]
    if cpu:  # WFB_CPU: per workflow step, CPU ms of each process, messages
        row += [f"{cpu['worker'] * 1e3:.2f}", f"{cpu['relay'] * 1e3:.2f}",
                f"{cpu['postgres'] * 1e3:.2f}", f"{cpu['redis'] * 1e3:.2f}",
                f"{cpu['lpush']:.2f}", f"{cpu['brpop']:.2f}"]
    return row


def _cpu(procs: list[Any], eng: Any, redis_url: str) -> dict[str, float]:
    """CPU seconds so far of the worker, the relay, every PostgreSQL process and Redis, and
    Redis's LPUSH / BRPOP call counts (a Celery message published / a fetch)."""
    import psutil
    import redis

    def seconds(p: Any) -> float:
        try:
            t = p.cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return 0.0

    with eng.connect() as conn:
        backend = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
    postmaster = psutil.Process(backend).parent()
    r = redis.Redis.from_url(redis_url)
    info, stats = r.info("cpu"), r.info("commandstats")
    r.close()
    return {
        "worker": seconds(psutil.Process(procs[0].pid)),
        "relay": seconds(psutil.Process(procs[1].pid)),
        "postgres": seconds(postmaster) + sum(seconds(c) for c in postmaster.children()),
        "redis": float(info["used_cpu_sys"] + info["used_cpu_user"]),
        "lpush": float(stats.get("cmdstat_lpush", {}).get("calls", 0)),
        "brpop": float(stats.get("cmdstat_brpop", {}).get("calls", 0)),
    }
