"""The workflow sweep backs off like the run sweep (SQLite, PostgreSQL; MariaDB with
``-m mariadb``).

An activity message that sits in a queue no worker consumes looks exactly like a lost one.
The sweep (:func:`reliable_beat.workflows.engine.redispatch_workflows`) used to re-send it
once per ``older_than`` window for as long as it waited, each copy growing the backlog; now
the k-th re-send of one event waits ``older_than * 2**k`` (k capped at
:data:`reliable_beat.redispatch.BACKOFF_CAP`), the run sweep's rule, and a truly lost
message is still re-sent.
"""

from __future__ import annotations

import itertools
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox as outbox_table
from reliable_beat.db.tables import workflow_events
from reliable_beat.redispatch import BACKOFF_CAP, backoff_wait
from reliable_beat.workflows import WorkflowContext, engine, workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver

WINDOW = timedelta(seconds=1)


@pytest.fixture
def app(store: Store) -> Celery:
    app = Celery("wfsweep", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_lease_seconds=30,
                    reliable_beat_database_url=store.engine.url.render_as_string(
                        hide_password=False))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="sweep.double")
    def double(self: IdempotentTask, x: int) -> int:
        return x * 2

    @workflow(name="sweep.one")
    def one(ctx: WorkflowContext, x: int) -> Any:
        return ctx.activity("sweep.double", x)

    @workflow(name="sweep.nap")
    def nap(ctx: WorkflowContext) -> Any:
        ctx.sleep(timedelta(milliseconds=100))
        return "woke"

    return app


def _now(store: Store) -> datetime:
    with store.connect() as conn:
        return store.now(conn)


def _mark_sent(store: Store, like: str) -> None:
    """The relay delivered these rows: their messages now sit in a queue no worker reads."""
    with store.begin() as conn:
        conn.execute(sa.update(outbox_table).where(outbox_table.c.message_id.like(like))
                     .values(state="sent"))


def _sweep_for(store: Store, seconds: float, like: str) -> list[datetime]:
    """Sweep every 50 ms for ``seconds`` (store clock); the instants (the sweep's own clock,
    recorded on the event as ``redispatched_at``) at which it added a message matching
    ``like`` (each re-send's row is marked sent at once: it joins the unconsumed queue)."""
    added: list[datetime] = []
    start = _now(store)
    while _now(store) - start < timedelta(seconds=seconds):
        if engine.redispatch_workflows(store, older_than=WINDOW) > 0:
            with store.connect() as conn:
                added.append(conn.execute(
                    sa.select(sa.func.max(workflow_events.c.redispatched_at))).scalar_one())
            _mark_sent(store, like)
        time.sleep(0.05)
    return added


def _gaps(instants: list[datetime]) -> list[float]:
    return [(b - a).total_seconds() for a, b in itertools.pairwise(instants)]


def test_an_unconsumed_activity_is_resent_at_growing_intervals(app: Celery,
                                                               store: Store) -> None:
    """No worker consumes the activity's queue for 8 s with a 1 s window: the sweep re-sends
    it at about 1, 3 and 7 s (waits 1, 2, 4 s), three copies, not one per window (main:
    seven or eight). Then a worker takes a copy: the workflow completes, the effect once."""
    handle = engine.start(store, "sweep.one", "unconsumed", [21])
    driver = Driver(store, app)
    assert driver.step()  # the advance: records the activity and its message
    _mark_sent(store, "act:%")
    added = _sweep_for(store, 8.0, "act:%")
    with store.connect() as conn:
        resends = conn.execute(sa.select(outbox_table.c.message_id).where(
            outbox_table.c.message_id.like("act:%:r%"))).scalars().all()
        ev = conn.execute(sa.select(workflow_events.c.redispatches)
                          .where(workflow_events.c.kind == "activity")).scalar_one()
    assert len(resends) == len(added) == 3, (resends, added)
    assert ev == 3
    gaps = _gaps(added)
    assert gaps[0] >= 2 * WINDOW.total_seconds(), gaps  # waits 1 s, then 2 s, then 4 s
    assert gaps[1] >= 4 * WINDOW.total_seconds(), gaps
    # a worker comes back and takes every copy: the activity runs once
    with store.begin() as conn:
        conn.execute(sa.update(outbox_table).where(outbox_table.c.message_id.like("act:%"))
                     .values(state="pending"))
    driver.run()
    assert handle.result(timeout=5) == 42


def test_a_lost_activity_is_still_resent_after_the_capped_wait(app: Celery,
                                                               store: Store) -> None:
    """The backoff is capped: an activity re-sent many times before is re-sent again once
    ``older_than * 2**BACKOFF_CAP`` passed since the last re-send (not ``2**k``), and not
    before; the copy reaches a worker and the workflow completes."""
    after = timedelta(seconds=60)
    handle = engine.start(store, "sweep.one", "lost", [5])
    driver = Driver(store, app)
    assert driver.step()
    _mark_sent(store, "act:%")  # ... and the broker lost it
    cap = backoff_wait(after, BACKOFF_CAP)
    assert cap == after * 2**BACKOFF_CAP == backoff_wait(after, 9)

    def seed(last_resend_ago: timedelta) -> None:
        with store.begin() as conn:
            now = store.now(conn)
            conn.execute(sa.update(workflow_events)
                         .where(workflow_events.c.kind == "activity")
                         .values(redispatches=9, redispatched_at=now - last_resend_ago,
                                 created_at=now - timedelta(days=1)))

    seed(cap - timedelta(seconds=30))
    assert engine.redispatch_workflows(store, older_than=after) == 0
    seed(cap + timedelta(seconds=1))
    assert engine.redispatch_workflows(store, older_than=after) == 1
    assert engine.redispatch_workflows(store, older_than=after) == 0  # just re-sent
    with store.connect() as conn:
        ev = conn.execute(sa.select(workflow_events.c.redispatches)
                          .where(workflow_events.c.kind == "activity")).scalar_one()
    assert ev == 10
    driver.run()
    assert handle.result(timeout=5) == 10


def test_a_timer_wake_is_resent_at_growing_intervals(app: Celery, store: Store) -> None:
    """A timer whose wake sits unconsumed: the sweep wakes the workflow at growing
    intervals too (main: once per window), and the wake completes it."""
    handle = engine.start(store, "sweep.nap", "nap")
    driver = Driver(store, app)
    assert driver.step()  # records the timer and its delayed wake
    _mark_sent(store, "wake:nap:%")
    time.sleep(0.2)  # past fire_at
    added = _sweep_for(store, 8.0, "wake:nap:due%")
    with store.connect() as conn:
        wakes = conn.execute(sa.select(outbox_table.c.message_id).where(
            outbox_table.c.message_id.like("wake:nap:due%"))).scalars().all()
    assert len(wakes) == len(added) == 3, (wakes, added)
    gaps = _gaps(added)
    assert gaps[0] >= 2 * WINDOW.total_seconds(), gaps
    assert gaps[1] >= 4 * WINDOW.total_seconds(), gaps
    with store.begin() as conn:
        conn.execute(sa.update(outbox_table).where(
            outbox_table.c.message_id.like("wake:nap:due%")).values(state="pending"))
    driver.run()
    assert handle.result(timeout=5) == "woke"
