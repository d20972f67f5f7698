"""Effect and key in one Django transaction, with real ``celery worker`` processes.

The worker runs a Django project (``tests/apps/djproj``) on a real PostgreSQL, on psycopg 3
and on psycopg2. The task writes its payout through the ORM inside
``self.transaction(using="default")`` (plus a signal handler's write, a nested savepoint's
``bulk_create``, a ``select_for_update`` and an outbox row). A worker SIGSTOPped inside
the block past its lease is fenced out when it wakes, and everything it wrote through the
ORM is rolled back: one payout, written by the runner holding the current fence.
"""

from __future__ import annotations

import contextlib
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

from reliable_beat import runs
from reliable_beat.db.dialects import Store

ROOT = Path(__file__).resolve().parents[2]
PROJ = ROOT / "tests" / "apps" / "djproj"
CELERY = Path(sys.executable).parent / "celery"
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(240)]

sys.path.insert(0, str(PROJ))
from djtables import audit, meta, payouts, progress  # noqa: E402


class DjEnv:
    def __init__(self, driver: str, pg_url: str, redis_url: str, store: Store,
                 tmp: Path) -> None:
        self.driver, self.store, self.tmp = driver, store, tmp
        self.store_url = sa.engine.make_url(pg_url).set(
            drivername=f"postgresql+{driver}").render_as_string(hide_password=False)
        self.pg_url, self.redis_url = pg_url, redis_url
        self.procs: list[subprocess.Popen[bytes]] = []
        self.client = Celery("dj_client", broker=redis_url, set_as_current=False)
        self.client.conf.broker_connection_retry_on_startup = True
        self.tag = uuid.uuid4().hex[:8]

    def queue(self, name: str) -> str:
        return f"dj-{self.tag}-{name}"

    def worker(self, name: str, pool: str = "solo", concurrency: int = 1
               ) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{PROJ}",
               "RB_BROKER_URL": self.redis_url, "RB_DATABASE_URL": self.pg_url,
               "RB_STORE_URL": self.store_url, "RB_DJANGO_DRIVER": self.driver,
               "RB_LEASE_SECONDS": "2", "DJANGO_SETTINGS_MODULE": "djsettings",
               "RB_CONN_MAX_AGE": "60"}
        log = open(self.tmp / f"worker-{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(CELERY), "-A", "djtask_app", "worker", "--pool", pool, "-c", str(concurrency),
             "-Q", self.queue(name), "-n", f"{name}-{self.tag}@%h", "--without-gossip",
             "--without-mingle", "--without-heartbeat", "-l", "INFO"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
            start_new_session=True,  # its own process group: kill_all reaches the children
        )
        self.procs.append(proc)
        return proc

    def send(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.client.send_task("dj.pay", args=list(args), kwargs=kwargs,
                              queue=self.queue(queue))

    def rows(self, table: sa.Table, key: str) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(
                sa.select(table).where(table.c.key == key).order_by(table.c.id)).mappings()]

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.store.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    def attempts(self, key: str) -> list[dict[str, Any]]:
        try:
            return runs.list_attempts(self.store, runs.get_run(self.store, key)["id"])
        except runs.RunNotFound:
            return []

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.tmp.glob("worker-*.log")))

    def wait(self, what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            for proc in self.procs:
                if proc.poll() not in (None, -signal.SIGKILL):
                    pytest.fail(f"worker exited with {proc.returncode}\n{self.logs()}")
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def kill_all(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(params=["psycopg", "psycopg2"])
def dj(request: pytest.FixtureRequest, pg_url: str, redis_url: str, pg_store: Store,
       tmp_path: Path) -> Iterator[DjEnv]:
    driver = request.param
    if driver == "psycopg2":
        pytest.importorskip("psycopg2", reason="pip install psycopg2-binary")
    meta.create_all(pg_store.engine)
    env = DjEnv(driver, pg_url, redis_url, pg_store, tmp_path)
    try:
        yield env
    finally:
        env.kill_all()
        env.client.close()


def test_sigstop_past_lease_fences_out_and_rolls_back_orm_writes(dj: DjEnv) -> None:
    dj.worker("a", pool="prefork", concurrency=1)  # a forked child runs the body
    dj.worker("b")
    key = "pay:m1"
    dj.send("a", "m1", sleep_first_attempt=2.0)
    [started] = dj.wait("A inside its block", lambda: dj.rows(progress, key))
    child = started["pid"]
    os.kill(child, signal.SIGSTOP)
    try:
        dj.wait("A's lease expired", lambda: dj.scalar(
            "SELECT lease_expires_at < clock_timestamp() FROM reliable_beat_runs "
            "WHERE idempotency_key = :k", k=key), 30)
        dj.send("b", "m1")  # a duplicate trigger, taken by B with a new fence
        dj.wait("B claimed the run (fence 2)", lambda: dj.scalar(
            "SELECT fence_token = 2 FROM reliable_beat_runs WHERE idempotency_key = :k",
            k=key))
        # B's outbox row has the same message id as A's uncommitted one, so B's insert
        # waits for A's transaction to end (PostgreSQL's unique-index wait): B cannot commit
        # while A is frozen; A's fenced completion on wake rolls A back and lets B go on.
        time.sleep(1.0)
    finally:
        os.kill(child, signal.SIGCONT)
    dj.wait("A fenced out", lambda: "fenced_out" in [a["outcome"] for a in dj.attempts(key)])
    dj.wait("B committed", lambda: runs.get_run(dj.store, key)["state"] == "succeeded")
    by_fence = {a["fence_token"]: a["outcome"] for a in dj.attempts(key)
                if a["outcome"] in ("fenced_out", "succeeded")}
    assert by_fence == {1: "fenced_out", 2: "succeeded"}, dj.attempts(key)
    # A's ORM writes (the create, its signal's write, the savepoint's bulk_create) are gone.
    pays = dj.rows(payouts, key)
    assert len(pays) == 1 and pays[0]["fence"] == 2 and pays[0]["pid"] != child, pays
    assert sorted((a["fence"], a["what"]) for a in dj.rows(audit, key)) == [
        (2, "line1"), (2, "line2"), (2, "signal")]
    run = runs.get_run(dj.store, key)
    assert run["fence_token"] == 2
    assert run["result"] == {"merchant": "m1", "payout": pays[0]["id"], "fence": 2}
    with dj.store.engine.connect() as conn:
        [msg] = conn.execute(sa.text(
            "SELECT payload FROM reliable_beat_outbox WHERE run_id = :r"), {"r": run["id"]}
        ).scalars().all()
    assert msg == {"merchant": "m1", "payout": pays[0]["id"]}
