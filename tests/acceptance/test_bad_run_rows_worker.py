"""A malformed runs row meets a real ``celery worker`` (Redis, PostgreSQL): the trigger is
acked, the run dead-lettered as ``malformed``, the worker goes on (fresh-user finding).

Before: the claim raised after committing its lease (``dict([1])`` on a stored ``kwargs``
list): the run stayed ``running``, its attempt ``running``, and every re-send crashed again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, runs
from tests.acceptance.test_idempotent_task import Env, meta

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(180)]


@pytest.fixture
def env(server_url: str, broker_url: str, server_store: Store, tmp_path: Path) -> Iterator[Env]:
    meta.create_all(server_store.engine)
    e = Env(server_url, broker_url, server_store, tmp_path)
    try:
        yield e
    finally:
        e.kill_all()
        e.client.close()


def test_malformed_run_is_dead_lettered_and_the_worker_goes_on(env: Env) -> None:
    store = env.store
    key = "bad:worker"
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(runs.insert().values(
            idempotency_key=key, trigger="adhoc", task="rb.write_effect", args={"a": 1},
            kwargs=[1], state="dispatched", created_at=now, updated_at=now,
            dispatched_at=now))
    worker = env.worker("w")
    env.send("rb.write_effect", ["bad"], "w", key=key)  # what the re-dispatch sweep sends
    env.wait("the malformed run dead-lettered", lambda: env.state(key) == "dead", 60)
    env.send("rb.write_effect", ["good"], "w", key="good:after")
    env.wait("the next message run by the same worker",
             lambda: env.state("good:after") == "succeeded", 60)
    assert worker.poll() is None  # the same process, never restarted
    time.sleep(1.0)  # a crash loop would re-send and record more attempts meanwhile
    with store.engine.connect() as conn:
        run = conn.execute(sa.select(runs).where(runs.c.idempotency_key == key)).one()
        letters = conn.execute(sa.select(dead_letters.c.reason, dead_letters.c.error).where(
            dead_letters.c.key == key)).all()
        outcomes = conn.execute(sa.select(attempts.c.outcome).where(
            attempts.c.run_id == run.id)).scalars().all()
    assert run.state == "dead" and run.reason.startswith("malformed: ")
    assert len(letters) == 1 and letters[0].reason == "malformed"
    assert "args=" in letters[0].error and "kwargs=" in letters[0].error
    assert outcomes == ["dead"], outcomes  # one attempt, closed; none left running
    assert env.effects(key) == []
    assert f"{key!r}" in env.logs() and "dead-lettered: malformed row" in env.logs()
    status = env.cli("status", "--check")
    assert status.returncode == 1, status.stdout + status.stderr
    assert "dead letters" in status.stdout + status.stderr
