"""The Dramatiq beat's start-up (``reliable-beat dramatiq beat``): a database lost between
the start-up wait and the entries sync (a PostgreSQL restart at that moment: seen twice in
the 30-minute Dramatiq fault run as a beat exiting ``rc 1``) is waited for again and said on
stderr, not an exit. A real SQLite store; the sync raises what the store raises when the
server goes away, once."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError, StoreUnavailableError

pytest.importorskip("dramatiq")
import reliable_beat.cli  # noqa: F401  (the CLI group imports cli_dramatiq itself)


def test_a_database_lost_during_the_entries_sync_is_waited_for(
        sqlite_store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from reliable_beat.cli_dramatiq import start_entries  # after the CLI (import order)

    calls: list[int] = []

    def sync() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise StoreUnavailableError(f"database {sqlite_store.safe_url} is unavailable: "
                                        "terminating connection due to administrator command")
        return {"inserted": 1}

    out = start_entries(sqlite_store, threading.Event(), sync, max_delay=0.05)
    assert out == {"inserted": 1} and len(calls) == 2
    assert "lost while syncing the entries" in capsys.readouterr().err


def test_bad_entries_still_fail_the_start(sqlite_store: Store) -> None:
    from reliable_beat.cli_dramatiq import start_entries  # after the CLI (import order)

    def sync() -> Any:
        raise ConfigurationError("bad Dramatiq periodic entries: x: bad cron")

    with pytest.raises(ConfigurationError, match="bad cron"):
        start_entries(sqlite_store, threading.Event(), sync, max_delay=0.05)


def test_stop_while_waiting_returns_none(sqlite_store: Store) -> None:
    from reliable_beat.cli_dramatiq import start_entries  # after the CLI (import order)

    stop = threading.Event()

    def sync() -> Any:
        stop.set()
        raise StoreUnavailableError("gone")

    assert start_entries(sqlite_store, stop, sync, max_delay=0.05) is None
