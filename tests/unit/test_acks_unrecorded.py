"""A plain task's trigger start the worker could not record (database down at that moment)
is written when the database answers again, so ``status`` does not report the trigger as
unstarted (fails on the old worker hook: the start was logged and forgotten)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import execution
from reliable_beat.celery import acks
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import runs


class _Flaky:
    """The real store, but ``begin()`` fails with a driver error while ``down``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.down = False

    def begin(self) -> Any:
        if self.down:
            raise sa.exc.OperationalError("connect", {}, Exception("connection refused"))
        return self.store.begin()

    def now(self, conn: sa.Connection) -> Any:
        return self.store.now(conn)


@pytest.fixture
def flaky(sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Flaky]:
    f = _Flaky(sqlite_store)
    monkeypatch.setattr(execution, "_store_for", lambda url: f)
    monkeypatch.setattr(acks, "_unrecorded", {}, raising=False)
    with sqlite_store.begin() as conn:
        now = sqlite_store.now(conn)
        conn.execute(runs.insert(), [{
            "idempotency_key": f"plain@{i}", "entry_name": "plain",
            "fire_at": now - timedelta(minutes=i),
            "trigger": "schedule", "task": "t.plain", "args": [], "kwargs": {},
            "state": "dispatched", "created_at": now, "updated_at": now, "dispatched_at": now,
        } for i in range(3)])
    yield f


def _task(store: Store, key: str) -> Any:
    app = Celery("acks", broker="memory://", set_as_current=False)
    app.conf.reliable_beat_database_url = store.engine.url.render_as_string(
        hide_password=False)
    return SimpleNamespace(name="t.plain", app=app,
                           request=SimpleNamespace(headers={"reliable_beat_key": key},
                                                   is_eager=False))


def _started(store: Store) -> dict[str, bool]:
    with store.connect() as conn:
        return {k: at is not None for k, at in conn.execute(
            sa.select(runs.c.idempotency_key, runs.c.started_at).order_by(runs.c.id))}


def test_a_start_missed_by_a_database_outage_is_written_at_the_next_start(
    flaky: _Flaky, caplog: pytest.LogCaptureFixture,
) -> None:
    store = flaky.store
    flaky.down = True
    acks.record_start(task=_task(store, "plain@0"))
    assert "could not record the start" in caplog.text
    assert _started(store) == {"plain@0": False, "plain@1": False, "plain@2": False}
    flaky.down = False
    acks.record_start(task=_task(store, "plain@1"))  # the database answers again
    assert _started(store) == {"plain@0": True, "plain@1": True, "plain@2": False}
    with store.connect() as conn:  # the time the worker saw it start, not the write's
        at = dict(conn.execute(sa.select(runs.c.idempotency_key, runs.c.started_at)).all())
    assert at["plain@0"] <= at["plain@1"] + timedelta(seconds=30)
    assert acks._unrecorded == {}


def test_a_missed_start_is_written_at_the_end_of_its_task(
    flaky: _Flaky, caplog: pytest.LogCaptureFixture,
) -> None:
    store = flaky.store
    flaky.down = True
    acks.record_start(task=_task(store, "plain@0"))
    assert "written when the database answers again" in caplog.text
    assert acks.record_unrecorded_starts() == 0  # still down: kept
    assert _started(store)["plain@0"] is False
    flaky.down = False
    assert acks.record_unrecorded_starts() == 1  # task_postrun: it answers again
    assert _started(store) == {"plain@0": True, "plain@1": False, "plain@2": False}


def test_unrecorded_starts_are_bounded(flaky: _Flaky, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(acks, "UNRECORDED_MAX", 1)
    flaky.down = True
    acks.record_start(task=_task(flaky.store, "plain@0"))
    acks.record_start(task=_task(flaky.store, "plain@1"))
    assert list(acks._unrecorded) == ["plain@0"]
    assert "not kept (too many unwritten starts)" in caplog.text
