"""A broker that HANGS (accepts the connection, answers nothing) never stalls a beat.

A real ``celery beat`` process (tests/apps/beatapp.py) on the real PostgreSQL store and a
private ``redis-server`` of this test (``CLIENT PAUSE ... ALL`` there; never on the shared
test Redis). The pause makes every publish block: without a bound the beat froze inside the
publish for the whole pause (no claims, no heartbeat, nothing logged), and the misfire
policy then collapsed the slots missed meanwhile. With ``reliable_beat_publish_timeout_seconds``
the publish times out, the triggers stay pending in the outbox, the beat logs a WARNING naming
the broker and the bound, keeps claiming and heartbeating, and its sweep delivers every slot
of the pause window once the broker answers again.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from harness.servers import RedisServer
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import beats, outbox, runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

SECOND = timedelta(seconds=1)
PAUSE_SECONDS = 25
PUBLISH_TIMEOUT = 2.0


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[procs_mod.BeatProcs]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    try:
        yield manager
    finally:
        manager.cleanup()


def _now(store: Store) -> datetime:
    with store.begin() as conn:
        return store.now(conn)


def test_hung_broker_times_out_beat_keeps_claiming_and_heartbeating(
        pg_store: Store, procs: procs_mod.BeatProcs) -> None:
    store = pg_store
    queue = "rb_hang"
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        procs.env.update(RB_BROKER_URL=server.url, RELIABLE_BEAT_DATABASE_URL=store.url,
                         RB_QUEUE=queue, RB_MAX_LOOP="1",
                         RB_PUBLISH_TIMEOUT=str(PUBLISH_TIMEOUT),
                         RB_SCHEDULE=json.dumps({"sec": {"every": 1},
                                                  "five": {"every": 5}}))
        beat = procs.start("hang")

        def rows() -> list[object]:
            with store.engine.connect() as conn:
                return list(conn.execute(select(runs).order_by(runs.c.fire_at)))

        procs_mod.wait_for(lambda: client.llen(queue) >= 6, 60, "the first triggers")
        client.execute_command("CLIENT", "PAUSE", str(PAUSE_SECONDS * 1000), "ALL")
        paused_at = _now(store)
        paused_mono = time.monotonic()
        # late in the pause: the beat still claims every slot and its heartbeat is fresh
        time.sleep(PAUSE_SECONDS - 5)
        during = _now(store)
        with store.engine.connect() as conn:
            seen = conn.execute(select(beats.c.seen_at).where(beats.c.role == "beat")
                                ).scalars().all()
        claimed = [r.fire_at for r in rows() if r.fire_at > paused_at and r.entry_name == "sec"]  # type: ignore[attr-defined]
        assert beat.alive(), beat.output()
        assert seen and (during - max(seen)).total_seconds() <= 15, (
            f"heartbeat {during - max(seen)} old, {PAUSE_SECONDS - 5} s into the pause: "
            f"the beat is stuck in a publish\n{beat.output()[-3000:]}")
        assert len(claimed) >= PAUSE_SECONDS - 5 - 2 * PUBLISH_TIMEOUT - 2, (
            f"only {len(claimed)} slots claimed during the pause\n{beat.output()[-3000:]}")
        # status names the broker as the cause, and not a missing beat or relay
        info = collect_status(store, unserved_seconds=5)
        problems = "\n".join(info["problems"])
        assert "BROKER NOT TAKING TRIGGERS: group 'beatapp'" in problems, problems
        assert "NO BEAT" not in problems and "UNSERVED OUTBOX" not in problems, problems
        out = beat.output()
        assert f"celery broker {server.url} did not answer within 2 s" in out, out[-3000:]

        # after the pause: every slot of the window is delivered (the sweep re-sends)
        time.sleep(max(0.0, PAUSE_SECONDS - (time.monotonic() - paused_mono)) + 1)
        resumed_at = _now(store)

        def all_sent() -> bool:
            with store.engine.connect() as conn:
                states = Counter(conn.execute(select(outbox.c.state)).scalars())
            return states["pending"] == 0 and states["sent"] > 0

        procs_mod.wait_for(all_sent, 90, "every trigger sent after the pause")
        procs.terminate(beat)
        keys = Counter(json.loads(m)["headers"]["reliable_beat_key"]
                       for m in client.lrange(queue, 0, -1))
        window = [r for r in rows()
                  if paused_at - SECOND <= r.fire_at <= resumed_at]  # type: ignore[attr-defined]
        figures = []
        for name, every in (("sec", 1), ("five", 5)):
            mine = [r for r in window if r.entry_name == name]  # type: ignore[attr-defined]
            slots = [r.fire_at for r in mine]  # type: ignore[attr-defined]
            step = every * SECOND
            # every slot of the window has its run row: no gap
            assert slots == [slots[0] + k * step for k in range(len(slots))], (name, slots)
            assert len(slots) >= PAUSE_SECONDS // every, (name, len(slots))
            skipped = [r.fire_at for r in mine if r.state == "skipped"]  # type: ignore[attr-defined]
            # Only the first timed-out publish stalls the loop (at most about twice the
            # bound); after it publishes fail at once and every slot is claimed on time. A
            # slot missed in that one stall is decided by the misfire policy (fire_once
            # collapses it), so an entry slower than the stall loses none.
            first_stall_end = paused_at + timedelta(seconds=2 * PUBLISH_TIMEOUT + 2)
            assert all(at <= first_stall_end for at in skipped), (name, skipped, paused_at)
            if every > 2 * PUBLISH_TIMEOUT:
                assert not skipped, (name, skipped)
            fired = [r for r in mine if r.state != "skipped"]  # type: ignore[attr-defined]
            missing = [r.idempotency_key for r in fired  # type: ignore[attr-defined]
                       if keys[r.idempotency_key] == 0]  # type: ignore[attr-defined]
            assert not missing, (missing, f"paused at {paused_at}", out[-3000:])
            dups = sum(1 for r in fired if keys[r.idempotency_key] > 1)  # type: ignore[attr-defined]
            figures.append(f"{name}: {len(slots)} slots in the window, {len(fired)} fired and "
                           f"delivered, {len(skipped)} skipped (first stall), {dups} twice")
        timeouts = out.count("did not answer within")
        print(f"\n[broker hang] pause {PAUSE_SECONDS} s, publish timeout {PUBLISH_TIMEOUT} s: "
              f"{len(claimed)} slots claimed during the pause, heartbeat age "
              f"{(during - max(seen)).total_seconds():.1f} s at {PAUSE_SECONDS - 5} s; "
              + "; ".join(figures) + f"; {timeouts} timeout warnings")
        client.close()
