"""A plain task's slot and a second publication (issue 12), with real ``celery beat``
processes, PostgreSQL and Redis.

Beat A commits a slot's run (a due slot's trigger has no outbox row) and is frozen (SIGSTOP)
before it publishes; beat B's sweep writes the slot's trigger row after the sweep delay and
publishes it; A is thawed. A must not publish it again: it
checks, just before publishing, that the run is still untouched since its claim (a sweep
re-stamps it). Frozen *after*
the broker accepted and before the mark, a second trigger cannot be avoided (B cannot tell a
paused publisher from a dead one): at most two, and A never adds a third.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[procs_mod.BeatProcs]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    try:
        yield manager
    finally:
        manager.cleanup()


def _now(store: Store) -> Any:
    with store.begin() as conn:
        return store.now(conn)


@pytest.mark.parametrize(("flag_env", "at_most"), [
    ("RB_FREEZE_BEFORE_PUBLISH", 1),
    ("RB_FREEZE_AFTER_PUBLISH", 2),
], ids=["frozen-before-publish", "frozen-after-broker-accepted"])
def test_frozen_publisher_never_adds_a_second_trigger(
    pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs, tmp_path: Path,
    flag_env: str, at_most: int,
) -> None:
    queue = f"rbq_{uuid.uuid4().hex[:10]}"
    procs.env.update(RB_BROKER_URL=redis_url, RELIABLE_BEAT_DATABASE_URL=pg_store.url,
                     RB_QUEUE=queue, RB_MAX_LOOP="1", RB_CLAIM_AHEAD="0",
                     # a slot every 10 s: the first within 10 s of the start; the slots
                     # that fire while A is frozen go out once each through B (checked below)
                     RB_SCHEDULE=json.dumps({"plain": {"every": 10}}))
    flag = tmp_path / "freeze"
    flag.touch()
    a = procs.start("a", **{flag_env: str(flag)})
    procs_mod.wait_for(lambda: "FROZEN" in a.output(), 90, "beat A to freeze on its slot")
    with pg_store.engine.connect() as conn:  # a due slot: its run is its only record
        run = conn.execute(select(runs).order_by(runs.c.id)).first()
        assert conn.execute(select(outbox)).first() is None
    assert run is not None and run.state == "scheduled"
    frozen_key = f"trigger:{run.idempotency_key}"
    b = procs.start("b")

    def swept() -> bool:  # B's sweep wrote the slot's row, then published it
        with pg_store.engine.connect() as conn:
            return conn.execute(select(outbox.c.state).where(
                outbox.c.message_id == frozen_key)).scalar_one_or_none() == "sent"

    procs_mod.wait_for(swept, 60, "beat B's sweep to publish the frozen beat's row")
    procs.cont(a)
    procs_mod.wait_for(lambda: "THAWED" in a.output(), 10, "beat A to thaw")
    thawed = _now(pg_store)
    procs_mod.wait_for(lambda: _now(pg_store) > thawed + timedelta(seconds=8), 30,
                       "beat A running after the thaw")
    r = redis.Redis.from_url(redis_url)
    try:
        keys = Counter(json.loads(m)["headers"]["reliable_beat_key"]
                       for m in r.lrange(queue, 0, -1))
        r.delete(queue)
    finally:
        r.close()
    slot_key = frozen_key.removeprefix("trigger:")
    logs = f"--- a ---\n{a.output()[-3000:]}\n--- b ---\n{b.output()[-3000:]}"
    print(f"[{flag_env}] messages of the frozen slot: {keys[slot_key]} (at most {at_most})")
    assert 1 <= keys[slot_key] <= at_most, logs
    assert a.alive() and b.alive(), logs
    # every other slot of the window was published once
    assert all(n == 1 for k, n in keys.items() if k != slot_key), (keys, logs)


def test_beat_killed_between_commit_and_publish_its_slot_goes_out_once(
    pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs, tmp_path: Path,
) -> None:
    """SIGKILL right after the claim's commit: the slot's run is ``scheduled`` with no trigger
    row; the next beat's sweep writes the row after the sweep delay and publishes it, once
    (and every later slot goes out once, through that beat's fast path)."""
    queue = f"rbq_{uuid.uuid4().hex[:10]}"
    procs.env.update(RB_BROKER_URL=redis_url, RELIABLE_BEAT_DATABASE_URL=pg_store.url,
                     RB_QUEUE=queue, RB_MAX_LOOP="1", RB_CLAIM_AHEAD="0",
                     RB_SCHEDULE=json.dumps({"plain": {"every": 10}}))
    flag = tmp_path / "freeze"
    flag.touch()
    a = procs.start("a", RB_FREEZE_BEFORE_PUBLISH=str(flag))
    procs_mod.wait_for(lambda: "FROZEN" in a.output(), 90, "beat A to freeze on its slot")
    procs.kill(a)
    with pg_store.engine.connect() as conn:
        (run,) = conn.execute(select(runs)).all()
        assert conn.execute(select(outbox)).first() is None
    assert run.state == "scheduled"
    b = procs.start("b")

    def dispatched() -> bool:
        with pg_store.engine.connect() as conn:
            return conn.execute(select(runs.c.state).where(
                runs.c.id == run.id)).scalar_one() == "dispatched"

    procs_mod.wait_for(dispatched, 60, "beat B's sweep to publish the dead beat's slot")
    r = redis.Redis.from_url(redis_url)
    try:
        keys = Counter(json.loads(m)["headers"]["reliable_beat_key"]
                       for m in r.lrange(queue, 0, -1))
        r.delete(queue)
    finally:
        r.close()
    logs = f"--- a ---\n{a.output()[-2000:]}\n--- b ---\n{b.output()[-3000:]}"
    assert keys[run.idempotency_key] == 1, logs
    assert all(n == 1 for n in keys.values()), (keys, logs)
    assert "never published them" in b.output(), logs  # the materialising sweep's WARNING
    with pg_store.engine.connect() as conn:
        row = conn.execute(select(outbox).where(
            outbox.c.message_id == f"trigger:{run.idempotency_key}")).one()
    assert row.state == "sent"
