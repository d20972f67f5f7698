"""A plain task's slot and a second publication (issue 12), with real ``celery beat``
processes, PostgreSQL and Redis.

Beat A commits a slot's run and trigger and is frozen (SIGSTOP) before it publishes; beat B's
sweep publishes the row after the sweep delay; A is thawed. A must not publish it again: it
checks, just before publishing, that the row is still its own and pending. Frozen *after*
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
from reliable_beat.db.tables import outbox

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
    with pg_store.engine.connect() as conn:
        row = conn.execute(select(outbox).order_by(outbox.c.id)).first()
    assert row is not None and row.claimed_by and row.state == "pending"
    frozen_key = row.message_id
    b = procs.start("b")

    def swept() -> bool:
        with pg_store.engine.connect() as conn:
            return conn.execute(select(outbox.c.state).where(
                outbox.c.message_id == frozen_key)).scalar_one() == "sent"

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
