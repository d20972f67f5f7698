"""Rows/s of one relay into Redis, against a raw kombu publish loop into the same Redis.

Starts a private PostgreSQL and Redis (harness.servers), inserts N ``celery``
outbox rows, times ``Relay.run_once`` until all are sent, then times publishing the same
number of messages with a bare kombu producer. Prints a markdown table.

    PYTHONPATH=. python benchmarks/relay_throughput.py [--rows 5000] [--batch-size 200]
"""

from __future__ import annotations

import argparse
import time

import kombu
from celery import Celery

from harness.servers import PostgresServer, RedisServer
from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.handlers import CeleryHandler
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=200)
    args = parser.parse_args()
    n = args.rows
    with PostgresServer() as pg, RedisServer() as rd:
        store = Store.from_url(pg.url, role="relay")
        upgrade(store)
        app = Celery("bench", broker=rd.url)

        t0 = time.perf_counter()
        with store.begin() as conn:
            for i in range(n):
                outbox.add(conn, "celery", {"task": "bench.t", "args": [i], "kwargs": {}},
                           key=f"bench:{i}")
        t_add = time.perf_counter() - t0

        relay = Relay(store, handlers={"celery": CeleryHandler(app)},
                      settings=Settings(database_url=pg.url), batch_size=args.batch_size)
        t0 = time.perf_counter()
        while relay.run_once():
            pass
        t_relay = time.perf_counter() - t0

        t0 = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for i in range(n):
                app.send_task("bench.t", args=[i], producer=producer, queue="celery_raw")
        t_send_task = time.perf_counter() - t0

        t0 = time.perf_counter()
        with kombu.Connection(rd.url) as conn, conn.Producer() as producer:  # type: ignore[attr-defined]
            for i in range(n):
                producer.publish({"i": i}, routing_key="kombu_raw", serializer="json")
        t_kombu = time.perf_counter() - t0
        app.close()
        store.dispose()

    print(f"{n} rows, batch size {args.batch_size}, PostgreSQL + Redis on 127.0.0.1\n")
    print("| what | seconds | rows/s |")
    print("|---|---:|---:|")
    for label, secs in (
        ("outbox.add (one transaction)", t_add),
        ("relay: claim + send_task + mark sent", t_relay),
        ("send_task loop over one producer (no DB)", t_send_task),
        ("raw kombu publish loop", t_kombu),
    ):
        print(f"| {label} | {secs:.2f} | {n / secs:,.0f} |")


if __name__ == "__main__":
    main()
