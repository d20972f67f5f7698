"""Backlog or loss on a Dramatiq app: the re-dispatch sweep asks the Dramatiq broker how deep
the triggers' queue is before re-sending (real PostgreSQL; a real Redis ``RedisBroker``, or
RabbitMQ's ``RabbitmqBroker`` with ``--broker rabbitmq``).

30 triggers queued behind a stopped worker (none consumes the queue) look exactly like 30 lost
ones (``dispatched``, unclaimed). While the queue holds them, nothing is re-sent (main had no
Dramatiq probe and re-sent all 30 into the backlog); once the broker lost them (the queue
flushed), the next sweep re-sends them. ``status`` shows the queue's depth next to STALLED.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from contextlib import suppress
from datetime import timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import insert, select, update

from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redispatch import redispatch_stuck_runs
from reliable_beat.settings import Settings

dramatiq = pytest.importorskip("dramatiq")

N = 30
LINE = "runs look stuck but queue"


@pytest.fixture
def queue() -> str:
    return f"rb-dq-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def broker(broker_url: str, pg_store: Store, queue: str) -> Iterator[Any]:
    """A Dramatiq broker with the ReliableBeat middleware on the test's Redis database (a
    namespace of its own) or the session's RabbitMQ node, and one idempotent actor on
    ``queue``. No worker runs: whatever is enqueued waits in the queue."""
    from reliable_beat.dramatiq import IdempotentActor, ReliableBeat, rabbitmq_url

    if broker_url.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        b: Any = RabbitmqBroker(url=rabbitmq_url(broker_url), confirm_delivery=True)
    else:
        from dramatiq.brokers.redis import RedisBroker

        b = RedisBroker(url=broker_url, namespace=f"rbtest-{uuid.uuid4().hex[:8]}")
    b.add_middleware(ReliableBeat(settings={
        "database_url": pg_store.engine.url.render_as_string(hide_password=False),
        "redispatch_seconds": 1}))

    def tick(i: int = 0) -> int:
        return i

    dramatiq.actor(tick, actor_name="dq_backlog_tick", queue_name=queue, broker=b,
                   actor_class=IdempotentActor)
    yield b
    with suppress(Exception):
        b.flush(queue)
    with suppress(Exception):
        b.close()


def _ready(broker: Any, queue: str) -> int:
    from reliable_beat.dramatiq.backlog import queue_depths

    [(name, depth)] = queue_depths(broker, [OutboxMessage(
        id=0, message_id="m", destination="dramatiq", payload={"task": "dq_backlog_tick"})])
    assert name == queue and depth is not None
    return depth


def _fire(store: Store, broker: Any, queue: str) -> None:
    """N entries fire once; their triggers are enqueued on ``queue`` (no worker)."""
    from reliable_beat.dramatiq.adapter import ADAPTER

    with store.begin() as conn:
        now = store.now(conn)
        for i in range(N):
            conn.execute(insert(entries).values(
                name=f"dq{i:02d}", task="dq_backlog_tick", args=[], kwargs={}, options={},
                schedule_kind="interval",
                schedule={"kind": "interval", "every_seconds": 3600, "timezone": "UTC",
                          "anchor": "2026-01-01T00:00:00Z"},
                timezone="UTC", next_fire_at=now - timedelta(seconds=5), created_at=now,
                updated_at=now))
    result = Beat(store, owner="t", trigger_destination="dramatiq").tick()
    assert len(result.triggers) == N
    assert ADAPTER.publish_triggers(store, broker, result.triggers, result.now) == N
    assert _ready(broker, queue) == N


def _age(store: Store, seconds: float) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(runs).values(dispatched_at=now - timedelta(seconds=seconds)))


def _redispatches(store: Store) -> int:
    with store.connect() as conn:
        return sum(conn.execute(select(runs.c.redispatches)).scalars())


def test_a_backlog_behind_a_stopped_worker_is_not_resent_and_a_loss_is(
    broker: Any, pg_store: Store, queue: str, caplog: pytest.LogCaptureFixture,
) -> None:
    from reliable_beat.adapters import app_settings

    _fire(pg_store, broker, queue)
    settings = app_settings(broker)
    assert isinstance(settings, Settings) and settings.redispatch_seconds == 1
    _age(pg_store, 5)  # stuck for 5 redispatch periods: well within the cap (16 s)
    with caplog.at_level(logging.INFO, logger="reliable_beat.redispatch"):
        assert redispatch_stuck_runs(pg_store, broker, settings) == 0  # main: 30
    lines = [r.getMessage() for r in caplog.records if LINE in r.getMessage()]
    assert lines == [f"{N} runs look stuck but queue {queue} holds {N} ready messages: "
                     "a backlog, not a loss; not re-sending"]
    assert _ready(broker, queue) == N  # no duplicate added to the backlog
    assert _redispatches(pg_store) == 0
    # the broker loses them: the next sweep sees an empty queue and re-sends every one
    broker.flush(queue)
    assert _ready(broker, queue) == 0
    assert redispatch_stuck_runs(pg_store, broker, settings) == N
    assert _ready(broker, queue) == N
    assert _redispatches(pg_store) == N


def test_the_dramatiq_beat_loop_holds_a_backlog(broker: Any, pg_store: Store,
                                                 queue: str) -> None:
    """The Dramatiq beat's own sweep (its publisher's probe) holds the backlog too."""
    from reliable_beat.dramatiq import beat_loop

    _fire(pg_store, broker, queue)
    _age(pg_store, 5)
    loop = beat_loop(broker, pg_store)
    try:
        assert loop.redispatch() == 0  # main: 30
        broker.flush(queue)
        assert loop.redispatch() == N
    finally:
        loop.close()


def test_the_dramatiq_relay_commands_sweep_holds_a_backlog(broker: Any, pg_store: Store,
                                                           queue: str) -> None:
    """``reliable-beat dramatiq relay``'s own re-dispatch sweep asks the broker too (main:
    it re-sent all 30 into the backlog)."""
    from reliable_beat.adapters import app_settings
    from reliable_beat.dramatiq.cli import relay_redispatch

    _fire(pg_store, broker, queue)
    _age(pg_store, 5)
    sweep = relay_redispatch(pg_store, app_settings(broker), broker)
    assert sweep() == 0
    assert _ready(broker, queue) == N
    broker.flush(queue)
    assert sweep() == N


def test_queue_depths_names_each_queue_and_a_missing_one_is_empty(broker: Any,
                                                                   queue: str) -> None:
    from reliable_beat.dramatiq.backlog import queue_depths

    broker.enqueue(dramatiq.Message(queue_name=queue, actor_name="dq_backlog_tick", args=(),
                                    kwargs={}, options={}))
    mine = OutboxMessage(id=1, message_id="a", destination="dramatiq",
                         payload={"task": "dq_backlog_tick"})
    other = OutboxMessage(id=2, message_id="b", destination="dramatiq",
                          payload={"task": "dq_backlog_tick",
                                   "options": {"queue_name": queue + "-none"}})
    app_msg = OutboxMessage(id=3, message_id="c", destination="dramatiq",
                            payload={"actor": "dq_backlog_tick", "queue": queue})
    assert queue_depths(broker, [mine, other, app_msg]) == [
        (queue, 1), (queue + "-none", 0), (queue, 1)]


def test_status_shows_the_depth_of_a_stalled_entrys_queue(broker: Any, pg_store: Store,
                                                          queue: str,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """An entry that ran before and whose newest trigger no worker started (STALLED): status
    says how many messages wait in its queue (a backlog: workers behind or stopped), in
    the text and under ``queue_depths`` in ``--json``."""
    import sys

    from reliable_beat.cli import reliable_beat as rb_cli

    _fire(pg_store, broker, queue)
    with pg_store.begin() as conn:  # dq00 ran an earlier slot (its workers know the task)
        now = pg_store.now(conn)
        conn.execute(update(runs).values(dispatched_at=now - timedelta(seconds=300)))
        conn.execute(insert(runs).values(
            idempotency_key="dq00@earlier", entry_name="dq00", task="dq_backlog_tick",
            fire_at=now - timedelta(hours=1), state="succeeded",
            dispatched_at=now - timedelta(hours=1), started_at=now - timedelta(hours=1),
            created_at=now, updated_at=now))
    module = type(sys)("rb_dq_backlog_app")
    module.broker = broker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rb_dq_backlog_app", module)
    args = ["--database-url", pg_store.url, "-A", "rb_dq_backlog_app:broker", "status"]
    r = CliRunner().invoke(rb_cli, args, catch_exceptions=False)
    stalled = next(ln for ln in r.output.splitlines() if "STALLED:" in ln)
    assert f"Queue {queue} holds {N} ready messages (a backlog" in stalled, stalled
    depth_line = next(ln for ln in r.output.splitlines() if ln.startswith("queues:"))
    assert f"{queue}: {N} ready" in depth_line, depth_line
    info = json.loads(CliRunner().invoke(rb_cli, [*args, "--json"],
                                         catch_exceptions=False).output)
    # the others never started (NEVER STARTED): their triggers wait in the same queue
    never = next(ln for ln in r.output.splitlines() if "NEVER STARTED:" in ln)
    assert f"Queue {queue} holds {N} ready messages" in never, never
    assert info["queue_depths"] == [{"queue": queue, "ready": N, "error": None,
                                     "entries": [f"dq{i:02d}" for i in range(N)]}]
    assert any(f"Queue {queue} holds {N} ready" in p for p in info["problems"])
    # the broker lost them: an empty queue is not a backlog
    broker.flush(queue)
    r = CliRunner().invoke(rb_cli, args, catch_exceptions=False)
    stalled = next(ln for ln in r.output.splitlines() if "STALLED:" in ln)
    assert f"Queue {queue} holds 0 ready messages (not a backlog" in stalled, stalled
    # without -A there is no probe: no depth line, no key content
    r = CliRunner().invoke(rb_cli, ["--database-url", pg_store.url, "status", "--json"],
                           catch_exceptions=False)
    assert json.loads(r.output)["queue_depths"] == []
