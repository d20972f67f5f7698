"""Workflows are scoped to the schedule group of the app that started them (SQLite,
PostgreSQL, and MariaDB with ``-m mariadb``; the two-app acceptance test is
tests/acceptance/test_workflow_app_scope.py).

A workflow records its group at start (the starting app's; a child its parent's; a
scheduled workflow its entry's), every outbox row it writes carries it (wakes, activity
messages, timer wakes, the sweep's re-sends), and a relay or beat of another group does
not claim them; rows without a group are claimed by any.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import entries as rb_entries
from reliable_beat import outbox
from reliable_beat import schedules as sch
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox as outbox_table
from reliable_beat.db.tables import runs, workflows
from reliable_beat.relay import claim_outbox_batch
from reliable_beat.workflows import WorkflowContext, engine, workflow
from reliable_beat.workflows.scheduled import start_for_slot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver


@pytest.fixture(params=["sqlite", "pg", pytest.param("mariadb", marks=pytest.mark.mariadb)])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    yield request.getfixturevalue(f"{request.param}_store")


def make_app(store: Store, main: str) -> Celery:
    app = Celery(main, set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_lease_seconds=30,
                    reliable_beat_database_url=store.engine.url.render_as_string(
                        hide_password=False))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="grp.double")
    def double(self: IdempotentTask, x: int) -> int:
        return x * 2

    # the child is registered without an app (no group of its own): it takes its parent's
    @workflow(name="grp.kid")
    def kid(ctx: WorkflowContext, x: int) -> Any:
        return ctx.activity("grp.double", x)

    @workflow(app, name="grp.flow")
    def flow(ctx: WorkflowContext, x: int) -> Any:
        a = ctx.activity("grp.double", x)
        ctx.sleep(timedelta(milliseconds=1))
        return [a, ctx.child(kid, x + 1)]

    return app


def groups(store: Store) -> tuple[dict[str, Any], dict[str, Any]]:
    with store.connect() as conn:
        wfs = dict(conn.execute(sa.select(workflows.c.workflow_id,
                                          workflows.c.schedule_group)).all())
        msgs = dict(conn.execute(sa.select(outbox_table.c.message_id,
                                           outbox_table.c.schedule_group)).all())
    return wfs, msgs


def claim(store: Store, group: str | None) -> list[str]:
    with store.begin() as conn:
        got = claim_outbox_batch(store, conn, owner=f"relay-{group}", now=store.now(conn),
                                 lease=timedelta(seconds=30), limit=100,
                                 schedule_group=group)
        ids = [m.id for m in got]
        conn.execute(sa.update(outbox_table).where(outbox_table.c.id.in_(ids))
                     .values(available_at=store.now(conn), claimed_by=None))
    return [m.message_id for m in got]


def test_a_workflow_its_child_and_every_message_carry_the_starting_apps_group(
    store: Store,
) -> None:
    app = make_app(store, "proj")
    handle = engine.get_definition("grp.flow").start("w1", args=(3,), store=store)  # type: ignore[union-attr]
    Driver(store, app).run()
    assert handle.result(timeout=1) == [6, 8]
    wfs, msgs = groups(store)
    assert wfs == {"w1": "proj", "w1/child1.3": "proj"}, wfs
    kinds = {m.split(":")[0] for m in msgs}
    assert kinds == {"wake", "act"}, msgs  # the start, activity, timer and child wakes
    assert set(msgs.values()) == {"proj"}, msgs


def test_another_groups_relay_does_not_claim_a_workflows_messages(store: Store) -> None:
    make_app(store, "proj")
    engine.get_definition("grp.flow").start("w2", args=(1,), store=store)  # type: ignore[union-attr]
    with store.begin() as conn:  # a message of no group (a task's outbox row): any relay
        outbox.add(conn, "celery", {"task": "x", "args": [], "kwargs": {}}, key="plain:1")
    assert claim(store, "proj2") == ["plain:1"]
    assert sorted(claim(store, "proj")) == ["plain:1", "wake:w2:start"]
    assert sorted(claim(store, None)) == ["plain:1", "wake:w2:start"]


def test_a_scheduled_workflow_takes_its_entrys_group_and_the_sweep_keeps_it(
    store: Store,
) -> None:
    app = make_app(store, "proj")  # the definition's app is proj; the entry is proj2's
    with store.begin() as conn:
        now = store.now(conn)
    rb_entries.save_runtime_entry(store, rb_entries.EntryDefinition(
        name="nightly", task="reliable_beat.workflow.start",
        schedule=sch.IntervalSchedule(timedelta(hours=1), now)), create=True,
        schedule_group="proj2")
    key = "nightly@slot"
    with store.begin() as conn:
        conn.execute(runs.insert().values(
            idempotency_key=key, entry_name="nightly", fire_at=now, task="t", args=[],
            kwargs={}, state="running", created_at=now, updated_at=now))
        start_for_slot(conn, "grp.flow", key, [5], {})
    driver = Driver(store, app)
    assert driver.step()  # the start wake: the advance records the activity and its message
    with store.begin() as conn:  # the broker loses the activity message
        conn.execute(sa.update(outbox_table).where(outbox_table.c.message_id.like("act:%"))
                     .values(state="sent"))
    assert engine.redispatch_workflows(store, older_than=timedelta(0)) >= 1
    wfs, msgs = groups(store)
    assert wfs == {key: "proj2"}
    resent = [m for m in msgs if m.startswith("act:") and ":r" in m.rsplit("#", 1)[1]]
    assert resent and {msgs[m] for m in resent} == {"proj2"}, msgs
    assert set(msgs.values()) == {"proj2"}, msgs
    assert claim(store, "proj") == []
