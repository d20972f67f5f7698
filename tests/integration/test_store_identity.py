"""Mixed stores are detected: triggers carry their store's id; a worker on another store
refuses them (issue 11). Before, a trigger written to one store (a beat on the default
SQLite file) ran silently against whatever store the worker had.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from reliable_beat import runs as runs_mod
from reliable_beat import runtime
from reliable_beat import schedules as sch
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, entries, outbox, store_identity
from reliable_beat.entries import EntryDefinition
from reliable_beat.errors import ConfigurationError
from reliable_beat.identity import STORE_HEADER, store_id


def _entry(store: Store, name: str) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        d = EntryDefinition(name=name, task="ident.t", args=[],
                            schedule=sch.IntervalSchedule(timedelta(hours=1), now))
        values = d.row_values()
        values.update(next_fire_at=now + timedelta(hours=1), created_at=now, updated_at=now,
                      enabled=True, paused=False)
        conn.execute(entries.insert().values(**values))


def _app(store: Store) -> tuple[Celery, Any, list[str]]:
    app = Celery("ident", set_as_current=False)
    app.conf.update(broker_url="memory://", task_eager_propagates=True,
                    reliable_beat_database_url=store.engine.url.render_as_string(False))
    ran: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="ident.t")
    def t(self: IdempotentTask) -> str:
        ran.append(str(self.idempotency_key))
        return "ok"

    return app, t, ran


def test_each_store_has_its_own_id(sqlite_store: Store, pg_store: Store) -> None:
    a, b = store_id(sqlite_store), store_id(pg_store)
    assert a and b and a != b and len(a) == 32
    with sqlite_store.engine.connect() as conn:
        assert conn.execute(select(store_identity.c.store_id)).scalars().all() == [a]


def test_trigger_from_another_store_is_refused(sqlite_store: Store, pg_store: Store,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # The "beat" writes its trigger to the SQLite store; the worker's store is PostgreSQL.
    _entry(sqlite_store, "job")
    key = runtime.trigger(sqlite_store, "job")
    with sqlite_store.engine.connect() as conn:
        payload = conn.execute(select(outbox.c.payload)).scalar_one()
    headers = payload["headers"]
    assert headers[STORE_HEADER] == store_id(sqlite_store)

    _app1, task, ran = _app(pg_store)
    with pytest.raises(ConfigurationError, match="refused") as info:
        task.apply(headers=headers)
    assert "CRITICAL" in caplog.text and key in caplog.text
    assert store_id(sqlite_store) in str(info.value) and store_id(pg_store) in str(info.value)
    assert ran == []
    with pytest.raises(runs_mod.RunNotFound):  # no run in the wrong store
        runs_mod.get_run(pg_store, key)
    # ... but a `message` dead letter there, so `status --check` on that store alarms.
    with pg_store.engine.connect() as conn:
        dead = conn.execute(select(dead_letters.c.kind, dead_letters.c.key,
                                   dead_letters.c.error)).all()
    assert [(d.kind, d.key) for d in dead] == [("message", key)]
    assert "ForeignStoreError" in dead[0].error

    # The same trigger on a worker of the right store runs.
    _app2, task2, ran2 = _app(sqlite_store)
    assert task2.apply(headers=headers).get() == "ok"
    assert ran2 == [key]
