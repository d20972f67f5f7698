"""A trigger the beat publishes right after its claim has no outbox row: its run row is its
record (reliable_beat.unsent), on real PostgreSQL (and MariaDB for the race) and Redis.

* the fast path writes no trigger row for a due slot; a slot claimed ahead keeps its row;
* a publish the broker refused writes the rows then, and a relay publishes them;
* an expired due trigger skips its run (reason ``expired``), with no row;
* a beat that committed and never published (it died): the next sweep writes the rows and
  publishes each once; a relay with an app does the same; a relay without one does not;
* a paused beat taking its runs back and a sweep materialising them, on two connections:
  whichever commits first wins, the other leaves the run alone (PostgreSQL and MariaDB);
* a re-send or a lease clear of a periodic run without a row goes where its trigger went
  (the entry's options).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import select, update

from reliable_beat import runs as rb_runs
from reliable_beat import schedules as sch
from reliable_beat import unsent
from reliable_beat.beat import Beat
from reliable_beat.celery import scheduler as scheduler_mod
from reliable_beat.celery.scheduler import publish_triggers
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.redispatch import claim_stuck_runs
from reliable_beat.relay import Relay

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

QUEUE = "rowless"


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    celery_app = Celery("rowless", broker=redis_url)
    celery_app.conf.update(task_default_queue=QUEUE, timezone="UTC", beat_schedule={},
                           reliable_beat_claim_ahead_seconds=0)
    yield celery_app
    celery_app.close()
    r.flushdb()
    r.close()


def _seed(store: Store, names: list[str], *, due_in: float = 0.0,
          options: dict[str, Any] | None = None, group: str | None = None) -> datetime:
    """Entries of task ``rowless.t`` (args ``[name]``), their slot ``due_in`` seconds from now
    (whole seconds); returns the slot."""
    with store.begin() as conn:
        now = store.now(conn)
        slot = (now + timedelta(seconds=due_in)).replace(microsecond=0)
        for name in names:
            d = EntryDefinition(name=name, task="rowless.t", args=[name], options=options or {},
                                schedule=sch.IntervalSchedule(timedelta(hours=1), slot))
            values = d.row_values()
            values.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                          paused=False, schedule_group=group)
            conn.execute(entries.insert().values(**values))
    return slot


def _queued(redis_url: str, queue: str = QUEUE) -> list[str]:
    r = redis.Redis.from_url(redis_url)
    try:
        return sorted(json.loads(m)["headers"]["reliable_beat_entry"]
                      for m in r.lrange(queue, 0, -1))
    finally:
        r.close()


def _rows(store: Store) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(select(outbox).order_by(outbox.c.id)).all())


def _runs(store: Store) -> dict[str, Any]:
    with store.engine.connect() as conn:
        return {r.entry_name: r for r in conn.execute(select(runs)).all()}


def test_due_slot_writes_no_trigger_row_and_a_slot_claimed_ahead_keeps_its_row(
    pg_store: Store, app: Celery, redis_url: str
) -> None:
    app.conf.update(reliable_beat_database_url=pg_store.url,
                    reliable_beat_claim_ahead_seconds=5)
    sched = scheduler_mod.ReliableScheduler(app=app)
    try:
        _seed(pg_store, ["due"])
        _seed(pg_store, ["ahead"], due_in=2)
        sched.loop._claim()  # the due slot is published at once, the other one held
        assert _queued(redis_url) == ["due"]
        rows = _rows(pg_store)
        ahead_key = _runs(pg_store)["ahead"].idempotency_key
        assert [r.message_id for r in rows] == [f"trigger:{ahead_key}"]
        assert rows[0].state == "pending" and rows[0].claimed_by == sched.loop.owner
        states = {n: r.state for n, r in _runs(pg_store).items()}
        assert states == {"due": "dispatched", "ahead": "scheduled"}
        assert _runs(pg_store)["due"].dispatched_at is not None
        sched.loop._publish_held(drain=True)  # the held slot at its instant, through its row
        assert _queued(redis_url) == ["ahead", "due"]
        assert [r.state for r in _rows(pg_store)] == ["sent"]
        assert {n: r.state for n, r in _runs(pg_store).items()} == {
            "due": "dispatched", "ahead": "dispatched"}
    finally:
        sched.close()


def test_refused_publish_writes_the_rows_and_a_relay_publishes_them_once_the_broker_is_back(
    pg_store: Store, app: Celery, redis_url: str
) -> None:
    _seed(pg_store, ["a", "b"])
    result = Beat(pg_store, owner="t:1").tick()
    assert [t.outbox_id for t in result.triggers] == [None, None]
    down = Celery("rowless", broker="redis://127.0.0.1:1/0")
    down.conf.update(broker_connection_retry=False, task_publish_retry=False)
    try:
        assert publish_triggers(pg_store, down, result.triggers, result.now) == 0
    finally:
        down.close()
    rows = _rows(pg_store)
    by_run = {t.run_id: t for t in result.triggers}
    assert sorted(r.run_id for r in rows) == sorted(by_run)
    with pg_store.engine.connect() as conn:
        now = pg_store.now(conn)
    for r in rows:  # as the tick would have written it, due now, for any relay or sweep
        t = by_run[r.run_id]
        assert (r.message_id, r.destination, r.state) == (f"trigger:{t.key}", "celery", "pending")
        assert r.payload == t.payload and r.claimed_by is None and r.available_at <= now
    assert {r.state for r in _runs(pg_store).values()} == {"scheduled"}
    relay = Relay(pg_store, app)
    try:
        assert relay.run_once() == 2
        assert relay.run_once() == 0
    finally:
        relay.close()
    assert _queued(redis_url) == ["a", "b"]
    assert {r.state for r in _rows(pg_store)} == {"sent"}
    assert {r.state for r in _runs(pg_store).values()} == {"dispatched"}


def test_expired_due_trigger_skips_its_run_without_a_row(
    pg_store: Store, app: Celery, redis_url: str
) -> None:
    _seed(pg_store, ["late"], due_in=-5, options={"expires": 1})
    result = Beat(pg_store, owner="t:1").tick()
    assert len(result.triggers) == 1
    assert publish_triggers(pg_store, app, result.triggers, result.now) == 0
    run = _runs(pg_store)["late"]
    assert (run.state, run.reason) == ("skipped", "expired")
    assert run.finished_at is not None
    assert _rows(pg_store) == [] and _queued(redis_url) == []


def _loop(store: Store, app: Celery) -> Any:
    app.conf.update(reliable_beat_database_url=store.url)
    sched = scheduler_mod.ReliableScheduler(app=app)
    sched.loop._beat.sweep_delay = timedelta(0)  # swept as soon as the test looks
    sched.loop.redispatch = lambda: 0  # type: ignore[method-assign]
    return sched


def test_committed_never_published_slots_are_swept_once(
    pg_store: Store, app: Celery, redis_url: str
) -> None:
    _seed(pg_store, ["a", "b"])
    _seed(pg_store, ["other"], group="another-app")  # another app's: not this beat's to send
    result = Beat(pg_store, owner="dead:1").tick()  # committed; the beat died before publish
    assert len(result.triggers) == 3 and _rows(pg_store) == []
    sched = _loop(pg_store, app)
    try:
        sched.loop.sweep()
        sched.loop.sweep()
    finally:
        sched.close()
    assert _queued(redis_url) == ["a", "b"]
    rows = {r.run_id: r for r in _rows(pg_store)}
    runs_now = _runs(pg_store)
    assert {runs_now[n].id for n in ("a", "b")} == set(rows)
    for t in result.triggers:  # the payload the tick built
        if t.run_id in rows:
            assert rows[t.run_id].payload == t.payload and rows[t.run_id].state == "sent"
    assert {n: r.state for n, r in runs_now.items()} == {
        "a": "dispatched", "b": "dispatched", "other": "scheduled"}


def test_relay_with_an_app_sweeps_unpublished_slots_and_one_without_does_not(
    pg_store: Store, app: Celery, redis_url: str
) -> None:
    _seed(pg_store, ["a"])
    Beat(pg_store, owner="dead:1").tick()
    bare = Relay(pg_store, None, handlers={"celery": lambda m: None})
    bare.unsent_after = timedelta(0)
    try:
        assert bare.maybe_materialise_unsent() == 0
    finally:
        bare.close()
    assert _rows(pg_store) == []
    relay = Relay(pg_store, app)
    relay.unsent_after = timedelta(0)
    try:
        assert relay.run_once() == 1
    finally:
        relay.close()
    assert _queued(redis_url) == ["a"]
    assert _runs(pg_store)["a"].state == "dispatched"


@pytest.fixture(params=["pg_store", pytest.param("mariadb_store", marks=pytest.mark.mariadb)])
def server(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def _committed_run(store: Store) -> tuple[int, datetime]:
    """A due slot's run as a beat's claim left it before its publish: ``scheduled``, no
    trigger row, ``created_at = updated_at`` = the claim's now, all of it 10 s ago (past the
    sweep delay of :func:`_sweep`). Returns (run id, the claim's now)."""
    _seed(store, ["slot"], due_in=-1)
    result = Beat(store, owner="paused:1").tick()
    assert len(result.triggers) == 1 and result.now is not None
    (t,) = result.triggers
    claimed_at = result.now - timedelta(seconds=10)
    with store.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == t.run_id).values(
            fire_at=t.fire_at - timedelta(seconds=10), created_at=claimed_at,
            updated_at=claimed_at))
    return t.run_id, claimed_at


def _sweep(store: Store, conn: Any) -> int:
    return unsent.materialise_unsent(store, conn, now=store.now(conn),
                                     sweep_delay=timedelta(seconds=5), destination="celery",
                                     schedule_group=None, limit=10)


def test_sweep_first_then_take_back_leaves_the_run_to_the_sweep(server: Store) -> None:
    run_id, claimed_at = _committed_run(server)
    got: list[set[int]] = []
    with server.begin() as conn:
        assert _sweep(server, conn) == 1  # the sweep holds the run's lock, not committed yet
        taker = threading.Thread(
            target=lambda: got.append(unsent.take_back_runs(server, [run_id], claimed_at)))
        taker.start()
        time.sleep(0.5)
        assert taker.is_alive(), "the take-back did not wait for the sweep's lock"
    taker.join(30)
    assert got == [set()]  # the sweep committed first: the beat does not publish it
    assert [r.run_id for r in _rows(server)] == [run_id]


def test_take_back_first_then_sweep_leaves_the_run_to_the_beat(server: Store) -> None:
    run_id, claimed_at = _committed_run(server)
    swept: list[int] = []
    with server.begin() as conn:
        assert unsent.take_back(conn, [run_id], claimed_at=claimed_at,
                                now=server.now(conn)) == {run_id}

        def sweep() -> None:
            with server.begin() as c2:
                swept.append(_sweep(server, c2))

        sweeper = threading.Thread(target=sweep)
        sweeper.start()
        sweeper.join(30)
        assert swept == [0]  # the run is locked by the take-back: skipped, not waited for
    with server.begin() as conn:
        assert _sweep(server, conn) == 0  # committed: re-stamped, not the sweep's any more
    assert _rows(server) == []


def test_resend_of_a_periodic_run_without_a_row_goes_where_its_trigger_went(
    pg_store: Store,
) -> None:
    options = {"queue": "special", "priority": 3, "headers": {"team": "billing"},
               "expires": 3600}
    _seed(pg_store, ["p"], due_in=-1, options=options)
    result = Beat(pg_store, owner="t:1").tick()
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        conn.execute(outbox.delete())  # no row (a due slot's trigger; or a purged one)
        conn.execute(update(runs).values(state="dispatched",
                                         dispatched_at=now - timedelta(hours=1)))
        stuck = claim_stuck_runs(pg_store, conn, now=now, after=timedelta(seconds=60),
                                 tasks=["rowless.t"])
    assert len(stuck) == 1
    assert stuck[0].payload == result.triggers[0].payload  # the message the tick published


def test_lease_clear_of_a_periodic_run_without_a_row_resends_it(pg_store: Store) -> None:
    _seed(pg_store, ["p"], due_in=-1, options={"queue": "special"})
    result = Beat(pg_store, owner="t:1").tick()
    key = result.triggers[0].key
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
        conn.execute(outbox.delete())  # no row (a due slot's trigger; or a purged one)
        conn.execute(update(runs).values(state="running", leased_by="w:1",
                                         lease_expires_at=now + timedelta(hours=1)))
    done = rb_runs.release_lease(pg_store, key)
    assert done.resend == rb_runs.RESENT, done.note
    (row,) = _rows(pg_store)
    assert (row.message_id, row.state) == (f"trigger:{key}", "pending")
    assert row.payload == result.triggers[0].payload


def _orphan_and_malformed(store: Store) -> dict[str, str]:
    """Two committed, unpublished runs: entry "gone" deleted, entry "bad" with options a
    trigger cannot use (``priority: "high"``, written by SQL). Returns their keys by entry."""
    _seed(store, ["gone", "bad"], due_in=-1, options={"queue": "special"})
    result = Beat(store, owner="dead:1").tick()  # committed; the beat died before publish
    with store.begin() as conn:
        conn.execute(entries.delete().where(entries.c.name == "gone"))
        conn.execute(update(entries).where(entries.c.name == "bad")
                     .values(options={"queue": "special", "priority": "high"}))
        # the slot and last update a minute ago: due for the sweep
        ago = store.now(conn) - timedelta(minutes=1)
        conn.execute(update(runs).values(fire_at=ago, updated_at=ago))
    assert len(result.triggers) == 2
    return {n: r.idempotency_key for n, r in _runs(store).items()}


def _routing_errors(caplog: pytest.LogCaptureFixture, keys: dict[str, str]) -> dict[str, str]:
    found = {}
    for rec in caplog.records:
        if rec.levelname == "ERROR" and "default routing" in rec.getMessage():
            for entry, key in keys.items():
                if key in rec.getMessage():
                    found[entry] = rec.getMessage()
    return found


def test_sweep_and_resend_of_a_run_whose_entry_is_gone_or_malformed_log_an_error(
    pg_store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    """Fails on the old code: the sweep and a re-send sent such runs to the task's default
    queue without a word."""
    keys = _orphan_and_malformed(pg_store)
    caplog.set_level(logging.ERROR, logger="reliable_beat.unsent")
    with pg_store.begin() as conn:
        assert _sweep(pg_store, conn) == 2
    swept = _routing_errors(caplog, keys)
    assert set(swept) == {"gone", "bad"}, caplog.text
    assert "entry 'gone'" in swept["gone"] and "entry deleted" in swept["gone"]
    assert "options malformed" in swept["bad"] and "priority" in swept["bad"]
    assert "restore the entry" in swept["gone"] and "sweep" in swept["gone"]
    caplog.clear()
    with pg_store.engine.connect() as conn:
        rows = conn.execute(select(runs).order_by(runs.c.id)).all()
        messages = unsent.run_messages(conn, rows, "celery")
    assert all("queue" not in m.payload.get("options", {}) for m in messages)
    resent = _routing_errors(caplog, keys)
    assert set(resent) == {"gone", "bad"} and "re-sent" in resent["gone"], caplog.text
