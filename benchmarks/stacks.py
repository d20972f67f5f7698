"""6. Stacks: dispatch, fire lateness and relay on PostgreSQL / MariaDB x Redis / RabbitMQ.

The same three measurements on every store x broker pair, each against a raw kombu publish
loop on the same broker (RabbitMQ: with publisher confirms, one round trip per message,
since an unconfirmed publish proves nothing; Redis has no confirms: one LPUSH per message):

* dispatch: N interval entries due at once; one process loops :meth:`Beat.tick` +
  :func:`publish_triggers` (claim SKIP LOCKED, runs + trigger rows, commit, publish the batch
  -- on RabbitMQ one confirm wait per batch --, mark sent) until N are published;
* lateness: a real ``celery beat`` (:mod:`benchmarks.stacks_app`) with E entries every
  second; a kombu consumer in this process records, for every trigger, its arrival time
  minus its slot (the ``reliable_beat_fire_at`` header): how late a message reaches the
  broker's consumer;
* relay: N pending ``celery`` outbox rows; one process loops :meth:`Relay.run_once` (claim,
  publish, mark sent) until none is left.

Single process each (k = 1): these columns compare stacks, part 1 and 5 measure scaling on
PostgreSQL + Redis. Every store gets a fresh database per measurement.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from benchmarks.common import PY, ROOT, Env, median, pct, table
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import entries

__all__ = ["run"]

ANCHOR = "2000-01-01T00:00:00Z"


@contextlib.contextmanager
def fresh_database(admin_url: str) -> Iterator[str]:
    """A fresh migrated database on the server of ``admin_url`` (PostgreSQL or MariaDB,
    as a user that may create databases); yields its URL and drops it afterwards."""
    name = f"stk_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = sa.engine.make_url(admin_url).set(database=name).render_as_string(False)
    store = Store.from_url(url, role="cli")
    upgrade(store)
    store.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            if admin.dialect.name == "postgresql":
                conn.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"
                ), {"n": name})
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


def _app(broker_url: str, queue: str) -> Any:
    from celery import Celery

    app = Celery("bench_stacks", broker=broker_url)
    app.conf.update(broker_connection_retry_on_startup=True, task_default_queue=queue,
                    broker_transport_options={"confirm_publish": True})
    return app


def _purge(app: Any, queue: str) -> None:
    with app.connection_for_write() as conn:
        q = app.amqp.queues[queue].bind(conn.default_channel)
        q.declare()
        q.delete()


def seed_due(url: str, n: int) -> None:
    """``n`` interval entries (every hour), each due 2 s ago, inserted in batches."""
    store = Store.from_url(url, role="cli")
    with store.begin() as conn:
        now = store.now(conn)
        spec = {"kind": "interval", "every_seconds": 3600, "anchor": ANCHOR, "timezone": "UTC"}
        for lo in range(0, n, 1000):
            conn.execute(entries.insert(), [
                {"name": f"bench-{i}", "task": "bench.noop", "args": [], "kwargs": {},
                 "options": {}, "schedule_kind": "interval", "schedule": spec,
                 "timezone": "UTC", "misfire_policy": "fire_once",
                 "misfire_grace_seconds": 60, "catch_up_limit": 100,
                 "overlap_policy": "allow", "enabled": True, "paused": False,
                 "origin": "runtime", "next_fire_at": now - timedelta(seconds=2),
                 "created_at": now, "updated_at": now}
                for i in range(lo, min(n, lo + 1000))
            ])
    store.dispose()


def raw_publish(broker_url: str, n: int) -> float:
    """Messages/s of a raw kombu loop: ``n`` persistent Celery-shaped messages to a durable
    queue over one connection, confirmed one by one on RabbitMQ."""
    from kombu import Connection, Exchange, Producer, Queue

    name = f"stk-raw-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name, durable=True)
    with Connection(broker_url, transport_options={"confirm_publish": True}) as conn:
        producer = Producer(conn.channel())
        queue.bind(producer.channel).declare()
        t0 = time.perf_counter()
        for i in range(n):
            tid = str(uuid.uuid4())
            producer.publish(
                [[f"bench-{i}"], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                      "chord": None}],
                exchange=queue.exchange, routing_key=name, serializer="json",
                delivery_mode=2,
                headers={"lang": "py", "task": "bench.noop", "id": tid, "root_id": tid,
                         "parent_id": None, "retries": 0,
                         "reliable_beat_key": f"bench-{i}@2026-01-01T00:00:00Z",
                         "reliable_beat_fire_at": "2026-01-01T00:00:00Z"},
            )
        elapsed = time.perf_counter() - t0
        queue.bind(conn.default_channel).delete()
    return n / elapsed


def dispatch(db_admin: str, broker_url: str, n: int, batch: int) -> float:
    """Slots/s from "due" to "published and marked sent", one process."""
    from reliable_beat.beat import Beat
    from reliable_beat.celery.scheduler import publish_triggers

    queue = f"stk-d-{uuid.uuid4().hex[:8]}"
    with fresh_database(db_admin) as url:
        seed_due(url, n)
        store = Store.from_url(url, role="beat")
        app = _app(broker_url, queue)
        beat = Beat(store, owner="bench-stacks", batch_size=batch)
        with app.producer_or_acquire() as p:
            p.connection.ensure_connection()
        sent = 0
        t0 = time.perf_counter()
        while sent < n and time.perf_counter() - t0 < 300:
            res = beat.tick()
            if res.triggers:
                assert res.now is not None
                sent += publish_triggers(store, app, res.triggers, res.now)
            elif not res.claimed:
                time.sleep(0.001)
        elapsed = time.perf_counter() - t0
        _purge(app, queue)
        app.close()
        store.dispose()
    return sent / elapsed


def relay(db_admin: str, broker_url: str, n: int, batch: int) -> float:
    """Outbox rows/s published and marked sent by one relay process."""
    from reliable_beat import outbox
    from reliable_beat.handlers import CeleryHandler
    from reliable_beat.relay import Relay
    from reliable_beat.settings import Settings

    queue = f"stk-r-{uuid.uuid4().hex[:8]}"
    with fresh_database(db_admin) as url:
        store = Store.from_url(url, role="relay")
        with store.begin() as conn:
            for i in range(n):
                outbox.add(conn, "celery", {"task": "bench.noop", "args": [i], "kwargs": {},
                                            "options": {"queue": queue}}, key=f"bench:{i}")
        app = _app(broker_url, queue)
        rel = Relay(store, handlers={"celery": CeleryHandler(app)},
                    settings=Settings(database_url=url), batch_size=batch,
                    owner="bench-stacks-relay")
        with app.producer_or_acquire() as p:
            p.connection.ensure_connection()
        done = 0
        t0 = time.perf_counter()
        while done < n and time.perf_counter() - t0 < 300:
            claimed = rel.run_once()
            done += claimed
            if not claimed:
                time.sleep(0.001)
        elapsed = time.perf_counter() - t0
        _purge(app, queue)
        app.close()
        store.dispose()
    return done / elapsed


def lateness(db_admin: str, broker_url: str, n_entries: int, seconds: float) -> list[float]:
    """Arrival minus slot (ms) of every trigger a real ``celery beat`` published in the
    window, as seen by a consumer of the queue."""
    from kombu import Connection

    queue = f"stk-l-{uuid.uuid4().hex[:8]}"
    app = _app(broker_url, queue)
    late: list[float] = []
    window: list[float] = []
    stop = threading.Event()
    first = threading.Event()

    def consume() -> None:
        with Connection(broker_url) as conn:
            q = app.amqp.queues[queue]

            def on_message(body: Any, message: Any) -> None:
                arrived = time.time()
                first.set()
                fire_at = (message.headers or {}).get("reliable_beat_fire_at")
                if fire_at:
                    slot = datetime.fromisoformat(str(fire_at).replace("Z", "+00:00"))
                    if window and slot.timestamp() >= window[0]:
                        late.append((arrived - slot.timestamp()) * 1000)
                message.ack()

            with conn.Consumer([q], callbacks=[on_message], accept=["json"]):
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError, OSError):
                        conn.drain_events(timeout=0.2)

    with fresh_database(db_admin) as url:
        with app.connection_for_write() as conn:
            app.amqp.queues[queue].bind(conn.default_channel).declare()
        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "STK_BROKER": broker_url, "STK_DB": url,
               "STK_QUEUE": queue, "STK_N": str(n_entries)}
        workdir = tempfile.mkdtemp(prefix="rb-stk-")
        log_path = os.path.join(workdir, "beat.log")
        log = open(log_path, "wb")  # noqa: SIM115 - the child's
        beat = subprocess.Popen(
            [PY, "-m", "celery", "-A", "benchmarks.stacks_app", "beat", "-l", "warning",
             "-s", os.path.join(workdir, "beat.schedule")], cwd=ROOT, env=env,
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            first.wait(120)  # the beat's boot (seconds on a loaded machine), first claims
            time.sleep(2)
            window.append(time.time())
            time.sleep(seconds)
        finally:
            beat.terminate()
            try:
                beat.wait(20)
            except subprocess.TimeoutExpired:
                beat.kill()
            time.sleep(0.5)
            stop.set()
            consumer.join(5)
        _purge(app, queue)
        app.close()
    if not late:
        with open(log_path, errors="replace") as fh:
            raise RuntimeError(f"lateness: no trigger reached the consumer; beat log:\n"
                               f"{fh.read()[-3000:]}")
    return late


def stacks(env: Env) -> list[tuple[str, str, str, str]]:
    """(label, store admin URL, broker URL) of every stack this run has servers for."""
    out = []
    for store_name, db in (("PostgreSQL", env.postgres_url), ("MariaDB", env.mariadb_url)):
        for broker_name, broker in (("Redis", env.redis_url), ("RabbitMQ", env.amqp_url)):
            if db and broker:
                out.append((f"{store_name} + {broker_name}", store_name, db, broker))
    return [(label, s, d, b) for label, s, d, b in out]


def run(env: Env) -> str:
    size = env.size
    batch = size.dispatch_batch
    # smoke: a few hundred (RabbitMQ's confirm-per-message raw loop is slow on a loaded CI box)
    n = size.dispatch_n if size.name != "smoke" else 200
    relay_n = size.relay_n if size.name != "smoke" else 200
    seconds = size.lateness_seconds if size.name != "smoke" else 3.0  # a few slots per stack
    rows = []
    for label, _store, db, broker in stacks(env):
        raw = raw_publish(broker, n)
        ours = dispatch(db, broker, n, batch)
        rel = relay(db, broker, relay_n, batch)
        raw_relay = raw_publish(broker, relay_n)
        late = lateness(db, broker, size.lateness_entries, seconds)
        rows.append([label, ours, raw, f"{ours / raw:.0%}", rel, raw_relay,
                     f"{rel / raw_relay:.0%}", len(late), median(late), pct(late, 99),
                     max(late) if late else float("nan")])
    started = datetime.now(timezone.utc)
    return "\n".join([
        f"### 6. Stacks: dispatch, lateness and relay per store x broker ({n:,} entries due "
        f"at once, {relay_n:,} outbox rows, batch {batch}; lateness: "
        f"{size.lateness_entries} entries every second for {seconds:g} s)",
        "",
        "One process each. Raw = a kombu publish loop of persistent Celery-shaped messages "
        "on the same broker, confirmed one by one on RabbitMQ (Redis has no confirms). "
        "Ours publishes a batch and, on RabbitMQ, waits once for its confirms before marking "
        "the rows sent. Lateness = arrival at a consumer minus the slot "
        f"(`reliable_beat_fire_at`), a real `celery beat`. Run {started:%Y-%m-%d %H:%M} UTC.",
        "",
        table(["stack", "dispatch slots/s", "raw publish /s", "dispatch / raw",
               "relay rows/s", "raw publish /s ", "relay / raw", "triggers timed",
               "lateness median ms", "p99 ms", "max ms"], rows),
    ])
