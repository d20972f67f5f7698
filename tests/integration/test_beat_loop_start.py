"""The core beat loop's start-up (both adapters' beats): a database lost between the start-up
wait and the entries sync (a PostgreSQL restart at that moment: seen twice in the 30-minute
Dramatiq fault run as a beat exiting ``rc 1``) is waited for again and logged, not an exit.
A real SQLite store; the sync raises what the store raises when the server goes away, once.
Fails on the old start: the sync sat after the retry loop, so the error ended the start."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from reliable_beat import loop as core
from reliable_beat.db.dialects import Store
from reliable_beat.entries import EntryDefinition
from reliable_beat.errors import ConfigurationError, StoreUnavailableError
from reliable_beat.loop import BeatLoop
from reliable_beat.schedules import IntervalSchedule
from reliable_beat.settings import Settings
from tests.apps.quiet_handler import QuietHandler as _Quiet


def _definitions(now: datetime) -> list[EntryDefinition]:
    return [EntryDefinition(name="tick", task="t",
                            schedule=IntervalSchedule(timedelta(seconds=60), now))]


def _loop(store: Store, definitions: Any = _definitions) -> BeatLoop:
    loop = BeatLoop(store, Settings(), _Quiet(), owner="t:1", definitions=definitions)
    loop.stop_event = threading.Event()
    return loop


def test_a_database_lost_during_the_entries_sync_is_waited_for(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    real = core.sync_schedule_group
    calls: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise StoreUnavailableError(f"database {sqlite_store.safe_url} is unavailable: "
                                        "terminating connection due to administrator command")
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "sync_schedule_group", flaky)
    monkeypatch.setattr(BeatLoop, "_sleep", lambda self, s: None)
    loop = _loop(sqlite_store)
    assert loop.start() is True
    assert len(calls) == 2
    assert "at start" in caplog.text and "administrator command" in caplog.text
    from reliable_beat.entries import list_entries

    assert [e["name"] for e in list_entries(sqlite_store)] == ["tick"]


def test_bad_entries_still_fail_the_start(
        sqlite_store: Store, caplog: pytest.LogCaptureFixture) -> None:
    def bad(now: datetime) -> list[EntryDefinition]:
        raise ConfigurationError("bad periodic entries: x: bad cron")

    with pytest.raises(SystemExit) as exited:
        _loop(sqlite_store, bad).start()
    assert exited.value.code == 2 and "bad cron" in caplog.text


def test_stop_while_waiting_returns_false(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _loop(sqlite_store)

    def gone(*args: Any, **kwargs: Any) -> Any:
        assert loop.stop_event is not None
        loop.stop_event.set()
        raise StoreUnavailableError("gone")

    monkeypatch.setattr(core, "sync_schedule_group", gone)
    assert loop.start() is False


def test_waiting_behind_another_beats_sync_is_a_warning_not_an_error(
        pg_store: Store, pg_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A second beat that starts while the first syncs a large beat_schedule waits on the
    sync lock; its lock_timeout ends each wait. That is waiting, not a database failure: a
    WARNING saying so (a fresh user saw five ERRORs "database error at start: lock wait
    timed out" while the first beat synced 20,000 entries). Real PostgreSQL, the lock held by
    another connection as a sync holds it."""
    from sqlalchemy import text

    from reliable_beat.entries import _lock_for_sync

    monkeypatch.setattr(BeatLoop, "_sleep", lambda self, s: None)
    sep = "&" if "?" in pg_url else "?"
    beat_store = Store.from_url(f"{pg_url}{sep}options=-c%20lock_timeout%3D300", role="beat")
    holder = pg_store.engine.connect()
    tx = holder.begin()
    _lock_for_sync(holder, pg_store)  # another beat's sync in progress
    try:
        done: list[bool] = []
        loop = _loop(beat_store)
        starter = threading.Thread(target=lambda: done.append(loop.start()), daemon=True)
        caplog.set_level("WARNING")
        starter.start()
        deadline = time.monotonic() + 30
        while "waiting at start" not in caplog.text and time.monotonic() < deadline:
            starter.join(0.1)
        assert "waiting at start" in caplog.text, caplog.text
        assert "sync in progress" in caplog.text
    finally:
        tx.rollback()  # the other sync ends
        holder.close()
    starter.join(30)
    assert done == [True]
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [], [r.getMessage() for r in errors]
    with beat_store.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM reliable_beat_entries")).scalar_one() == 1
    beat_store.dispose()
