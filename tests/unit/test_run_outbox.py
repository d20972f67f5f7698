"""The one outbox of a running body (``reliable_beat.execution.RunOutbox``), which the Celery
task's ``self.outbox`` and the Dramatiq actor's ``current().outbox`` both are.

Real SQLite store; the run is claimed as a worker claims it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from reliable_beat import execution, runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.settings import Settings

LEASE = timedelta(seconds=30)


def _state(store: Store, key: str = "pay@1") -> execution.RunState:
    claim = runs.claim_run(store, key, owner="t:1", lease=LEASE, task="t", args=[], kwargs={})
    return execution.RunState(claim=claim, store=store, lease=LEASE, task_name="t")


def test_adds_are_keyed_by_the_run_and_stamped_with_it(sqlite_store: Store) -> None:
    state = _state(sqlite_store)
    settings = Settings(database_url="sqlite://")
    box = execution.RunOutbox(lambda: state, lambda: settings)
    with sqlite_store.begin() as tx:
        ids = [box.add(tx, "webhook", {"destination": "shop", "body": {"n": 1}}),
               box.add(tx, "webhook", {"destination": "shop", "body": {"n": 2}}, key="mine"),
               box.add(tx, "webhook", {"destination": "shop", "body": {"n": 3}}, delay=30)]
    # an explicit key counts as an add: the default keys stay those of the same adds' order
    assert ids == ["pay@1#1", "mine", "pay@1#3"]
    with sqlite_store.engine.connect() as conn:
        rows = {r.message_id: r for r in conn.execute(select(outbox))}
    assert {r.run_id for r in rows.values()} == {state.claim.run_id}
    delayed = rows["pay@1#3"]
    assert delayed.available_at - delayed.created_at == timedelta(seconds=30)
    assert rows["pay@1#1"].available_at == rows["pay@1#1"].created_at


def test_a_retried_attempt_produces_the_same_message_ids(sqlite_store: Store) -> None:
    settings = Settings(database_url="sqlite://")
    first = _state(sqlite_store)
    again = execution.RunState(claim=first.claim, store=sqlite_store, lease=LEASE)
    seen = []
    for state in (first, again):
        box = execution.RunOutbox(lambda s=state: s, lambda: settings)
        with sqlite_store.begin() as tx:
            seen.append([box.add(tx, "webhook", {"destination": "shop", "body": {}})
                         for _ in range(2)])
    assert seen == [["pay@1#1", "pay@1#2"]] * 2
    with sqlite_store.engine.connect() as conn:
        assert len(conn.execute(select(outbox.c.id)).all()) == 2


def test_the_settings_limits_apply(sqlite_store: Store) -> None:
    state = _state(sqlite_store)
    small = Settings(database_url="sqlite://", max_payload_bytes=1024)
    box = execution.RunOutbox(lambda: state, lambda: small)
    with sqlite_store.begin() as tx, pytest.raises(ValueError, match="1024"):
        box.add(tx, "webhook", {"destination": "shop", "body": {"blob": "x" * 4096}})


def test_the_celery_task_outbox_is_the_run_outbox() -> None:
    celery = pytest.importorskip("celery")
    from reliable_beat.celery.task import IdempotentTask

    app = celery.Celery("run_outbox", set_as_current=False)
    app.conf.reliable_beat_database_url = "sqlite://"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="case.pay")
    def pay(self: IdempotentTask) -> None:
        pass

    assert isinstance(pay.outbox, execution.RunOutbox)
    # outside an execution the task has no run: said at the add, as before
    with pytest.raises(RuntimeError, match="not inside an IdempotentTask execution"):
        pay.outbox.add(None, "webhook", {})  # type: ignore[arg-type]


def test_the_dramatiq_run_context_outbox_is_the_run_outbox(sqlite_store: Store) -> None:
    pytest.importorskip("dramatiq")
    from reliable_beat.dramatiq import RunContext

    state = _state(sqlite_store)
    ctx = RunContext(state=state, settings=Settings(database_url="sqlite://"))
    assert isinstance(ctx.outbox, execution.RunOutbox)
    assert ctx.outbox is ctx.outbox
    with sqlite_store.begin() as tx:
        assert ctx.outbox.add(tx, "webhook", {"destination": "shop", "body": {}}) == "pay@1#1"
