"""Backlog or loss: before re-sending, the re-dispatch sweep asks the broker how deep the
triggers' queue is (real PostgreSQL; real Redis, or RabbitMQ with ``--broker rabbitmq``).

50 triggers queued behind a stopped worker look exactly like 50 lost ones (``dispatched``,
unclaimed). While the queue holds them, nothing is re-sent (main re-sent all 50, growing the
backlog); once they are gone from the broker (Redis ``FLUSHDB``, a RabbitMQ purge), the next
sweep re-sends them; and a run older than the backoff cap is re-sent even into a deep queue.
The workflow sweep does the same for activity messages.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, insert, select, update

from reliable_beat.beat import Beat
from reliable_beat.celery.backlog import queue_depths
from reliable_beat.celery.publishing import publish_celery_batch
from reliable_beat.celery.scheduler import CeleryPublisher, publish_triggers
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs, workflow_events
from reliable_beat.loop import BeatLoop
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redispatch import BACKOFF_CAP, redispatch_stuck_runs
from reliable_beat.relay import Relay, mark_sent
from reliable_beat.settings import Settings
from reliable_beat.workflows import WorkflowContext, engine, workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver

N = 50
LINE = "runs look stuck but queue"


@pytest.fixture
def app(broker_url: str, test_queue: str, pg_store: Store) -> Iterator[Celery]:
    app = Celery("backlog", set_as_current=False)
    app.conf.update(
        broker_url=broker_url, task_default_queue=test_queue,
        reliable_beat_database_url=pg_store.engine.url.render_as_string(hide_password=False),
        reliable_beat_redispatch_seconds=1,
    )

    @app.task(shared=False, base=IdempotentTask, bind=True, name="backlog.tick")
    def tick(self: IdempotentTask, i: int = 0) -> int:
        return i

    yield app
    with app.connection_for_write() as conn, suppress(Exception):
        conn.channel().queue_delete(test_queue)  # the RabbitMQ node is shared by the session


def _queued(app: Celery, queue: str) -> int:
    with app.connection_for_write() as conn:
        channel = conn.channel()
        try:
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
        except Exception:
            return 0  # no such queue (Redis drops an empty list)


def _lose_everything(app: Celery, queue: str, broker_url: str) -> None:
    """The broker loses every queued message: FLUSHDB on Redis, a purge on RabbitMQ."""
    if broker_url.startswith("redis"):
        import redis

        client = redis.Redis.from_url(broker_url)
        client.flushdb()
        client.close()
    else:
        with app.connection_for_write() as conn:
            conn.channel().queue_purge(queue)


def _fire(store: Store, app: Celery, queue: str) -> None:
    """N entries fire once; their triggers are published into ``queue`` (no worker)."""
    with store.begin() as conn:
        now = store.now(conn)
        for i in range(N):
            conn.execute(insert(entries).values(
                name=f"e{i:02d}", task="backlog.tick", args=[], kwargs={}, options={},
                schedule_kind="interval",
                schedule={"kind": "interval", "every_seconds": 3600, "timezone": "UTC",
                          "anchor": "2026-01-01T00:00:00Z"},
                timezone="UTC", next_fire_at=now - timedelta(seconds=5), created_at=now,
                updated_at=now))
    result = Beat(store, owner="t").tick()
    assert len(result.triggers) == N
    assert publish_triggers(store, app, result.triggers, result.now) == N
    assert _queued(app, queue) == N


def _age(store: Store, seconds: float) -> None:
    """The runs were dispatched ``seconds`` ago (store clock)."""
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(runs).values(dispatched_at=now - timedelta(seconds=seconds)))


def _redispatches(store: Store) -> int:
    with store.connect() as conn:
        return sum(conn.execute(select(runs.c.redispatches)).scalars())


def test_a_backlog_is_not_resent_and_a_loss_is(app: Celery, pg_store: Store, test_queue: str,
                                               broker_url: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    _fire(pg_store, app, test_queue)
    settings = Settings.from_celery(app)
    _age(pg_store, 5)  # stuck for 5 redispatch periods: well within the cap (16 s)
    with caplog.at_level(logging.INFO, logger="reliable_beat.redispatch"):
        assert redispatch_stuck_runs(pg_store, app, settings) == 0
    lines = [r.getMessage() for r in caplog.records if LINE in r.getMessage()]
    assert lines == [f"{N} runs look stuck but queue {test_queue} holds {N} ready messages: "
                     "a backlog, not a loss; not re-sending"]
    assert [r.levelname for r in caplog.records if LINE in r.getMessage()] == ["INFO"]
    assert _queued(app, test_queue) == N  # no duplicate added to the backlog
    assert _redispatches(pg_store) == 0
    # the broker loses them: the next sweep sees an empty queue and re-sends every one
    _lose_everything(app, test_queue, broker_url)
    assert _queued(app, test_queue) == 0
    assert redispatch_stuck_runs(pg_store, app, settings) == N
    assert _queued(app, test_queue) == N
    assert _redispatches(pg_store) == N


def test_a_run_past_the_backoff_cap_is_resent_into_a_deep_queue(
    app: Celery, pg_store: Store, test_queue: str
) -> None:
    """The queue still holds N messages, but the runs waited longer than
    ``redispatch_seconds * 2**BACKOFF_CAP``: re-sent (a message lost in a busy queue is
    not held back for ever)."""
    _fire(pg_store, app, test_queue)
    settings = Settings.from_celery(app)
    _age(pg_store, settings.redispatch_seconds * 2**BACKOFF_CAP + 5)
    assert redispatch_stuck_runs(pg_store, app, settings) == N
    assert _queued(app, test_queue) == 2 * N


def test_the_check_can_be_switched_off(app: Celery, pg_store: Store, test_queue: str) -> None:
    _fire(pg_store, app, test_queue)
    app.conf.reliable_beat_redispatch_backlog_check = False
    settings = Settings.from_celery(app)
    assert settings.redispatch_backlog_check is False
    _age(pg_store, 5)
    assert redispatch_stuck_runs(pg_store, app, settings) == N


def test_queue_depths_reads_the_broker(app: Celery, pg_store: Store, test_queue: str) -> None:
    """The Celery probe: the routed queue and its ready messages, a missing queue 0."""
    _fire(pg_store, app, test_queue)
    msg = OutboxMessage(id=1, message_id="m", destination="celery",
                        payload={"task": "backlog.tick"})
    other = OutboxMessage(id=2, message_id="n", destination="celery",
                          payload={"task": "backlog.tick",
                                   "options": {"queue": test_queue + "-none"}})
    assert queue_depths(app, [msg, other, msg]) == [
        (test_queue, N), (test_queue + "-none", 0), (test_queue, N)]


@workflow(name="backlog.fan")
def _fan(ctx: WorkflowContext, n: int) -> Any:
    return ctx.wait_all(*[ctx.start_activity("backlog.tick", i) for i in range(n)])


def test_the_workflow_sweep_holds_a_backlog_and_resends_a_loss(
    app: Celery, pg_store: Store, test_queue: str, broker_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The workflow sweep applies the same check to activity messages: 50 activities queued
    behind a stopped worker are not re-sent (main: all 50, once per window); lost by the
    broker, they are."""
    engine.start(pg_store, "backlog.fan", "fan", [N])
    assert Driver(pg_store, app).step()  # the advance: 50 activity events and messages
    with pg_store.begin() as conn:
        rows = conn.execute(select(outbox).where(outbox.c.message_id.like("act:%"))
                            .order_by(outbox.c.id)).all()
        assert len(rows) == N
        outcomes = publish_celery_batch(app, [OutboxMessage.from_row(r) for r in rows])
        assert [err for _, err in outcomes] == [None] * N
        mark_sent(conn, [r.id for r in rows], pg_store.now(conn))
        # stuck for 5 s with a 1 s window: well within the cap (16 s)
        conn.execute(update(workflow_events).values(
            created_at=pg_store.now(conn) - timedelta(seconds=5)))
    assert _queued(app, test_queue) == N

    def sweep() -> int:
        return engine.redispatch_workflows(
            pg_store, older_than=timedelta(seconds=1),
            queue_depths=lambda messages: queue_depths(app, messages))

    with caplog.at_level(logging.INFO, logger="reliable_beat.redispatch"):
        assert sweep() == 0
    assert [r.getMessage() for r in caplog.records if LINE in r.getMessage()] == [
        f"{N} runs look stuck but queue {test_queue} holds {N} ready messages: "
        "a backlog, not a loss; not re-sending"]
    assert _queued(app, test_queue) == N
    _lose_everything(app, test_queue, broker_url)
    assert sweep() == N
    with pg_store.connect() as conn:
        resent = conn.execute(select(func.count()).where(
            outbox.c.message_id.like("act:%:r%"))).scalar_one()
        counted = conn.execute(select(func.sum(workflow_events.c.redispatches))).scalar_one()
    assert resent == counted == N


def test_the_beat_loop_and_the_relay_ask_the_broker(app: Celery, pg_store: Store,
                                                     test_queue: str) -> None:
    """The wiring: a beat's sweep (:class:`~reliable_beat.loop.BeatLoop` with the Celery
    publisher) and a relay with the app both hold a backlog back (main: both re-sent)."""
    _fire(pg_store, app, test_queue)
    settings = Settings.from_celery(app)
    _age(pg_store, 5)
    loop = BeatLoop(store=pg_store, settings=settings, publisher=CeleryPublisher(app),
                    owner="t:1")
    assert loop.redispatch() == 0
    relay = Relay(pg_store, app, settings=settings, owner="r:1")
    relay.maybe_redispatch()
    assert _redispatches(pg_store) == 0
    assert _queued(app, test_queue) == N
