"""1b. Dispatch throughput on RabbitMQ: part 1 with the ``pyamqp`` transport.

``python -m benchmarks --only dispatch_amqp`` (a private RabbitMQ node unless
``--amqp-url``). N interval entries due at once, slots/s from "due" to "message in the
durable ``celery`` queue" (the queue's ``message_count``, polled with a passive
``queue.declare``), with k = part 1's process counts.

Ours: k processes looping :meth:`Beat.tick` + :func:`publish_triggers` exactly as part 1
(:func:`benchmarks.dispatch._worker`): each batch is published on a publisher-confirm channel
and the broker's confirms are awaited once per batch before the rows are marked sent; the
messages after each shape's first are hand-built (``_MessageBuilder``).

Ceilings, same k, same batch, persistent Celery-shaped messages (delivery mode 2) to the
same durable queue, over one connection per process:

* raw SQL: part 1's claim + advance loop (no runs, no outbox rows);
* raw kombu, confirm per message (``confirm_publish``): one round trip per message, what
  Celery does by itself when told to confirm; AMQP's counterpart of part 1's unpipelined
  loop;
* raw kombu, batch confirmed: ``confirm.select``, ``batch`` publishes back to back, then one
  wait for the acks: the same guarantee as ours (a message counts once the broker acked it)
  without any per-message round trip: **the ceiling ours is measured against**;
* raw kombu, no confirms (reference): ``basic.publish`` never waits for an answer, so it is
  pipelined by itself; fastest, but "sent" proves nothing.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import uuid
from typing import Any

from benchmarks.common import Env, check, spread, table
from benchmarks.dispatch import _reset, start_workers

TIMEOUT_S = 300.0
#: ours against the batch-confirmed kombu loop (the guarantee ours gives), as part 1's
#: target against the pipelined Redis loop
TARGET = 0.5
QUEUE = "celery"
RAW_KINDS = ("kombu_confirm_each", "kombu_confirm_batch", "kombu_no_confirm")


def _message(i: int) -> tuple[Any, dict[str, Any]]:
    """Part 1's Celery-shaped body and headers."""
    tid = str(uuid.uuid4())
    return ([[f"bench-{i}"], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                  "chord": None}],
            {"lang": "py", "task": "bench.noop", "id": tid, "root_id": tid, "parent_id": None,
             "retries": 0, "reliable_beat_key": f"bench-{i}@2026-01-01T00:00:00Z",
             "reliable_beat_fire_at": "2026-01-01T00:00:00Z"})


def _raw_worker(kind: str, url: str, batch: int, ready: Any, go: Any, stop: Any,
                counter: Any) -> None:
    """One raw publishing process: ``batch`` messages per round until ``stop``."""
    from kombu import Connection, Producer

    conn = Connection(url, transport_options={"confirm_publish": kind == "kombu_confirm_each"})
    conn.ensure_connection()
    channel = conn.channel()
    acked = [0]
    if kind == "kombu_confirm_batch":
        channel.confirm_select()

        def on_ack(tag: int, multiple: bool) -> None:
            acked[0] = tag  # tags are 1, 2, ... in publish order; ``multiple`` covers up to it

        channel.events["basic_ack"].add(on_ack)
    producer = Producer(channel, auto_declare=False)
    ready.release()
    go.wait()
    i = 0
    while not stop.is_set():
        for _ in range(batch):
            i += 1
            body, headers = _message(i)
            producer.publish(body, exchange="", routing_key=QUEUE, serializer="json",
                             delivery_mode=2, headers=headers, retry=False)
        if kind == "kombu_confirm_batch":
            deadline = time.monotonic() + 30
            while acked[0] < i and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=1.0)
                except TimeoutError:
                    continue
        with counter.get_lock():
            counter.value += batch
    conn.release()


def _start_raw(kind: str, procs: int, url: str, batch: int) -> tuple[list[Any], Any, Any]:
    ctx = mp.get_context("spawn")
    ready, go, stop = ctx.Semaphore(0), ctx.Event(), ctx.Event()
    counter = ctx.Value("q", 0)
    ps = [ctx.Process(target=_raw_worker, args=(kind, url, batch, ready, go, stop, counter),
                      daemon=True) for _ in range(procs)]
    for p in ps:
        p.start()
    for _ in ps:
        if not ready.acquire(timeout=60):
            raise RuntimeError(f"dispatch_amqp {kind}: a process did not start")
    return ps, go, stop


def _depth(channel: Any) -> int:
    return int(channel.queue_declare(QUEUE, durable=True, auto_delete=False,
                                     passive=True).message_count)


def _run(kind: str, procs: int, env: Env, db_url: str, n: int, batch: int) -> float:
    """Slots (or messages) per second until ``n`` are in the queue (``sql``: claimed)."""
    from kombu import Connection

    assert env.amqp_url is not None
    counter = None
    if kind in ("ours", "sql"):
        ps, go, stop, counter = start_workers(kind, procs, db_url, env.amqp_url, batch,
                                              timeout=60, label="dispatch_amqp")
    else:
        ps, go, stop = _start_raw(kind, procs, env.amqp_url, batch)
    with Connection(env.amqp_url) as conn:
        channel = conn.channel()
        t0 = time.perf_counter()
        go.set()
        done = 0
        while time.perf_counter() - t0 < TIMEOUT_S:
            done = counter.value if kind == "sql" and counter is not None else _depth(channel)
            if done >= n:
                break
            time.sleep(0.002)
        elapsed = time.perf_counter() - t0
        stop.set()
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    return done / elapsed


def _purge(url: str) -> None:
    from kombu import Connection

    with Connection(url) as conn:
        channel = conn.channel()
        channel.queue_declare(QUEUE, durable=True, auto_delete=False)  # as Celery declares it
        channel.queue_purge(QUEUE)


def _server_version(url: str) -> str:
    from kombu import Connection

    with Connection(url) as conn:
        conn.ensure_connection()
        version = conn.connection.server_properties.get("version", "?")
        return version.decode() if isinstance(version, bytes) else str(version)


def run(env: Env) -> str:
    if env.amqp_url is None:
        return "### 1b. Dispatch throughput on RabbitMQ\n\nskipped: no RabbitMQ (--amqp-url)."
    n, batch = env.size.dispatch_n, env.size.dispatch_batch
    procs_list = (1, 2)  # at every size (smoke's part 1 runs k = 1 only)
    repeats = max(1, env.size.repeats)
    rows = []
    with env.database("dispatch_amqp") as db_url:
        for procs in procs_list:
            # every kind once per run, side by side; ratios are taken within a run
            runs: list[dict[str, float]] = []
            for _ in range(repeats):
                rates: dict[str, float] = {}
                for kind in ("ours", "sql", *RAW_KINDS):
                    _reset(env, db_url, n)
                    _purge(env.amqp_url)
                    rates[kind] = _run(kind, procs, env, db_url, n, batch)
                runs.append(rates)
            _purge(env.amqp_url)

            def col(kind: str, runs: list[dict[str, float]] = runs) -> list[float]:
                return [r[kind] for r in runs]

            def ratio(over: str, runs: list[dict[str, float]] = runs) -> list[float]:
                return [r["ours"] / r[over] for r in runs]

            batch_ratio = ratio("kombu_confirm_batch")
            rows.append([procs, spread(col("ours")), spread(col("sql")),
                         spread(col("kombu_confirm_each")), spread(col("kombu_confirm_batch")),
                         spread(col("kombu_no_confirm")),
                         spread([100 * x for x in batch_ratio], "%", 0), f"≥ {TARGET:.0%}",
                         check(all(x >= TARGET for x in batch_ratio)),
                         spread([100 * x for x in ratio("kombu_confirm_each")], "%", 0),
                         spread([100 * x for x in ratio("kombu_no_confirm")], "%", 0)])
    return "\n".join([
        f"### 1b. Dispatch throughput on RabbitMQ {_server_version(env.amqp_url)} "
        f"({n:,} entries due at once, every 1 h, batch {batch})",
        "",
        "Part 1 on RabbitMQ (`pyamqp`). Ours = `Beat.tick` + `publish_triggers` looped in k "
        "processes: each batch on a publisher-confirm channel, one confirm wait per batch, "
        "messages hand-built after each shape's first. Rates until N persistent messages are "
        "in the durable `celery` queue. The target is against the raw kombu loop that gives "
        "the same guarantee without per-message round trips (batch published, then one wait "
        "for the broker's acks); beside it the loop confirming each message "
        "(`confirm_publish`) and the loop with no confirms at all (pipelined by itself, "
        "proves nothing). "
        + (f"Each cell: median (range) of {repeats} runs, every kind measured once per run; "
           "the target holds only if it holds in every run." if repeats > 1 else ""),
        "",
        table(["beats (k)", "ours slots/s", "raw SQL claim+advance /s",
               "raw kombu, confirm each /s", "raw kombu, batch confirmed /s",
               "raw kombu, no confirms /s (ref.)", "ours / batch confirmed", "target", "",
               "ours / confirm each", "ours / no confirms"], rows),
    ])


def cpu_per_slot(env: Env, db_url: str, n: int, batch: int, *,
                 builder: bool) -> tuple[float, float]:
    """One process, in this one: ``n`` due entries dispatched to RabbitMQ by ``Beat.tick`` +
    ``publish_triggers``, with the hand-built messages on or off (``send_task`` for every
    message). Returns (this process's CPU per slot in µs, slots/s): the CPU figure does not
    depend on the machine's other load, the rate does."""
    from unittest import mock

    from benchmarks.dispatch import _celery_app
    from reliable_beat.beat import Beat
    from reliable_beat.celery import publishing
    from reliable_beat.celery.scheduler import publish_triggers
    from reliable_beat.db.dialects import Store

    assert env.amqp_url is not None
    _reset(env, db_url, n)
    _purge(env.amqp_url)
    store = Store.from_url(db_url, role="beat")
    app = _celery_app(env.amqp_url)
    beat = Beat(store, owner="bench-cpu", batch_size=batch)
    with app.producer_or_acquire() as p:
        p.connection.ensure_connection()
    off = mock.patch.object(publishing._MessageBuilder, "for_batch",
                            classmethod(lambda cls, app: None))
    with contextlib.nullcontext() if builder else off:
        sent = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        while sent < n and time.perf_counter() - t0 < TIMEOUT_S:
            res = beat.tick()
            if res.triggers:
                assert res.now is not None
                sent += publish_triggers(store, app, res.triggers, res.now)
            elif not res.claimed:
                time.sleep(0.001)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    app.close()
    store.dispose()
    return cpu / max(sent, 1) * 1e6, sent / wall


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.dispatch_amqp [--entries 5000] [--runs 3]``: CPU per slot of one
    dispatching process on RabbitMQ, hand-built messages off and on, alternated."""
    import argparse
    import os

    from benchmarks.common import SIZES, servers

    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch_amqp",
                                     description=main.__doc__)
    parser.add_argument("--entries", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--amqp-url")
    parser.add_argument("--postgres-url")
    parser.add_argument("--redis-url")
    args = parser.parse_args(argv)
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with servers(args.postgres_url, args.redis_url, SIZES["smoke"], amqp_url=args.amqp_url,
                 amqp=True) as env, env.database("dispatch_amqp_cpu") as db_url:
        for _ in range(args.runs):
            for builder in (False, True):
                results[builder].append(cpu_per_slot(env, db_url, args.entries, args.batch,
                                                     builder=builder))
        load = os.getloadavg()
    print(f"{args.entries} due entries, batch {args.batch}, one process, RabbitMQ; "
          f"load average at the end {load[0]:.1f}")
    print("| per slot | builder off | builder on |\n|---|---|---|")
    for label, i, fmt in (("beat process CPU, µs", 0, "{:,.0f}"), ("slots/s", 1, "{:,.0f}")):
        cells = []
        for builder in (False, True):
            vals = [r[i] for r in results[builder]]
            cells.append(f"{fmt.format(min(vals))}-{fmt.format(max(vals))}")
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
