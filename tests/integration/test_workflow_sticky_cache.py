"""The sticky history cache (reliable_beat.workflows.sticky), on PostgreSQL + psycopg.

A worker that completes a workflow's activity advances the workflow in process (the
hand-off); that advance takes the history from the process's cache plus the event the
completion returned, with no read, when nothing else touched the workflow since the
process's previous advance of it. Here a workflow runs as one worker runs it (every
activity message applied in process, every wake answered in process) and, between two
steps, something makes the cache stale:

* ``fence``: another advance claimed the workflow (its fence token moved);
* ``signal``: a signal arrived (``wake_seq`` moved once more);
* ``other``: another process advanced the workflow (a spurious wake answered elsewhere).

Each time an event the cache holds is also rewritten by SQL, as no writer of the library
does (the history is append-only): only a whole read sees it. So the stale cases must end
with the rewritten value (they read the whole history), and the control case (nothing
stale) shows that the cache alone would not have: it keeps the value it read. Without the
fallback, the stale cases would end as the control does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import handoff
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, workflow_events, workflows
from reliable_beat.messages import OutboxMessage
from reliable_beat.workflows import WorkflowContext, engine, signal, sticky

LEASE = timedelta(seconds=30)


def _app(store: Store) -> Celery:
    app = Celery("wfsticky", set_as_current=False)
    app.conf.update(broker_url="memory://",
                    reliable_beat_database_url=store.engine.url.render_as_string(
                        hide_password=False))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="wfsticky.double")
    def double(self: IdempotentTask, x: int) -> int:
        return x * 2

    def three(ctx: WorkflowContext) -> list[int]:
        # the arguments never depend on the results: a rewritten result replays
        return [ctx.activity(double, 1), ctx.activity(double, 2), ctx.activity(double, 3)]

    engine.register(engine.WorkflowDefinition(name="wfsticky.three", fn=three))
    return app


def _run(store: Store, app: Celery, wid: str,
         before: Callable[[int], None] = lambda i: None) -> Any:
    """Start ``wid`` and drive it as one worker does; ``before(i)`` runs before the i-th
    activity message is taken. Returns the workflow's result."""
    broker: list[OutboxMessage] = []

    def publish(messages: Sequence[OutboxMessage]) -> list[tuple[int, BaseException | None]]:
        broker.extend(messages)
        return [(m.id, None) for m in messages]

    def advance(st: Store, wake: handoff.Wake) -> str:
        return engine.advance(st, wake.workflow_id, owner="me", lease=LEASE)

    engine.start(store, "wfsticky.three", wid, [])
    with store.begin() as conn:  # its start message: delivered here, by hand
        conn.execute(sa.update(outbox).where(outbox.c.message_id == f"wake:{wid}:start")
                     .values(state="sent"))
    with handoff.publishing(publish, None, advance), handoff.deferred_marks(store):
        first = engine.advance(store, wid, owner="me", lease=LEASE)
    assert first == "waiting", engine.get_workflow(store, wid)["error"]
    i = 0
    while broker:
        message = broker.pop(0)
        if message.payload["task"] != "wfsticky.double":
            continue  # a wake the test's own advance published: answered already
        before(i)
        with handoff.publishing(publish, None, advance):
            app.tasks["wfsticky.double"].apply(
                tuple(message.payload["args"]), dict(message.payload["kwargs"]),
                headers=message.payload["headers"])
        i += 1
    return engine.get_workflow(store, wid)


def _history(store: Store, wid: str) -> list[tuple[Any, ...]]:
    with store.connect() as conn:
        pk = conn.execute(sa.select(workflows.c.id)
                          .where(workflows.c.workflow_id == wid)).scalar_one()
        return [tuple(r) for r in conn.execute(
            sa.select(workflow_events.c.seq, workflow_events.c.kind, workflow_events.c.name,
                      workflow_events.c.args_digest, workflow_events.c.state,
                      workflow_events.c.result, workflow_events.c.run_key,
                      workflow_events.c.fence_token)
            .where(workflow_events.c.workflow_pk == pk).order_by(workflow_events.c.seq))]


@pytest.fixture
def worker_store(pg_store: Store) -> Any:
    store = Store.from_url(pg_store.url, role="worker")
    sticky.clear()
    yield store
    sticky.clear()
    store.dispose()


def test_a_step_answered_in_process_reads_no_history_and_writes_the_same(
    worker_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each in-process advance after the first finds its history in the cache (no read);
    the history, the workflow's result and row are those of a run without the cache."""
    app = _app(worker_store)
    before = sticky.stats()
    cached = _run(worker_store, app, "st-cached")
    after = sticky.stats()
    # the first activity's advance has the start advance's entry; so do the next two
    assert after["unread"] - before["unread"] == 3, (before, after)
    assert after["misses"] == before["misses"]
    monkeypatch.setattr(sticky, "MAX_WORKFLOWS", 0)  # nothing kept: every advance reads
    uncached = _run(worker_store, app, "st-uncached")
    assert sticky.stats()["unread"] == after["unread"]
    assert cached["state"] == uncached["state"] == "completed"
    assert cached["result"] == uncached["result"] == [2, 4, 6]
    keep = ("history_len", "fence_token", "wake_seq", "claimed_wake_seq", "advances")
    assert {k: cached[k] for k in keep} == {k: uncached[k] for k in keep}
    norm = [tuple(str(v).replace("st-cached", "W") for v in e)
            for e in _history(worker_store, "st-cached")]
    assert norm == [tuple(str(v).replace("st-uncached", "W") for v in e)
                    for e in _history(worker_store, "st-uncached")]


@pytest.mark.parametrize("stale", ["fence", "signal", "other", None])
def test_a_stale_cache_entry_falls_back_to_the_whole_history(
    worker_store: Store, stale: str | None
) -> None:
    app = _app(worker_store)
    wid = f"st-{stale}"

    def before(i: int) -> None:
        if i != 1:  # the first activity completed and its advance cached the history
            return
        with worker_store.begin() as conn:  # what only a whole read sees (see the docstring)
            pk = conn.execute(sa.select(workflows.c.id)
                              .where(workflows.c.workflow_id == wid)).scalar_one()
            conn.execute(sa.update(workflow_events)
                         .where(workflow_events.c.workflow_pk == pk,
                                workflow_events.c.seq == 1)
                         .values(result=100))
            if stale == "fence":  # as another advance's claim does
                conn.execute(sa.update(workflows).where(workflows.c.id == pk)
                             .values(fence_token=workflows.c.fence_token + 1))
        if stale == "signal":
            signal(worker_store, wid, "unread", {"x": 1})
        if stale == "other":  # a spurious wake, advanced by another process
            with worker_store.begin() as conn:
                conn.execute(sa.update(workflows).where(workflows.c.workflow_id == wid)
                             .values(wake_seq=workflows.c.wake_seq + 1))
            # that process has a cache of its own: this one's stays as it was
            mine, keys = sticky._entries.copy(), dict(sticky._keys)
            assert engine.advance(worker_store, wid, owner="other", lease=LEASE) == "waiting"
            sticky.clear()
            sticky._entries.update(mine)
            sticky._keys.update(keys)

    misses = sticky.stats()["misses"]
    row = _run(worker_store, app, wid, before)
    assert row["state"] == "completed", row
    if stale is None:  # the cache held seq 1 as it was read: the rewrite is not seen
        assert row["result"] == [2, 4, 6]
        assert sticky.stats()["misses"] == misses
        return
    assert row["result"] == [100, 4, 6], row  # the whole history was read
    assert sticky.stats()["misses"] == misses + 1


def test_a_malformed_row_claimed_in_autocommit_is_blocked_under_its_fence(
    worker_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The advance whose history the cache holds claims in one autocommit statement; a
    workflow row changed by SQL meanwhile (``args`` of the wrong shape) is still parked
    ``blocked`` naming the column, by a fenced update after that claim."""
    advance_mod = importlib.import_module("reliable_beat.workflows.advance")
    app = _app(worker_store)
    wid = "st-malformed"
    alone: list[Any] = []
    claim_alone = advance_mod._claim_alone

    def spy(*args: Any, **kwargs: Any) -> Any:
        got = claim_alone(*args, **kwargs)
        alone.append(got if isinstance(got, str) or got is None else "claimed")
        return got

    monkeypatch.setattr(advance_mod, "_claim_alone", spy)

    def before(i: int) -> None:
        if i == 1:
            with worker_store.begin() as conn:
                conn.execute(sa.update(workflows).where(workflows.c.workflow_id == wid)
                             .values(args={"x": 1}))

    row = _run(worker_store, app, wid, before)
    assert alone == ["claimed", "blocked"], alone  # step 1 from the cache; step 2 parked
    assert row["state"] == "blocked", row
    assert row["block_reason"].startswith("malformed row: "), row["block_reason"]
    assert "reliable_beat_workflows.args" in row["block_reason"]
    assert row["leased_by"] is None and row["lease_expires_at"] is None
