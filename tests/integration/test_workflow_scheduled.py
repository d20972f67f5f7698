"""Scheduled workflows on SQLite and PostgreSQL: a beat entry whose task is
``reliable_beat.workflow.start`` starts one workflow per slot, id ``<entry>@<slot>``, however
many beats tick and however often the trigger is delivered; the overlap policy ``skip`` skips
a slot while the previous slot's workflow is still waiting, and fires again once it ended."""

from __future__ import annotations

import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs, workflows
from reliable_beat.entries import EntryDefinition
from reliable_beat.slots import idempotency_key
from reliable_beat.unsent import materialise_unsent
from reliable_beat.workflows import WorkflowContext, engine, signal, workflow
from reliable_beat.workflows.scheduled import START_TASK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver


def report(ctx: WorkflowContext, region: str) -> Any:
    ok = ctx.wait_signal("done")
    return [region, ok, ctx.info.workflow_id]


def _app(store: Store) -> Celery:
    app = Celery("wfsched", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_lease_seconds=30,
                    reliable_beat_database_url=store.engine.url.render_as_string(False))
    workflow(app, name="t.report")(report)
    return app


def _seed(store: Store, name: str, every: int, anchor: datetime, **kw: Any) -> None:
    d = EntryDefinition(name=name, task=START_TASK, args=["t.report", "eu"],
                        schedule=sch.IntervalSchedule(timedelta(seconds=every), anchor), **kw)
    with store.begin() as conn:
        now = store.now(conn)
        values = d.row_values()
        values.update(next_fire_at=anchor + timedelta(seconds=every), created_at=now,
                      updated_at=now, enabled=True, paused=False)
        conn.execute(entries.insert().values(**values))


def _store(request: pytest.FixtureRequest, dialect: str) -> Store:
    name = "sqlite_store" if dialect == "sqlite" else "pg_store"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def _now(store: Store) -> datetime:
    with store.connect() as conn:
        return store.now(conn)


def _workflows(store: Store) -> list[Any]:
    with store.connect() as conn:
        return list(conn.execute(sa.select(workflows).order_by(workflows.c.fire_at)).all())


def _beats(store: Store) -> list[Beat]:
    """Two beats. No process publishes their triggers on the fast path here: the sweep
    writes the rows of the due slots (:func:`_tick_both`), and the driver, like a relay,
    delivers each trigger row once its ``available_at`` is due, so the sweep delay (the fast
    path's head start, 10 s by default) is 0: the row is due at its slot."""
    return [Beat(store, owner=f"b:{i}", sweep_delay=timedelta(0)) for i in (1, 2)]


def _tick_both(beats: list[Beat]) -> None:
    threads = [threading.Thread(target=b.tick) for b in beats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # Nothing published the due triggers (they have no outbox row): the beats' sweep writes
    # their rows, as after a beat that died between its commit and its publish.
    store = beats[0].store
    with store.begin() as conn:
        materialise_unsent(store, conn, now=store.now(conn), sweep_delay=timedelta(0),
                           destination="celery", schedule_group=None, limit=1000)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_each_slot_starts_its_workflow_once_under_two_beats(request: pytest.FixtureRequest,
                                                            dialect: str) -> None:
    store = _store(request, dialect)
    app = _app(store)
    now = _now(store).replace(microsecond=0)
    anchor = now - timedelta(seconds=3 * 60 + 30)  # three missed slots, caught up
    _seed(store, "nightly", 60, anchor, misfire_policy="catch_up",
          misfire_grace=timedelta(seconds=3600))
    beats = _beats(store)
    _tick_both(beats)
    _tick_both(beats)
    # every trigger delivered twice (a broker redelivery, a relay's re-publish)
    Driver(store, app, duplicate=lambda n: True).run()
    slots = [anchor + timedelta(seconds=60 * k) for k in (1, 2, 3)]
    rows = _workflows(store)
    assert [r.workflow_id for r in rows] == [idempotency_key("nightly", s) for s in slots]
    assert [r.entry_name for r in rows] == ["nightly"] * 3
    assert [r.fire_at for r in rows] == slots
    assert {r.state for r in rows} == {"waiting"}
    with store.connect() as conn:
        starts = conn.execute(sa.select(runs.c.idempotency_key, runs.c.state, runs.c.result)
                              .where(runs.c.entry_name == "nightly")
                              .order_by(runs.c.fire_at)).all()
    assert [(s.state, s.result) for s in starts] == [
        ("succeeded", r.workflow_id) for r in rows]
    for r in rows:
        signal(store, r.workflow_id, "done", True)
    Driver(store, app).run()
    for r in rows:
        assert engine.get_workflow(store, r.workflow_id)["result"] == ["eu", True,
                                                                        r.workflow_id]
    assert len(_workflows(store)) == 3


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_overlap_skip_reads_the_previous_slots_workflow(request: pytest.FixtureRequest,
                                                        dialect: str) -> None:
    store = _store(request, dialect)
    app = _app(store)
    every = 2
    now = _now(store)
    anchor = now - timedelta(seconds=every) + timedelta(seconds=1)  # slot 1 in 1 s
    _seed(store, "hourly", every, anchor, overlap_policy="skip", misfire_policy="catch_up",
          misfire_grace=timedelta(seconds=3600))  # a slow tick still sees every slot
    beats = _beats(store)
    driver = Driver(store, app)

    def next_slot() -> datetime:
        with store.connect() as conn:
            return conn.execute(sa.select(entries.c.next_fire_at)
                                .where(entries.c.name == "hourly")).scalar_one()

    def tick_at(slot: datetime) -> None:
        time.sleep(max((slot - _now(store)).total_seconds(), 0) + 0.3)
        _tick_both(beats)
        driver.run()

    def hourly_runs() -> list[Any]:
        with store.connect() as conn:
            return list(conn.execute(sa.select(runs.c.fire_at, runs.c.state, runs.c.reason)
                                     .where(runs.c.entry_name == "hourly")
                                     .order_by(runs.c.fire_at)).all())

    slot1 = anchor + timedelta(seconds=every)
    tick_at(slot1)
    first = idempotency_key("hourly", slot1)
    assert engine.get_workflow(store, first)["state"] == "waiting"
    tick_at(next_slot())  # slot 1's workflow still waits: the slots due now are skipped
    skipped = hourly_runs()[1:]
    assert skipped and {(r.state, r.reason) for r in skipped} == {("skipped", "overlap:skip")}
    assert [r.workflow_id for r in _workflows(store)] == [first]
    signal(store, first, "done", 1)
    driver.run()
    assert engine.get_workflow(store, first)["state"] == "completed"
    slot = next_slot()
    tick_at(slot)  # the previous workflow ended: the next slot starts its own, once
    assert [r.workflow_id for r in _workflows(store)] == [first,
                                                           idempotency_key("hourly", slot)]
