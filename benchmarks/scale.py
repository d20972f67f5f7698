"""2. Scale: idle tick cost and beat RSS against the number of entries.

Each measurement runs in a fresh process (``python -m benchmarks.scale child ...``) that
builds the scheduler the way ``celery beat`` does (``ReliableScheduler(app)``,
``PersistentScheduler(app)``, ``RedBeatScheduler(app)``), ticks it, and reports the median
tick time and its RSS (``VmRSS``). For ours the tick measured is :meth:`Beat.tick` (the
database work of ``ReliableScheduler.tick``; its wait on ``LISTEN`` is left out).

Entries are seeded straight into the store: one ``INSERT ... SELECT generate_series`` for
ours (all due in 1-2 days, so nothing is due), one Redis pipeline for RedBeat (hash +
sorted-set member per entry, the layout ``RedBeatSchedulerEntry.save`` writes), the Celery
``beat_schedule`` dict for stock beat (loaded into its shelve at start).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

from benchmarks.common import Env, check, rss_kib, run_child, seed_entries, table

IDLE_TICKS = 30
TARGET_TICK = 2.0
TARGET_RSS = 0.10
CLAIM_SQL = "FOR UPDATE SKIP LOCKED"


def _timed_ticks(fn: Any, n: int = IDLE_TICKS) -> float:
    """Median wall time of ``fn()`` in ms over ``n`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def child_ours(db_url: str, redis_url: str, due: int) -> dict[str, Any]:
    from celery import Celery
    from sqlalchemy import event

    from reliable_beat.beat import Beat
    from reliable_beat.celery.scheduler import ReliableScheduler

    app = Celery("bench_scale", broker=redis_url)
    app.conf.reliable_beat_database_url = db_url
    app.conf.beat_schedule = {}
    t0 = time.perf_counter()
    sched = ReliableScheduler(app)
    load_s = time.perf_counter() - t0
    beat = sched.loop.beat
    tick_ms = _timed_ticks(beat.tick)
    out: dict[str, Any] = {"load_s": load_s, "tick_ms": tick_ms, "rss_kib": rss_kib()}
    if due:
        import psycopg

        from benchmarks.common import psycopg_dsn

        with psycopg.connect(psycopg_dsn(db_url), autocommit=True) as conn:
            conn.execute(
                "UPDATE reliable_beat_entries SET next_fire_at = date_trunc('second', now())"
                " WHERE id IN (SELECT id FROM reliable_beat_entries ORDER BY id LIMIT %s)",
                (due,))
        captured: list[tuple[str, Any]] = []

        def capture(conn: Any, cursor: Any, statement: str, params: Any, context: Any,
                    executemany: bool) -> None:
            if CLAIM_SQL in statement and not captured:
                captured.append((statement, params))

        event.listen(sched.store.engine, "before_cursor_execute", capture)
        big = Beat(sched.store, owner="bench", batch_size=due)
        t0 = time.perf_counter()
        res = big.tick()
        out["due_tick_ms"] = (time.perf_counter() - t0) * 1000
        out["due_fired"] = len(res.triggers)
        event.remove(sched.store.engine, "before_cursor_execute", capture)
        stmt, params = captured[0]
        with sched.store.engine.connect() as conn:
            plan = conn.exec_driver_sql("EXPLAIN " + stmt, params).scalars().all()
        out["plan"] = plan
        out["rss_after_due_kib"] = rss_kib()
    sched.close()
    return out


def child_stock(n: int, redis_url: str) -> dict[str, Any]:
    from celery import Celery
    from celery.beat import PersistentScheduler

    app = Celery("bench_scale", broker=redis_url)
    app.conf.beat_schedule = {
        f"bench-{i}": {"task": "bench.noop", "schedule": timedelta(days=1)} for i in range(n)
    }
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        sched = PersistentScheduler(app, schedule_filename=os.path.join(tmp, "beat"))
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sched.tick()
        first_ms = (time.perf_counter() - t0) * 1000
        tick_ms = _timed_ticks(sched.tick)
        rss = rss_kib()
        sched.close()
    return {"load_s": load_s, "first_tick_ms": first_ms, "tick_ms": tick_ms, "rss_kib": rss}


def child_redbeat(n: int, redis_url: str) -> dict[str, Any]:
    from celery import Celery
    from redbeat import RedBeatScheduler

    app = Celery("bench_scale", broker=redis_url)
    app.conf.redbeat_redis_url = redis_url
    app.conf.beat_schedule = {}
    t0 = time.perf_counter()
    sched = RedBeatScheduler(app)
    sched.lock_key = None  # the lock is taken by `celery beat` at start; one process here
    load_s = time.perf_counter() - t0
    tick_ms = _timed_ticks(sched.tick)
    return {"load_s": load_s, "tick_ms": tick_ms, "rss_kib": rss_kib()}


def seed_redbeat(redis_url: str, start: int, stop: int) -> float:
    """Write RedBeat entries ``bench-<i>`` (every 1 day, next due in 1-2 days) by pipeline."""
    import random

    import redis
    from celery import Celery
    from celery.schedules import schedule
    from redbeat.decoder import RedBeatJSONEncoder

    app = Celery("seed")
    t0 = time.perf_counter()
    r = redis.Redis.from_url(redis_url)
    sched = json.dumps(schedule(timedelta(days=1), app=app), cls=RedBeatJSONEncoder)
    now = time.time()
    pipe = r.pipeline(transaction=False)
    for i in range(start, stop):
        name = f"bench-{i}"
        definition = (f'{{"name": "{name}", "task": "bench.noop", "args": [], "kwargs": {{}}, '
                      f'"options": {{}}, "schedule": {sched}, "enabled": true}}')
        last = now + random.random() * 86400
        pipe.hset(f"redbeat:{name}", mapping={
            "definition": definition,
            "meta": json.dumps({"last_run_at": {"__type__": "datetime",
                                                "timestamp": last}}),
        })
        pipe.zadd("redbeat::schedule", {f"redbeat:{name}": last + 86400})
        if i % 5000 == 0:
            pipe.execute()
    pipe.execute()
    r.close()
    return time.perf_counter() - t0


def run(env: Env) -> str:
    size = env.size
    sizes = size.scale_sizes
    rows: list[list[Any]] = []
    ours: dict[int, dict[str, Any]] = {}
    notes: list[str] = []
    with env.database("scale") as db_url:
        seeded = 0
        for n in sizes:
            secs = seed_entries(db_url, seeded, n, due_in="1 day", spread="1 day", grace=60)
            seeded = n
            notes.append(f"seeded up to {n:,} entries in {secs:.1f} s")
            due = 1000 if n == sizes[-1] else 0
            ours[n] = run_child(["-m", "benchmarks.scale", "child", "ours", db_url,
                                 env.redis_url, str(due)])
    stock: dict[int, dict[str, Any]] = {}
    for n in size.stock_sizes:
        try:
            stock[n] = run_child(["-m", "benchmarks.scale", "child", "stock", str(n),
                                  env.redis_url], timeout=900)
        except Exception as exc:
            notes.append(f"stock beat at {n:,}: failed ({str(exc)[:200]})")
    redbeat: dict[int, dict[str, Any]] = {}
    try:
        import redbeat as _rb  # noqa: F401

        env.flush_redis()
        seeded = 0
        for n in size.redbeat_sizes:
            secs = seed_redbeat(env.redis_url, seeded, n)
            seeded = n
            notes.append(f"RedBeat: seeded up to {n:,} entries in {secs:.1f} s")
            redbeat[n] = run_child(["-m", "benchmarks.scale", "child", "redbeat", str(n),
                                    env.redis_url])
        env.flush_redis()
    except ImportError:
        notes.append("RedBeat not installed (`pip install celery-redbeat`): not measured")

    all_n = sorted(set(sizes) | set(size.stock_sizes) | set(size.redbeat_sizes))

    def fmt(d: dict[int, dict[str, Any]], n: int, key: str, scale: float = 1.0) -> Any:
        return d[n][key] / scale if n in d else "-"

    for n in all_n:
        rows.append([n, fmt(ours, n, "tick_ms"), fmt(ours, n, "rss_kib", 1024),
                     fmt(stock, n, "tick_ms"), fmt(stock, n, "rss_kib", 1024),
                     fmt(stock, n, "load_s"),
                     fmt(redbeat, n, "tick_ms"), fmt(redbeat, n, "rss_kib", 1024)])
    small, large = sizes[0], sizes[-1]
    tick_ratio = ours[large]["tick_ms"] / ours[small]["tick_ms"]
    rss_ratio = ours[large]["rss_kib"] / ours[small]["rss_kib"] - 1
    big = ours[large]
    plan = "\n".join(big.get("plan", []))
    uses_index = "ix_reliable_beat_entries_due" in plan
    out = [
        "### 2. Scale (idle tick = nothing due; RSS of the scheduler process after the ticks)",
        "",
        table(["entries", "ours idle tick ms", "ours RSS MiB", "stock beat idle tick ms",
               "stock RSS MiB", "stock load s", "RedBeat idle tick ms", "RedBeat RSS MiB"],
              rows),
        "",
        table(["ratio", "measured", "target", ""], [
            [f"idle tick {large:,} / {small:,}", f"{tick_ratio:.2f}x", "≤ 2x",
             check(tick_ratio <= TARGET_TICK)],
            [f"RSS {large:,} vs {small:,}", f"{rss_ratio:+.1%}", "≤ +10%",
             check(rss_ratio <= TARGET_RSS)],
            [f"one tick, 1,000 due among {large:,}", f"{big['due_tick_ms']:.0f} ms "
             f"({big['due_fired']:,} fired)", "partial index in plan", check(uses_index)],
        ]),
        "",
        f"`EXPLAIN` of the claim at {large:,} entries:",
        "",
        "```",
        plan,
        "```",
        "",
        *[f"- {n}" for n in notes],
    ]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        kind = sys.argv[2]
        if kind == "ours":
            result = child_ours(sys.argv[3], sys.argv[4], int(sys.argv[5]))
        elif kind == "stock":
            result = child_stock(int(sys.argv[3]), sys.argv[4])
        else:
            result = child_redbeat(int(sys.argv[3]), sys.argv[4])
        print(json.dumps(result))
