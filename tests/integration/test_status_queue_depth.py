"""``status -A APP`` says how deep the queues of STALLED / NEVER STARTED entries are, through
the app's broker probe (the re-dispatch sweep's backlog check): a Celery app on a real Redis
(or RabbitMQ with ``--broker rabbitmq``) and real PostgreSQL. Main had no depth: an operator
could not tell workers behind (a backlog) from messages gone. A broker that cannot be asked
is said, and ``status`` goes on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import suppress
from datetime import timedelta

import pytest
from celery import Celery
from click.testing import CliRunner, Result
from sqlalchemy import insert, update

from reliable_beat.beat import Beat
from reliable_beat.celery.scheduler import publish_triggers
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.cli import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs

N = 12


def _app(name: str, broker_url: str, queue: str, store: Store) -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url=broker_url, task_default_queue=queue,
        broker_connection_retry=False, broker_connection_max_retries=0,
        reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="depth.tick")
    def tick(self: IdempotentTask) -> None:
        return None

    return app


@pytest.fixture
def app(broker_url: str, test_queue: str, pg_store: Store,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    app = _app("depthapp", broker_url, test_queue, pg_store)
    module = type(sys)("rb_depth_app")
    module.app = app  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rb_depth_app", module)
    yield app
    with app.connection_for_write() as conn, suppress(Exception):
        conn.channel().queue_delete(test_queue)  # the RabbitMQ node is shared by the session


def _stall(store: Store, app: Celery) -> None:
    """N entries fire and their triggers wait in the queue (no worker); ``d00`` ran an
    earlier slot (STALLED), the others never did (NEVER STARTED)."""
    with store.begin() as conn:
        now = store.now(conn)
        for i in range(N):
            conn.execute(insert(entries).values(
                name=f"d{i:02d}", task="depth.tick", args=[], kwargs={}, options={},
                schedule_kind="interval",
                schedule={"kind": "interval", "every_seconds": 3600, "timezone": "UTC",
                          "anchor": "2026-01-01T00:00:00Z"},
                timezone="UTC", next_fire_at=now - timedelta(seconds=5), created_at=now,
                updated_at=now))
    result = Beat(store, owner="t").tick()
    assert publish_triggers(store, app, result.triggers, result.now) == N
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(runs).values(dispatched_at=now - timedelta(seconds=600)))
        conn.execute(insert(runs).values(
            idempotency_key="d00@earlier", entry_name="d00", task="depth.tick",
            fire_at=now - timedelta(hours=1), state="succeeded",
            dispatched_at=now - timedelta(hours=1), started_at=now - timedelta(hours=1),
            created_at=now, updated_at=now))


def _status(store: Store, spec: str, *extra: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, "-A", spec,
                                              "status", *extra], catch_exceptions=False)


def test_status_says_how_many_messages_wait_in_a_stalled_entrys_queue(
        app: Celery, pg_store: Store, test_queue: str) -> None:
    _stall(pg_store, app)
    r = _status(pg_store, "rb_depth_app:app")
    stalled = next(ln for ln in r.output.splitlines() if "STALLED:" in ln)
    assert stalled.endswith(f"Queue {test_queue} holds {N} ready messages (a backlog: its "
                            "workers are behind or stopped)."), stalled
    never = next(ln for ln in r.output.splitlines() if "NEVER STARTED:" in ln)
    assert f"Queue {test_queue} holds {N} ready messages" in never, never
    assert f"queues: {test_queue}: {N} ready (waiting triggers of d00, d01, d02, d03, d04, " \
        "..." in r.output, r.output
    info = json.loads(_status(pg_store, "rb_depth_app:app", "--json").output)
    [d] = info["queue_depths"]
    assert (d["queue"], d["ready"], d["error"], len(d["entries"])) == (test_queue, N, None, N)


def test_a_broker_that_cannot_be_asked_is_said_and_status_goes_on(
        pg_store: Store, test_queue: str, monkeypatch: pytest.MonkeyPatch,
        broker_url: str) -> None:
    live = _app("depthlive", broker_url, test_queue, pg_store)
    _stall(pg_store, live)
    dead = _app("depthdead", "redis://127.0.0.1:1/0", test_queue, pg_store)
    module = type(sys)("rb_depth_dead")
    module.app = dead  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rb_depth_dead", module)
    r = _status(pg_store, "rb_depth_dead:app", "--check")
    assert r.exit_code == 1, r.output  # the alarms are still raised
    stalled = next(ln for ln in r.output.splitlines() if "STALLED:" in ln)
    assert "The broker could not tell its queue depths (" in stalled, stalled
    assert "queues: depth unknown (" in r.output, r.output
    info = json.loads(_status(pg_store, "rb_depth_dead:app", "--json").output)
    [d] = info["queue_depths"]
    assert d["queue"] is None and d["ready"] is None and d["error"]
    with live.connection_for_write() as conn, suppress(Exception):
        conn.channel().queue_delete(test_queue)
