"""Every publishing path of ``ReliableScheduler`` publishes a trigger row only while it is
still its own and pending (issue 12: a plain task ran twice), on real PostgreSQL + Redis.

* the fast path right after the commit (claim-ahead 0, or an entry already due), reached
  late because the process was paused: rows a sweep already sent are not sent again;
* a publish whose "sent" mark could not be written (database gone): the beat records the
  mark first when the database returns, before its own sweep can re-send the row.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import select, update

from reliable_beat import loop as loop_mod
from reliable_beat import schedules as sch
from reliable_beat import unsent
from reliable_beat.celery import scheduler as scheduler_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.errors import StoreUnavailableError

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def scheduler(pg_store: Store, redis_url: str) -> Iterator[Any]:
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    app = Celery("paths", broker=redis_url)
    app.conf.update(reliable_beat_database_url=pg_store.url, beat_schedule={},
                    reliable_beat_claim_ahead_seconds=0, timezone="UTC")
    sched = scheduler_mod.ReliableScheduler(app=app)
    yield sched
    sched.close()
    app.close()
    r.flushdb()
    r.close()


def _seed_due(store: Store, names: list[str]) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        slot = now.replace(microsecond=0)
        for name in names:
            d = EntryDefinition(name=name, task="paths.t", args=[name],
                                schedule=sch.IntervalSchedule(timedelta(hours=1), slot))
            values = d.row_values()
            values.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                          paused=False)
            conn.execute(entries.insert().values(**values))


def _queued(redis_url: str) -> list[str]:
    r = redis.Redis.from_url(redis_url)
    try:
        return sorted(json.loads(m)["headers"]["reliable_beat_entry"]
                      for m in r.lrange("celery", 0, -1))
    finally:
        r.close()


def test_fast_path_reached_late_publishes_only_rows_still_its_own(
    scheduler: Any, pg_store: Store, redis_url: str
) -> None:
    _seed_due(pg_store, ["kept", "swept"])
    result = scheduler.loop._beat.tick()  # the claim transaction committed ...
    assert len(result.triggers) == 2
    swept = next(t for t in result.triggers
                 if t.payload["headers"]["reliable_beat_entry"] == "swept")
    with pg_store.begin() as conn:  # ... another beat's sweep took one meanwhile (it looked
        # committed and unsent for longer than the sweep delay): wrote its row, re-stamped it
        ago = result.now - timedelta(seconds=11)
        conn.execute(update(runs).where(runs.c.id == swept.run_id)
                     .values(fire_at=ago, updated_at=ago))
        assert unsent.materialise_unsent(
            pg_store, conn, now=pg_store.now(conn), sweep_delay=timedelta(seconds=10),
            destination="celery", schedule_group=None, limit=10) == 1
    result.monotonic -= 6.0  # ... while this process was paused 6 s before its fast path
    scheduler.loop._publish(result)
    assert _queued(redis_url) == ["kept"]  # the swept row is not published a second time
    with pg_store.engine.connect() as conn:
        states = dict(conn.execute(select(runs.c.entry_name, runs.c.state)).all())
    assert states["kept"] == "dispatched"


def test_published_but_unmarked_is_recorded_before_any_sweep(
    scheduler: Any, pg_store: Store, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seed_due(pg_store, ["a", "b"])
    real_mark_sent = loop_mod.mark_sent
    calls = {"n": 0}

    def mark_sent_db_gone(*args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise StoreUnavailableError("database gone for a moment")
        return real_mark_sent(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "mark_sent", mark_sent_db_gone)
    scheduler.loop._claim()  # published at once; the mark could not be written
    assert _queued(redis_url) == ["a", "b"]
    with pg_store.begin() as conn:  # the outage outlasted the sweep delay
        ago = pg_store.now(conn) - timedelta(seconds=30)
        conn.execute(update(runs).values(fire_at=ago, created_at=ago, updated_at=ago))
    scheduler.loop._last_sweep = 0.0
    scheduler.loop._claim_at = 0.0
    scheduler.loop._step()  # database back: record first, then claim and sweep
    assert _queued(redis_url) == ["a", "b"]  # not re-sent by this beat's own sweep
    with pg_store.engine.connect() as conn:
        rows = conn.execute(select(outbox.c.state, outbox.c.claimed_by)).all()
        run_states = set(conn.execute(select(runs.c.state)).scalars())
    assert rows == []  # due triggers: no rows, and the sweep wrote none for them
    assert run_states == {"dispatched"}


def test_redispatch_reached_late_resends_only_runs_still_its_claim(
    pg_store: Store, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-dispatch sweep claims stuck runs, is paused past half its period, and another
    process claims one of them meanwhile: only the other one is re-sent."""
    from reliable_beat import redispatch as redispatch_mod
    from reliable_beat.beat import Beat
    from reliable_beat.celery.task import IdempotentTask
    from reliable_beat.relay import mark_sent
    from reliable_beat.settings import Settings

    app = Celery("redispatch", broker=redis_url)
    app.conf.update(reliable_beat_database_url=pg_store.url, task_default_queue="celery")

    @app.task(base=IdempotentTask, bind=True, name="paths.tracked")
    def tracked(self: Any, name: str) -> str:
        return name

    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        for name in ("kept", "taken"):
            d = EntryDefinition(name=name, task="paths.tracked", args=[name],
                                schedule=sch.IntervalSchedule(timedelta(hours=1), now))
            values = d.row_values()
            values.update(next_fire_at=now - timedelta(seconds=1), created_at=now,
                          updated_at=now, enabled=True, paused=False)
            conn.execute(entries.insert().values(**values))
    result = Beat(pg_store, owner="t").tick()
    with pg_store.begin() as conn:
        mark_sent(conn, [t.id for t in result.triggers], pg_store.now(conn))
        conn.execute(update(runs).values(dispatched_at=pg_store.now(conn)
                                         - timedelta(seconds=60)))
    real_claim = redispatch_mod.claim_stuck_runs

    def claim_then_pause(*args: Any, **kwargs: Any) -> Any:
        stuck = real_claim(*args, **kwargs)
        conn = args[1]
        # another beat re-sends "taken" while this one is paused (its stamp replaces ours)
        conn.execute(update(runs).where(runs.c.entry_name == "taken")
                     .values(updated_at=kwargs["now"] + timedelta(seconds=1)))
        time.sleep(1.2)  # paused past half the 2 s period
        return stuck

    monkeypatch.setattr(redispatch_mod, "claim_stuck_runs", claim_then_pause)
    settings = Settings(redispatch_seconds=2.0)
    sent = redispatch_mod.redispatch_stuck_runs(pg_store, app, settings)
    assert sent == 1
    assert _queued(redis_url) == ["kept"]
    app.close()


def test_relay_back_from_an_outage_leaves_triggers_to_their_publisher(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay that just saw the database come back does not sweep beat triggers for a
    sweep delay (the beat that published one during the outage records it first); other
    destinations are delivered at once."""
    import threading

    from reliable_beat import outbox as outbox_api
    from reliable_beat.relay import Relay
    from reliable_beat.settings import Settings

    delivered: list[str] = []

    def handler(message: Any) -> None:
        delivered.append(message.destination)

    with pg_store.begin() as conn:
        outbox_api.add(conn, "celery", {"task": "x"})
        outbox_api.add(conn, "webhook", {"destination": "d", "path": "/x"})
    relay = Relay(pg_store, handlers={"celery": handler, "webhook": handler},
                  settings=Settings(relay_poll_seconds=0.1))
    stop = threading.Event()
    real_run_once = relay.run_once
    calls = {"n": 0}

    def flaky() -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise StoreUnavailableError("database gone for a moment")
        claimed = real_run_once()
        if calls["n"] >= 4:
            stop.set()
        return claimed

    monkeypatch.setattr(relay, "run_once", flaky)
    relay.run_forever(stop)
    assert delivered == ["webhook"]
    with pg_store.engine.connect() as conn:
        states = dict(conn.execute(select(outbox.c.destination, outbox.c.state)).all())
    assert states == {"celery": "pending", "webhook": "sent"}


def test_sweep_reached_late_publishes_only_rows_still_its_own(
    scheduler: Any, pg_store: Store, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A beat's sweep claims unsent trigger rows, is paused past half its claim lease, and
    another sweep takes and sends one of them meanwhile: only the other one is sent."""
    _seed_due(pg_store, ["kept", "taken"])
    scheduler.loop._beat.tick()  # committed; the fast path never ran (the beat "died")
    with pg_store.begin() as conn:  # ... longer ago than the sweep delay: the sweep writes
        # the slots' trigger rows, then claims them
        ago = pg_store.now(conn) - timedelta(seconds=30)
        conn.execute(update(runs).values(fire_at=ago, created_at=ago, updated_at=ago))
    real_claim = loop_mod.claim_outbox_batch

    def claim_then_pause(*args: Any, **kwargs: Any) -> Any:
        messages = real_claim(*args, **kwargs)
        conn = args[1]
        taken = next(m.id for m in messages
                     if m.payload["headers"]["reliable_beat_entry"] == "taken")
        # meanwhile the lease ran out and another sweep sent "taken"
        conn.execute(update(outbox).where(outbox.c.id == taken)
                     .values(state="sent", claimed_by="other:1"))
        time.sleep(1.2)  # paused past half the (2 s) lease
        return messages

    monkeypatch.setattr(loop_mod, "SWEEP_LEASE", timedelta(seconds=2))
    monkeypatch.setattr(loop_mod, "claim_outbox_batch", claim_then_pause)
    monkeypatch.setattr(scheduler.loop, "redispatch", lambda *a, **k: 0)
    scheduler.loop._last_sweep = 0.0
    scheduler.loop._sweep()
    assert _queued(redis_url) == ["kept"]
