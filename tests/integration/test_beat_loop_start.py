"""The core beat loop's start-up (both adapters' beats): a database lost between the start-up
wait and the entries sync (a PostgreSQL restart at that moment: seen twice in the 30-minute
Dramatiq fault run as a beat exiting ``rc 1``) is waited for again and logged, not an exit.
A real SQLite store; the sync raises what the store raises when the server goes away, once.
Fails on the old start: the sync sat after the retry loop, so the error ended the start."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest

from reliable_beat import loop as core
from reliable_beat.db.dialects import Store
from reliable_beat.entries import EntryDefinition
from reliable_beat.errors import ConfigurationError, StoreUnavailableError
from reliable_beat.loop import BeatLoop
from reliable_beat.outbox import OutboxMessage
from reliable_beat.schedules import IntervalSchedule
from reliable_beat.settings import Settings


class _Quiet:
    destination = "celery"

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        return [(m.id, None) for m in messages]

    def tracked_tasks(self) -> Collection[str]:
        return []


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
