"""A workflow step's statements on the psycopg connection (reliable_beat.workflows.pg_statements,
the completion hook in reliable_beat.workflow_store, the hand-off's outbox insert).

The same steps run twice on PostgreSQL, handed off and advanced in process as a worker does:
once on the driver path, once on the portable one (``uses_psycopg`` answering False). They
must write the same history, the same workflow row and the same outbox states, each effect
once, and the driver path must take fewer statements per step (it merges the completion's two
updates into one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import handoff, workflow_store
from reliable_beat import outbox as outbox_mod
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, workflow_events, workflows
from reliable_beat.messages import OutboxMessage
from reliable_beat.workflows import WorkflowContext, engine, pg_statements

#: the modules whose psycopg switch selects the driver path of a workflow step
DRIVER_USERS = ["reliable_beat.workflow_store", "reliable_beat.outbox",
                "reliable_beat.workflows.history", "reliable_beat.workflows.advance",
                "reliable_beat.workflows.replay", "reliable_beat.workflows.sticky"]

effects = sa.Table("wfdrv_effects", sa.MetaData(),
                   sa.Column("id", sa.Integer, primary_key=True),
                   sa.Column("key", sa.String(200), nullable=False))
LEASE = timedelta(seconds=30)
STEPS = 3


def _app(store: Store) -> Celery:
    app = Celery("wfdrv", set_as_current=False)
    app.conf.update(broker_url="memory://",
                    reliable_beat_database_url=store.engine.url.render_as_string(
                        hide_password=False))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="wfdrv.double")
    def double(self: IdempotentTask, x: int) -> int:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key))
            self.returns(x * 2)
        return x * 2

    def steps(ctx: WorkflowContext, n: int) -> int:
        total = 0
        for i in range(n):
            total += ctx.activity(double, i + 1)
        return total

    engine.register(engine.WorkflowDefinition(name="wfdrv.steps", fn=steps))
    return app


def _run(store: Store, app: Celery, wid: str, on_step: Callable[[], None]) -> int:
    """Start ``wid`` and drive it as one worker does: every activity message it publishes
    runs here, and the completed activity's workflow is advanced in process."""
    broker: list[OutboxMessage] = []

    def publish(messages: Sequence[OutboxMessage]) -> list[tuple[int, BaseException | None]]:
        broker.extend(messages)
        return [(m.id, None) for m in messages]

    def advance(st: Store, wake: handoff.Wake) -> str:
        return engine.advance(st, wake.workflow_id, owner="t", lease=LEASE)

    engine.start(store, "wfdrv.steps", wid, [STEPS])
    with store.begin() as conn:  # its start message: delivered here, by hand
        conn.execute(sa.update(outbox).where(outbox.c.message_id == f"wake:{wid}:start")
                     .values(state="sent"))
    with handoff.publishing(publish, None, advance), handoff.deferred_marks(store):
        assert engine.advance(store, wid, owner="t", lease=LEASE) == "waiting"
    delivered = 0
    while broker:
        message = broker.pop(0)
        assert message.payload["task"] == "wfdrv.double"  # wakes never travel: in process
        on_step()
        with handoff.publishing(publish, None, advance):  # as the worker's task does
            app.tasks["wfdrv.double"].apply(
                tuple(message.payload["args"]), dict(message.payload["kwargs"]),
                headers=message.payload["headers"])
        delivered += 1
    return delivered


def _written(store: Store, wid: str) -> dict[str, Any]:
    with store.connect() as conn:
        wf = conn.execute(sa.select(workflows).where(workflows.c.workflow_id == wid)).one()
        events = conn.execute(
            sa.select(workflow_events.c.seq, workflow_events.c.kind, workflow_events.c.name,
                      workflow_events.c.state, workflow_events.c.result,
                      workflow_events.c.run_key, workflow_events.c.fence_token,
                      workflow_events.c.completed_at.is_not(None))
            .where(workflow_events.c.workflow_pk == wf.id)
            .order_by(workflow_events.c.seq)).all()
        rows = conn.execute(
            sa.select(outbox.c.message_id, outbox.c.state, outbox.c.sent_at.is_not(None),
                      outbox.c.schedule_group, outbox.c.payload)
            .where(outbox.c.message_id.like(f"%{wid}%")).order_by(outbox.c.id)).all()
        done = conn.execute(sa.select(effects.c.key).where(effects.c.key.like(f"%{wid}%"))
                            .order_by(effects.c.key)).scalars().all()
    return {
        "workflow": (wf.state, wf.result, wf.history_len, wf.history_bytes, wf.fence_token,
                     wf.wake_seq, wf.claimed_wake_seq, wf.advances, wf.leased_by,
                     wf.lease_expires_at),
        "events": [tuple(str(v).replace(wid, "W") if isinstance(v, str) else v for v in e)
                   for e in events],
        "outbox": [tuple(str(v).replace(wid, "W") for v in r) for r in rows],
        "effects": [k.replace(wid, "W") for k in done],
    }


def test_a_step_on_the_driver_path_writes_what_the_portable_path_writes(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.from_url(pg_store.url, role="worker")
    effects.create(store.engine, checkfirst=True)
    app = _app(store)
    counted: dict[str, int] = {"statements": 0, "core": 0}
    per_step: dict[str, list[int]] = {"driver": [], "portable": []}

    def on_exec(_c: Any, _cur: Any, _s: str, _p: Any, context: Any, _m: bool) -> None:
        counted["statements"] += 1
        counted["core"] += context is not None  # built and compiled per call by SQLAlchemy

    def step_boundary(path: str) -> Callable[[], None]:
        def on_step() -> None:
            per_step[path].append(counted["statements"])
            counted["statements"] = 0
        return on_step

    # every engine: the activity runs on the app's store (the worker's), not on ``store``
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", on_exec)
    try:
        assert _run(store, app, "wfdrv-a", step_boundary("driver")) == STEPS
        per_step["driver"].append(counted["statements"])
        driver_core = counted["core"]
        for name in DRIVER_USERS:
            monkeypatch.setattr(importlib.import_module(name), "uses_psycopg",
                                lambda conn: False)
        counted.update(statements=0, core=0)
        assert _run(store, app, "wfdrv-b", step_boundary("portable")) == STEPS
        per_step["portable"].append(counted["statements"])
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", on_exec)
        store.dispose()
    a, b = _written(pg_store, "wfdrv-a"), _written(pg_store, "wfdrv-b")
    assert a == b
    assert a["workflow"][:2] == ("completed", 2 + 4 + 6)
    assert len(a["effects"]) == STEPS and len(set(a["effects"])) == STEPS  # each once
    # every activity message and every wake answered in process: marked sent, none pending
    assert [r[1] for r in a["outbox"]] == ["sent"] * len(a["outbox"])
    # a middle step (an activity's completion + the in-process advance recording the next):
    # the driver path runs fewer statements, and of the workflow's, none through Core
    assert per_step["driver"][1] < per_step["portable"][1], per_step
    assert driver_core < counted["core"], (driver_core, counted["core"])


def test_the_record_merged_with_its_message_insert_is_fenced(pg_store: Store) -> None:
    """The fence check, the event and the activity's outbox row as one statement
    (pg_statements.fence_check_event_and_outbox, run by outbox.add's psycopg insert): a
    stale fence token writes none of the three; the live one writes all three."""
    store = Store.from_url(pg_store.url, role="worker")
    _app(store)  # registers wfdrv.steps
    wid = "wfdrv-fenced"
    engine.start(store, "wfdrv.steps", wid, [1])
    with store.connect() as conn:
        wf = conn.execute(sa.select(workflows.c.id, workflows.c.fence_token,
                                    workflows.c.run_no, workflows.c.history_len)
                          .where(workflows.c.workflow_id == wid)).one()

    def record(token: int) -> Any:
        key = f"act:{wid}#1"
        event = dict(workflow_pk=wf.id, run_no=wf.run_no, seq=1, kind="activity",
                     name="wfdrv.double", args_digest="d", args=[[1], {}, None],
                     state="scheduled", result=None, error=None, fire_at=None,
                     run_key=f"{wid}#1", fence_token=token)
        answers: list[Any] = []

        def merged(c: Any, params: dict[str, Any] | None) -> Any:
            assert params is not None  # the psycopg path: merged
            answers.append(pg_statements.fence_check_event_and_outbox(
                c, wf.id, token, LEASE, 10, event, params))
            return None if answers[-1] is None else answers[-1][1]

        returned: list[Any] = []
        with store.begin() as conn:
            outbox_mod.add(conn, "celery", {"task": "wfdrv.double", "args": [1],
                                            "kwargs": {}}, key=key, notify=False,
                           delay=handoff.HANDOFF_DELAY, returned=returned, insert=merged)
        return answers[0], returned

    def written() -> tuple[int, int, int]:
        with store.connect() as conn:
            return (
                conn.execute(sa.select(workflows.c.history_len)
                             .where(workflows.c.id == wf.id)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(workflow_events)
                             .where(workflow_events.c.workflow_pk == wf.id)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(outbox)
                             .where(outbox.c.message_id == f"act:{wid}#1")).scalar_one())

    try:
        answer, returned = record(wf.fence_token + 1)  # a takeover moved the fence past it
        assert answer is None and returned == []
        assert written() == (wf.history_len, 0, 0)
        answer, returned = record(wf.fence_token)
        assert answer is not None and answer[1] is not None
        assert [r.message_id for r in returned] == [f"act:{wid}#1"]
        assert returned[0].state == "pending" and returned[0].payload["task"] == "wfdrv.double"
        assert written() == (wf.history_len + 1, 1, 1)
    finally:
        store.dispose()


@pytest.mark.parametrize("publisher_group", [None, "another-group"])
def test_the_completion_merged_with_its_wake_insert(
    pg_store: Store, publisher_group: str | None
) -> None:
    """The completion of a succeeded activity and its workflow's wake row as one statement
    (workflow_store._pg_completed_and_wake_statement), inside a hand-off: the wake is
    written only when the event was completed (a second completion writes none), handed off
    (due after HANDOFF_DELAY) to a publisher of the workflow's group, and due at once to the
    relays, not handed off, when the publisher is of another group."""
    store = Store.from_url(pg_store.url, role="worker")
    _app(store)
    wid = f"wfdrv-wake-{publisher_group}"
    published: list[OutboxMessage] = []

    def publish(messages: Sequence[OutboxMessage]) -> list[tuple[int, BaseException | None]]:
        published.extend(messages)
        return [(m.id, None) for m in messages]

    try:
        engine.start(store, "wfdrv.steps", wid, [1])
        with handoff.publishing(publish, None), handoff.deferred_marks(store):
            assert engine.advance(store, wid, owner="t", lease=LEASE) == "waiting"
        key = workflow_store.activity_key(wid, 1, 1)
        published.clear()

        def complete() -> bool:
            with handoff.publishing(publish, publisher_group), \
                    handoff.after_commit(store), store.begin() as conn:
                return workflow_store.on_run_finished(conn, key, "succeeded", 2)

        assert complete() is True
        with store.connect() as conn:
            wake_seq = conn.execute(sa.select(workflows.c.wake_seq)
                                    .where(workflows.c.workflow_id == wid)).scalar_one()
        assert complete() is False  # the event is completed already: no second wake
        with store.connect() as conn:
            wakes = conn.execute(
                sa.select(outbox.c.message_id, outbox.c.state, outbox.c.payload,
                          (outbox.c.available_at - outbox.c.created_at).label("delay"))
                .where(outbox.c.message_id.like(f"wake:{wid}:1#%"))).all()
        assert [w.message_id for w in wakes] == [f"wake:{wid}:1#1.{wake_seq}"]
        assert wakes[0].payload["args"] == [wid]
        if publisher_group is None:  # the workflow's group: handed off
            assert [m.message_id for m in published] == [wakes[0].message_id]
            assert wakes[0].state == "sent"
            assert abs(wakes[0].delay - handoff.HANDOFF_DELAY) < timedelta(seconds=1)
        else:  # another group's publisher: the relay's row, due at once
            assert published == [] and wakes[0].state == "pending"
            assert abs(wakes[0].delay) < timedelta(seconds=1)
    finally:
        store.dispose()
