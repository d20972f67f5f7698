"""1. Dispatch throughput: N entries due at once, slots/s from "due" to "message in Redis".

Ours: k worker processes (k = 1, 2, 4), each looping exactly what
:meth:`ReliableScheduler.tick` does minus the sleep: :meth:`Beat.tick` (claim up to
``batch`` entries FOR UPDATE SKIP LOCKED, insert runs, advance, commit: a due slot's trigger
has no outbox row), :func:`publish_triggers` (one producer connection, then marks the runs
dispatched), its heap
frozen before the clock starts as :class:`~reliable_beat.loop.BeatLoop` freezes it after its
first claim (:func:`reliable_beat.process.freeze_heap`).

Ceilings, same servers, same k, same batch:

* raw SQL: ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n) RETURNING``
  advancing ``next_fire_at``, one transaction per batch, no runs/outbox rows;
* raw kombu: one ``Producer.publish`` per message of a Celery-shaped body over one connection
  (kombu's Redis transport sends one LPUSH per message): the ceiling the issue's targets
  are measured against;
* raw kombu pipelined: the same publishes inside ``Producer.batch()`` (one Redis pipeline per
  ``batch`` messages), which is what ``publish_triggers`` does since the pipelined publish
  landed. Printed next to it so the comparison stays honest: ours is pipelined, the target's
  ceiling is not;
* for reference only, raw redis-py LPUSH pipelined ``batch`` messages per round trip.

The clock stops when N messages are in the Redis list (``LLEN``) or N rows were claimed.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import time
import uuid
from typing import Any

import psycopg

from benchmarks.common import Env, check, median, psycopg_dsn, seed_entries, spread, table

TIMEOUT_S = 300.0
TARGET_CLAIM = 0.5
TARGET_PUBLISH = 0.7
#: the dispatch target: ours against the kombu loop pipelined per batch (the ceiling of a
#: batching publisher)
TARGET_PIPELINED = 0.5


def _celery_app(redis_url: str) -> Any:
    from celery import Celery

    app = Celery("bench_dispatch", broker=redis_url)
    app.conf.broker_connection_retry_on_startup = True
    return app


def _worker(kind: str, db_url: str, redis_url: str, batch: int, ready: Any, go: Any,
            stop: Any, counter: Any) -> None:
    """One process of one configuration; counts what it did into ``counter``."""
    if kind == "ours":
        from reliable_beat.beat import Beat
        from reliable_beat.celery.scheduler import publish_triggers
        from reliable_beat.db.dialects import Store
        from reliable_beat.process import freeze_heap

        store = Store.from_url(db_url, role="beat")
        app = _celery_app(redis_url)
        beat = Beat(store, owner=f"bench:{os.getpid()}", batch_size=batch)
        with store.begin():
            pass
        with app.producer_or_acquire() as p:
            p.connection.ensure_connection()
        freeze_heap()  # as the beat's loop does after its first claim (before the clock here)
        ready.release()
        go.wait()
        while not stop.is_set():
            res = beat.tick()
            if res.triggers:
                assert res.now is not None
                sent = publish_triggers(store, app, res.triggers, res.now)
                with counter.get_lock():
                    counter.value += sent
            elif not res.claimed:
                time.sleep(0.001)
        store.dispose()
    elif kind == "relay":
        from celery import Celery

        from reliable_beat.db.dialects import Store
        from reliable_beat.handlers import CeleryHandler
        from reliable_beat.relay import Relay
        from reliable_beat.settings import Settings

        store = Store.from_url(db_url, role="relay")
        app = Celery("bench_relay", broker=redis_url)
        relay = Relay(store, handlers={"celery": CeleryHandler(app)},
                      settings=Settings(database_url=db_url), batch_size=batch,
                      owner=f"bench-relay:{os.getpid()}")
        with app.producer_or_acquire() as p:
            p.connection.ensure_connection()
        ready.release()
        go.wait()
        while not stop.is_set():
            if not relay.run_once():
                time.sleep(0.001)
        store.dispose()
    elif kind == "sql":
        conn = psycopg.connect(psycopg_dsn(db_url))
        ready.release()
        go.wait()
        while not stop.is_set():
            with conn.transaction():
                rows = conn.execute(
                    """
                    UPDATE reliable_beat_entries e
                       SET last_fire_at = e.next_fire_at,
                           next_fire_at = date_trunc('second', now()) + interval '1 hour',
                           updated_at = now()
                     WHERE e.id IN (
                           SELECT id FROM reliable_beat_entries
                            WHERE enabled AND NOT paused AND next_fire_at IS NOT NULL
                              AND next_fire_at <= now()
                            ORDER BY next_fire_at LIMIT %s
                              FOR UPDATE SKIP LOCKED)
                    RETURNING e.id, e.name, e.task, e.args, e.kwargs, e.options,
                              e.schedule, e.last_fire_at
                    """,
                    (batch,),
                ).fetchall()
            if rows:
                with counter.get_lock():
                    counter.value += len(rows)
            else:
                time.sleep(0.001)
        conn.close()
    elif kind in ("kombu", "kombu_batch", "pipeline"):
        import redis
        from kombu import Connection

        conn = Connection(redis_url)
        producer = conn.Producer()
        r = redis.Redis.from_url(redis_url)
        conn.ensure_connection()
        ready.release()
        go.wait()
        i = 0
        while not stop.is_set():
            if kind in ("kombu", "kombu_batch"):
                with (producer.batch(max_size=batch * 2) if kind == "kombu_batch"
                      else contextlib.nullcontext()):
                    for _ in range(batch):
                        i += 1
                        tid = str(uuid.uuid4())
                        producer.publish(
                            [[f"bench-{i}"], {}, {"callbacks": None, "errbacks": None,
                                                   "chain": None, "chord": None}],
                            exchange="", routing_key="celery", serializer="json",
                            headers={"lang": "py", "task": "bench.noop", "id": tid,
                                     "root_id": tid, "parent_id": None, "retries": 0,
                                     "reliable_beat_key": f"bench-{i}@2026-01-01T00:00:00Z",
                                     "reliable_beat_fire_at": "2026-01-01T00:00:00Z"},
                        )
            else:
                pipe = r.pipeline(transaction=False)
                for _ in range(batch):
                    i += 1
                    pipe.lpush("celery", json.dumps({"body": "x" * 400, "n": i}))
                pipe.execute()
            with counter.get_lock():
                counter.value += batch
        conn.release()
        r.close()


def start_workers(kind: str, procs: int, db_url: str, redis_url: str, batch: int, *,
                  timeout: float, label: str) -> tuple[list[Any], Any, Any, Any]:
    """``procs`` spawned :func:`_worker` processes of ``kind``, started and ready, held until
    ``go`` is set: ``(processes, go, stop, counter)``. Raises RuntimeError if one does not
    report ready within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    ready, go, stop = ctx.Semaphore(0), ctx.Event(), ctx.Event()
    counter = ctx.Value("q", 0)
    ps = [ctx.Process(target=_worker, args=(kind, db_url, redis_url, batch, ready, go,
                                            stop, counter), daemon=True) for _ in range(procs)]
    for p in ps:
        p.start()
    for _ in ps:
        if not ready.acquire(timeout=timeout):
            raise RuntimeError(f"{label} {kind}: a process did not start")
    return ps, go, stop, counter


def _run(kind: str, procs: int, env: Env, db_url: str, n: int, batch: int) -> float:
    """Start ``procs`` processes of ``kind``; slots (or messages) per second until ``n``."""
    import redis

    ps, go, stop, counter = start_workers(kind, procs, db_url, env.redis_url, batch,
                                          timeout=60, label="dispatch")
    r = redis.Redis.from_url(env.redis_url)
    t0 = time.perf_counter()
    go.set()
    done = 0
    while time.perf_counter() - t0 < TIMEOUT_S:
        done = int(r.llen("celery")) if kind != "sql" else counter.value
        if done >= n:
            break
        time.sleep(0.002)
    elapsed = time.perf_counter() - t0
    stop.set()
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    r.close()
    return done / elapsed


def _reset(env: Env, db_url: str, n: int) -> None:
    env.flush_redis()
    with psycopg.connect(psycopg_dsn(db_url), autocommit=True) as conn:
        conn.execute("TRUNCATE reliable_beat_entries, reliable_beat_runs, reliable_beat_outbox,"
                     " reliable_beat_attempts RESTART IDENTITY")
    # Every entry due once: an interval of one hour, the slot 2 s ago (inside the grace).
    # With a 1 s interval a backlog that takes longer than 1 s to drain makes every entry
    # miss slots, which the beat (correctly) records as skipped runs and the raw loop does
    # not: the comparison would no longer be like for like.
    seed_entries(db_url, 0, n, due_in="-2 seconds", every=3600, grace=60)


def run(env: Env) -> str:
    n, batch, repeats = env.size.dispatch_n, env.size.dispatch_batch, env.size.repeats
    kinds = ("ours", "sql", "kombu", "kombu_batch", "pipeline")
    #: (procs, kind) -> one rate per run; runs interleaved (every k and kind once, then
    #: again), so a noisy minute of the machine spreads over all of them
    rates: dict[tuple[int, str], list[float]] = {}
    with env.database("dispatch") as db_url:
        for _ in range(repeats):
            for procs in env.size.dispatch_procs:
                for kind in kinds:
                    _reset(env, db_url, n)
                    rates.setdefault((procs, kind), []).append(
                        _run(kind, procs, env, db_url, n, batch))
    rows = []
    for procs in env.size.dispatch_procs:
        got = {kind: rates[(procs, kind)] for kind in kinds}
        runs = range(len(got["ours"]))
        ceiling = [min(got["sql"][i], got["kombu"][i]) for i in runs]
        binding = "claim" if median(got["sql"]) <= median(got["kombu"]) else "publish"
        target = TARGET_CLAIM if binding == "claim" else TARGET_PUBLISH
        ratio = [got["ours"][i] / ceiling[i] for i in runs]
        piped = [got["ours"][i] / got["kombu_batch"][i] for i in runs]
        rows.append([procs, *(spread(got[kind]) for kind in kinds), binding,
                     spread([100 * r for r in ratio], "%"), f"≥ {target:.0%} of {binding}",
                     check(min(ratio) >= target), spread([100 * r for r in piped], "%"),
                     f"≥ {TARGET_PIPELINED:.0%}", check(min(piped) >= TARGET_PIPELINED)])
    runs_note = (f"{repeats} runs, interleaved; each cell the median and range"
                 if repeats > 1 else "one run")
    out = [
        f"### 1. Dispatch throughput ({n:,} entries due at once, every 1 h, batch {batch}; "
        f"{runs_note})",
        "",
        "Ours = `Beat.tick` + `publish_triggers` (publish + mark sent) looped in k worker "
        "processes (the `ReliableScheduler.tick` path without its sleep), not `celery beat` "
        "processes. Rates are slots (or messages) per second until N are in Redis. The first "
        "target is against the raw kombu loop (one LPUSH round trip per message); ours "
        "publishes through one Redis pipeline per batch, so the last columns compare it with "
        "the same kombu loop pipelined the same way (`Producer.batch()`): the dispatch target. "
        "A target is met when every run meets it.",
        "",
        table(["beats (k)", "ours slots/s", "raw SQL claim+advance /s", "raw kombu publish /s",
               "raw kombu pipelined /s", "raw LPUSH pipelined /s (ref.)", "binding ceiling",
               "ours / min(ceilings)", "target", "", "ours / kombu pipelined", "target", ""],
              rows),
    ]
    return "\n".join(out)


def _seed_outbox(env: Env, db_url: str, n: int) -> None:
    """``n`` pending ``celery`` outbox rows, the payload shape ``outbox.add`` callers write."""
    env.flush_redis()
    with psycopg.connect(psycopg_dsn(db_url), autocommit=True) as conn:
        conn.execute("TRUNCATE reliable_beat_outbox RESTART IDENTITY")
        conn.execute(
            """
            INSERT INTO reliable_beat_outbox
              (message_id, destination, payload, headers, state, attempts, available_at,
               created_at)
            SELECT 'bench:' || g, 'celery',
                   jsonb_build_object('task', 'bench.noop', 'args', jsonb_build_array(g),
                                      'kwargs', '{}'::jsonb),
                   '{}'::jsonb, 'pending', 0, now() - interval '1 second', now()
            FROM generate_series(1, %s) AS g
            """,
            (n,),
        )
        conn.execute("ANALYZE reliable_beat_outbox")


def run_relay(env: Env) -> str:
    """5. Relay throughput: outbox rows/s into Redis by k relays (1 and 2) vs raw kombu."""
    n, batch = env.size.relay_n, env.size.dispatch_batch
    try:
        import reliable_beat.relay  # noqa: F401
    except ImportError:
        return "### 5. Relay throughput\n\npending: `reliable_beat/relay.py` has not landed."
    repeats = env.size.repeats
    got: dict[tuple[int, str], list[float]] = {}
    with env.database("relay") as db_url:
        for _ in range(repeats):
            for procs in env.size.relay_procs:
                for kind in ("relay", "kombu", "kombu_batch"):
                    if kind == "relay":
                        _seed_outbox(env, db_url, n)
                    else:
                        env.flush_redis()
                    got.setdefault((procs, kind), []).append(
                        _run(kind, procs, env, db_url, n, batch))
    rows = []
    for procs in env.size.relay_procs:
        ours, raw, raw_batch = (got[(procs, k)] for k in ("relay", "kombu", "kombu_batch"))
        ratio = [o / r for o, r in zip(ours, raw, strict=True)]
        rows.append([procs, spread(ours), spread(raw), spread([100 * r for r in ratio], "%"),
                     "≥ 70%", check(min(ratio) >= 0.7), spread(raw_batch),
                     spread([100 * o / b for o, b in zip(ours, raw_batch, strict=True)], "%")])
    return "\n".join([
        f"### 5. Relay throughput ({n:,} pending `celery` outbox rows, batch {batch})",
        "",
        "`Relay.run_once` looped in k processes (claim SKIP LOCKED → `CeleryHandler` "
        "`send_task` over one producer → mark sent) vs the raw kombu publish loop of part 1 "
        "with k processes, same Redis (and, last columns, that loop pipelined per batch like "
        "the relay's publish).",
        "",
        table(["relays (k)", "relay rows/s", "raw kombu publish /s", "relay / raw", "target", "",
               "raw kombu pipelined /s", "relay / pipelined"], rows),
    ])
