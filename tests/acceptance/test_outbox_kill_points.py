"""A task writes an effect and an outbox webhook; a process is SIGKILLed at each point.

Kill points: (1) the worker before its commit, (2) the relay after the commit but before
delivery, (3) the relay after delivery but before it marks the row sent. In every case the
far end (a local HTTP recorder) sees the request at least once, every request for the one
logical message carries the same ``Idempotency-Key``, no message is lost, and the effect
exists exactly once. Real worker and relay processes, PostgreSQL and Redis.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import KEY_HEADER
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from rb_task_app import effects, meta  # noqa: E402
from sinks import HttpRecorder  # noqa: E402


class Rig:
    def __init__(self, pg_url: str, redis_url: str, store: Store, tmp: Path) -> None:
        self.pg_url, self.redis_url, self.store, self.tmp = pg_url, redis_url, store, tmp
        self.tag = uuid.uuid4().hex[:8]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.client = Celery("rb_client", broker=redis_url, set_as_current=False)
        self.client.conf.broker_connection_retry_on_startup = True
        self.flag = tmp / "kill.flag"

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
                "RB_BROKER_URL": self.redis_url, "RB_DATABASE_URL": self.pg_url,
                "RB_LEASE_SECONDS": "2", "RB_KILL_FLAG": str(self.flag), **extra}

    def start(self, name: str, args: list[str], **extra: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(args, env=self.env(**extra), stdout=log,
                                stderr=subprocess.STDOUT, cwd=self.tmp)
        self.procs.append(proc)
        return proc

    def worker(self) -> subprocess.Popen[bytes]:
        return self.start("worker", [sys.executable, "-m", "celery", "-A", "rb_task_app",
                                     "worker", "--pool", "solo", "-Q", f"q-{self.tag}",
                                     "-n", f"w-{self.tag}@%h", "--without-gossip",
                                     "--without-mingle", "--without-heartbeat"])

    def relay(self, **extra: str) -> subprocess.Popen[bytes]:
        return self.start("relay", [sys.executable, "-m", "reliable_beat.cli", "-A",
                                    "rb_task_app", "relay", "--claim-lease-seconds", "3"],
                          **extra)

    def send(self, name: str, url: str, **kwargs: Any) -> str:
        key = f"kill-points:{name}:{self.tag}"
        self.client.send_task("rb.effect_with_webhook", args=[name, url], kwargs=kwargs,
                              queue=f"q-{self.tag}", headers={KEY_HEADER: key})
        return key

    def effects(self, key: str) -> int:
        with self.store.engine.connect() as conn:
            return int(conn.execute(
                sa.select(sa.func.count()).where(effects.c.key == key)).scalar_one())

    def outbox_states(self) -> list[str]:
        with self.store.engine.connect() as conn:
            return list(conn.execute(sa.select(outbox.c.state)).scalars())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def wait(what: str, cond: Callable[[], Any], rig: Rig, timeout: float = 40.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{rig.logs()}")


@pytest.fixture
def rig(server_url: str, redis_url: str, server_store: Store, tmp_path: Path) -> Iterator[Rig]:
    """The rig on PostgreSQL and on MariaDB (``server_url``)."""
    meta.create_all(server_store.engine)
    r = Rig(server_url, redis_url, server_store, tmp_path)
    try:
        yield r
    finally:
        r.kill_all()


@pytest.fixture
def far_end() -> Iterator[HttpRecorder]:
    with HttpRecorder() as rec:
        yield rec


def _check(rig: Rig, far_end: HttpRecorder, key: str, min_requests: int) -> None:
    wait("the outbox row sent", lambda: rig.outbox_states() == ["sent"], rig)
    keys = {r.headers.get("Idempotency-Key") for r in far_end.requests}
    assert len(far_end.requests) >= min_requests, far_end.requests
    assert len(keys) == 1 and next(iter(keys)).startswith(key), keys
    assert rig.effects(key) == 1


def _kill_worker_before_commit(rig: Rig, far_end: HttpRecorder, name: str) -> str:
    rig.relay()
    worker = rig.worker()
    key = rig.send(name, far_end.url + "/hook", sleep_first_attempt=30.0)
    wait("the body to start", lambda: rig.effects(key) == 0 and _in_body(rig, key), rig)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert far_end.requests == []  # nothing was committed, nothing delivered
    return key


def test_worker_killed_before_commit(rig: Rig, far_end: HttpRecorder) -> None:
    key = _kill_worker_before_commit(rig, far_end, "before-commit")
    rig.worker()  # the message comes back after the visibility timeout
    wait("the redelivered run to commit", lambda: rig.effects(key) == 1, rig, timeout=60)
    _check(rig, far_end, key, min_requests=1)


def test_redelivery_survives_a_worker_killed_holding_the_restore_lock(
        rig: Rig, far_end: HttpRecorder) -> None:
    """kombu restores unacked Redis messages under one lock per database; a worker killed
    while holding it leaves the lock until ``unacked_mutex_expire`` (kombu default 300 s).
    With the documented setting the redelivery is late by seconds, not minutes."""
    from rb_task_app import app

    key = _kill_worker_before_commit(rig, far_end, "restore-lock")
    with app.connection_for_read(rig.redis_url) as conn:  # as the killed holder left it
        channel = conn.default_channel
        channel.client.set(channel.unacked_mutex_key, "killed-holder",
                           ex=int(channel.unacked_mutex_expire))
        assert channel.client.ttl(channel.unacked_mutex_key) > 0
    rig.worker()
    wait("the redelivered run to commit", lambda: rig.effects(key) == 1, rig, timeout=40)
    _check(rig, far_end, key, min_requests=1)


def test_relay_killed_after_commit_before_delivery(rig: Rig, far_end: HttpRecorder) -> None:
    rig.flag.write_text("armed")
    relay = rig.relay(RB_KILL_POINT="before_delivery")
    rig.worker()
    key = rig.send("before-delivery", far_end.url + "/hook")
    wait("the relay to die before delivering", lambda: relay.poll() is not None, rig)
    assert rig.effects(key) == 1 and far_end.requests == []
    rig.relay()
    _check(rig, far_end, key, min_requests=1)


def test_relay_killed_after_delivery_before_mark_sent(rig: Rig, far_end: HttpRecorder) -> None:
    rig.flag.write_text("armed")
    relay = rig.relay(RB_KILL_POINT="after_delivery")
    rig.worker()
    key = rig.send("after-delivery", far_end.url + "/hook")
    wait("the relay to die after delivering", lambda: relay.poll() is not None, rig)
    assert len(far_end.requests) == 1 and rig.outbox_states() == ["pending"]
    rig.relay()  # the claim lease (3 s) expires; the row is delivered again, same key
    _check(rig, far_end, key, min_requests=2)


def _in_body(rig: Rig, key: str) -> bool:
    from rb_task_app import progress

    with rig.store.engine.connect() as conn:
        return bool(conn.execute(
            sa.select(sa.func.count()).where(progress.c.key == key,
                                             progress.c.what == "in_body")).scalar_one())
