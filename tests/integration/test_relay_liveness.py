"""A relay's heartbeat tells the truth: busy is not dead, finished is not dead, and a beat's
row says which destination (broker kind) it publishes to.

* A relay whose publish is slow (a real Redis frozen with ``CLIENT PAUSE``) for longer than
  the liveness window is still shown alive: its heartbeat is written by a thread of its own
  (main: only between cycles, so a relay busy > 60 s looked dead: a false UNSERVED OUTBOX).
* ``relay --once`` deletes its row at exit (main: the row aged into "last seen" noise).
* Beat rows record their destinations like relays' (main: NULL), and ``status`` only counts
  a beat as serving the rows of its own destination.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import select, update

from reliable_beat import outbox as ob
from reliable_beat import relay as relay_mod
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import beats, outbox
from reliable_beat.groups import unserved_outbox
from reliable_beat.loop import BeatLoop
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings

#: The liveness window ``status`` is asked with in these tests (production: 60 s).
ALIVE = 3.0


def _relays_alive(store: Store, group: str) -> int:
    info = collect_status(store, beat_alive_seconds=ALIVE)
    return sum(g["relays_alive"] for g in info["groups"] if g["group"] == group)


def _state(store: Store, key: str) -> str:
    with store.engine.connect() as conn:
        return str(conn.execute(select(outbox.c.state).where(
            outbox.c.message_id == key)).scalar_one())


def test_a_relay_busy_publishing_longer_than_the_window_is_still_alive(
    pg_store: Store, redis_url: str, test_queue: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import redis

    store = pg_store
    monkeypatch.setattr(relay_mod, "HEARTBEAT_SECONDS", 0.5)
    app = Celery("relayops_live", broker=redis_url, set_as_current=False)
    app.conf.task_default_queue = test_queue
    relay = Relay(store, app, settings=Settings(), owner="busy:1", claim_lease_seconds=120)
    stop = threading.Event()
    worker = threading.Thread(target=relay.run_forever, args=(stop,), daemon=True)
    worker.start()
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 30
        while _relays_alive(store, "relayops_live") != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _relays_alive(store, "relayops_live") == 1
        # freeze the broker: the relay's next publish blocks until the pause ends
        pause = 3 * ALIVE + 2
        client.execute_command("CLIENT", "PAUSE", int(pause * 1000), "WRITE")
        paused_at = time.monotonic()
        with store.begin() as conn:
            ob.add(conn, "celery", {"task": "relayops.t", "args": [], "kwargs": {}},
                   key="slow:1")
        # well past the liveness window into the frozen publish
        time.sleep(2 * ALIVE + 1 - (time.monotonic() - paused_at))
        assert time.monotonic() - paused_at < pause - 1  # still frozen now
        with store.engine.connect() as conn:
            claimed = conn.execute(select(outbox.c.claimed_by).where(
                outbox.c.message_id == "slow:1")).scalar_one()
        assert claimed == "busy:1" and _state(store, "slow:1") == "pending"  # mid-publish
        assert _relays_alive(store, "relayops_live") == 1  # main: 0 (looked dead)
        deadline = time.monotonic() + pause + 30
        while _state(store, "slow:1") != "sent" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(store, "slow:1") == "sent"
        assert client.llen(test_queue) == 1
    finally:
        stop.set()
        worker.join(timeout=60)
        client.execute_command("CLIENT", "UNPAUSE")
        client.close()
    assert not worker.is_alive()
    assert _relays_alive(store, "relayops_live") == 0  # stopped: marked at exit


def test_a_stuck_cycle_stops_the_heartbeat(sqlite_store: Store,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A cycle running longer than STALLED_CYCLE_SECONDS is stuck, not busy: no heartbeat."""
    relay = Relay(sqlite_store, handlers={"email": lambda m: None}, settings=Settings(),
                  owner="stuck:1")
    monkeypatch.setattr(relay_mod, "HEARTBEAT_SECONDS", 0.0)
    assert relay.heartbeat_from_thread() is True
    relay._cycle_started = time.monotonic() - relay_mod.STALLED_CYCLE_SECONDS - 1
    assert relay.heartbeat_from_thread() is False
    relay._cycle_started = time.monotonic()
    assert relay.heartbeat_from_thread() is True


def test_relay_once_leaves_no_heartbeat_row(pg_store: Store) -> None:
    with pg_store.begin() as conn:
        ob.add(conn, "email", {"n": 1}, key="mail:1")
    r = CliRunner().invoke(reliable_beat, ["--database-url", pg_store.url, "relay", "--once"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    with pg_store.engine.connect() as conn:
        rows = conn.execute(select(beats.c.owner).where(beats.c.role == "relay")).all()
    assert rows == []  # main: one row per run, each aging into "last seen"


class _Publisher:
    def __init__(self, destination: str) -> None:
        self.destination = destination

    def publish(self, messages: Any, now: Any) -> list[tuple[int, BaseException | None]]:
        return [(m.id, None) for m in messages]

    def tracked_tasks(self) -> list[str]:
        return []


def test_a_beat_row_records_its_destination_and_serves_only_it(pg_store: Store) -> None:
    store = pg_store
    loop = BeatLoop(store, Settings(), _Publisher("dramatiq"), "dqbeat:1",
                    schedule_group="dq", definitions=lambda now: [])
    try:
        assert loop.start()
        with store.engine.connect() as conn:
            dests = conn.execute(select(beats.c.destinations).where(
                beats.c.owner == "dqbeat:1")).scalar_one()
        assert dests == ["dramatiq"]  # main: None
        with store.begin() as conn:  # rows of group 'dq' for both trigger destinations
            for dest in ("dramatiq", "celery"):
                ob.add(conn, dest, {"task": "t", "args": [], "kwargs": {}}, key=f"{dest}:1",
                       schedule_group="dq")
            conn.execute(update(outbox).values(available_at=store.now(conn)
                                               - timedelta(minutes=5)))
        with store.engine.connect() as conn:
            found = unserved_outbox(conn, store.now(conn), due_seconds=60, alive_seconds=60)
        # the live Dramatiq beat publishes its group's `dramatiq` rows, not its `celery` ones
        assert [(u["group"], u["destinations"]) for u in found] == [("dq", ["celery"])]
        r = CliRunner().invoke(reliable_beat, ["--database-url", store.url, "status"],
                               catch_exceptions=False)
        assert ("schedule group dq: 1 live beats (publishing to dramatiq), 0 live relays"
                in r.output), r.output
    finally:
        loop.close()


def test_a_relay_of_no_group_counts_as_live_for_every_group(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay without an app (``reliable-beat dramatiq relay``, a relay with handlers only)
    records no group and serves every group: status counts it in each (main: "0 live
    relays" for every group while it ran)."""
    store = sqlite_store
    monkeypatch.setattr(relay_mod, "HEARTBEAT_SECONDS", 0.0)
    loops = [BeatLoop(store, Settings(), _Publisher("dramatiq"), f"{g}beat:1",
                      schedule_group=g, definitions=lambda now: []) for g in ("default", "b")]
    relay = Relay(store, handlers={"dramatiq": lambda m: None}, settings=Settings(),
                  owner="anygroup:1")
    try:
        assert all(loop.start() for loop in loops)
        assert relay.heartbeat_from_thread() is True
        with store.engine.connect() as conn:
            assert conn.execute(select(beats.c.schedule_group).where(
                beats.c.role == "relay")).scalar_one() is None
        assert _relays_alive(store, "default") == 1 and _relays_alive(store, "b") == 1
        r = CliRunner().invoke(reliable_beat, ["--database-url", store.url, "status"],
                               catch_exceptions=False)
        assert ("schedule group default: 1 live beats (publishing to dramatiq), 1 live relays"
                in r.output), r.output
    finally:
        relay.close()
        for loop in loops:
            loop.close()
