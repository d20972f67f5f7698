"""``ReliableScheduler`` in-process: the triggers it claims ahead and holds, on a real
PostgreSQL store and Redis broker.

The happy path (published at the slot, never before) and SIGKILL / SIGTERM while holding
are proven with real ``celery beat`` processes in ``tests/acceptance/test_beats.py``; this
file covers a hold that overran (the process was paused past half the sweep delay while
another beat's sweep may have sent its rows).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import select, update

from reliable_beat import schedules as sch
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.entries import EntryDefinition


@pytest.fixture
def scheduler(pg_store: Store, redis_url: str) -> Iterator[Any]:
    from reliable_beat.celery.scheduler import ReliableScheduler

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    app = Celery("hold", broker=redis_url)
    app.conf.update(reliable_beat_database_url=pg_store.url, beat_schedule={},
                    reliable_beat_claim_ahead_seconds=5, timezone="UTC")
    sched = ReliableScheduler(app=app)
    yield sched
    sched.close()
    app.close()
    r.flushdb()
    r.close()


def _seed(store: Store, names: list[str], in_seconds: float) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        slot = (now + timedelta(seconds=in_seconds)).replace(microsecond=0)
        for name in names:
            d = EntryDefinition(name=name, task="hold.t", args=[name],
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


def test_overran_hold_publishes_only_rows_still_its_own(
    scheduler: Any, pg_store: Store, redis_url: str
) -> None:
    _seed(pg_store, ["kept", "swept"], 3)
    scheduler.loop._claim()
    [group] = scheduler.loop._held.values()
    assert sorted(t.payload["headers"]["reliable_beat_entry"] for t in group.triggers) == [
        "kept", "swept"]
    assert _queued(redis_url) == []  # held, not published
    swept = next(t for t in group.triggers if t.payload["headers"]["reliable_beat_entry"]
                 == "swept")
    with pg_store.begin() as conn:  # another beat's sweep took it and sent it meanwhile
        conn.execute(update(outbox).where(outbox.c.id == swept.outbox_id)
                     .values(state="sent", claimed_by="other:1"))
    group.at = time.monotonic() - 6.0  # this process was paused 6 s past the slot
    scheduler.loop._publish_held(drain=True)
    assert _queued(redis_url) == ["kept"]  # the swept row is not published again
    with pg_store.engine.connect() as conn:
        states = dict(conn.execute(select(runs.c.entry_name, runs.c.state)).all())
        sent = dict(conn.execute(select(outbox.c.id, outbox.c.state)).all())
    assert states["kept"] == "dispatched"
    assert set(sent.values()) == {"sent"}


def test_hold_publishes_at_the_instant(scheduler: Any, pg_store: Store,
                                       redis_url: str) -> None:
    _seed(pg_store, ["a", "b"], 2)
    scheduler.loop._claim()
    [group] = scheduler.loop._held.values()
    assert _queued(redis_url) == []
    scheduler.loop._publish_held(drain=True)  # sleeps until the slot, then sends both at once
    assert time.monotonic() >= group.at
    assert _queued(redis_url) == ["a", "b"]
    with pg_store.begin() as conn:
        assert pg_store.now(conn) >= group.fire_at


def test_close_publishes_what_is_held_at_its_slot(scheduler: Any, pg_store: Store,
                                                  redis_url: str) -> None:
    _seed(pg_store, ["c"], 2)
    scheduler.loop._claim()
    [group] = scheduler.loop._held.values()
    assert _queued(redis_url) == []
    scheduler.close()  # Celery's stop path: held triggers go out at their slot first
    assert time.monotonic() >= group.at
    assert _queued(redis_url) == ["c"]
    assert scheduler.loop._held == {}


def test_slots_published_log_fields_are_never_negative(
    scheduler: Any, pg_store: Store, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    _seed(pg_store, ["n"], 2)
    scheduler.loop._claim()
    with caplog.at_level(logging.INFO, logger="reliable_beat"):
        scheduler.loop._publish_held(drain=True)  # built well before the instant, sent at it
    [record] = [r for r in caplog.records if getattr(r, "event", None) == "slots.published"]
    fields = record.__dict__
    assert fields["count"] == 1
    assert fields["built_ms"] >= 0, record.getMessage()
    assert fields["ready_ahead_ms"] > 0, record.getMessage()  # held ~2 s for its slot
    assert fields["marked_ms"] >= 0, record.getMessage()


def test_every_published_batch_logs_slots_published(
    scheduler: Any, pg_store: Store, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The non-held path (slots already due at the claim) logs ``slots.published`` too:
    a fresh user saw 2 such lines for 20,000 published slots (only held groups logged)."""
    _seed(pg_store, ["due-a", "due-b", "due-c"], -1)  # due now: published at the claim
    with caplog.at_level(logging.INFO, logger="reliable_beat"):
        scheduler.loop._claim()
    assert scheduler.loop._held == {}
    assert _queued(redis_url) == ["due-a", "due-b", "due-c"]
    records = [r for r in caplog.records if getattr(r, "event", None) == "slots.published"]
    assert [(r.__dict__["count"], r.__dict__["claimed_ahead"]) for r in records] == [
        (3, False)], [r.getMessage() for r in records]
