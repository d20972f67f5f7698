"""A beat asked to stop takes no new slot: once a SIGTERM / SIGINT is held back inside a
round (or the Dramatiq stop flag is set), no further claim starts, so the stop waits only
for the triggers the beat already holds (docs/operations.md, "Stopping a beat").

A real SQLite store; the SIGTERM is sent by another process (``kill``) while a second thread
is alive, as in a beat process (its retention thread). Fails on the old loop: the round went
on claiming full batches after the stop was asked (3 claims of one entry each, not 1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from types import FrameType
from typing import Any

import pytest
from sqlalchemy import func, select, update

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.loop import BeatLoop
from reliable_beat.schedules import IntervalSchedule
from reliable_beat.settings import Settings
from tests.apps.quiet_handler import QuietHandler as _Quiet


def _three(now: datetime) -> list[EntryDefinition]:
    """Three hourly entries (made due by :func:`_loop`)."""
    return [EntryDefinition(name=f"e{i}", task="t",
                            schedule=IntervalSchedule(timedelta(hours=1), now))
            for i in range(3)]


def _loop(store: Store) -> BeatLoop:
    # one entry per claim: a round claims again at once while entries are left (up to 10)
    settings = Settings(database_url=store.url, batch_size=1, purge_interval_seconds=0)
    loop = BeatLoop(store, settings, _Quiet(), owner="t:1", definitions=_three)
    loop.stop_event = threading.Event()
    assert loop.start() is True
    with store.begin() as conn:  # each entry's grid slot of an hour ago is due now
        for name, at in list(conn.execute(select(entries.c.name, entries.c.next_fire_at))):
            conn.execute(update(entries).where(entries.c.name == name)
                         .values(next_fire_at=at - timedelta(hours=1)))
    return loop


def _runs(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(runs)).scalar_one())


@pytest.fixture
def other_thread() -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def test_a_sigterm_held_back_in_a_round_stops_further_claims(
        sqlite_store: Store, other_thread: None) -> None:
    loop = _loop(sqlite_store)
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    claim = loop.beat.tick
    claims: list[int] = []

    def claim_then_sigterm() -> Any:
        result = claim()
        claims.append(result.claimed)
        if len(claims) == 1:  # the supervisor's SIGTERM lands right after the first claim
            subprocess.run(["kill", "-TERM", str(os.getpid())], check=True)
            until = time.monotonic() + 0.2
            while time.monotonic() < until:
                pass
        return result

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        loop.beat.tick = claim_then_sigterm  # type: ignore[method-assign]
        loop.step()
    finally:
        signal.signal(signal.SIGTERM, previous)
        loop.close()
    assert got == [signal.SIGTERM]  # delivered, after the round
    assert claims == [1], f"claims after the stop was asked: {claims}"
    assert _runs(sqlite_store) == 1


def test_the_stop_flag_stops_claims_and_a_running_loop_claims_all(sqlite_store: Store) -> None:
    loop = _loop(sqlite_store)
    try:
        assert loop.stop_event is not None
        loop.stop_event.set()
        loop.step()
        assert _runs(sqlite_store) == 0  # the Dramatiq beat's flag: nothing new is claimed
        loop.stop_event.clear()
        loop.step()
        assert _runs(sqlite_store) == 3  # the control: the same round claims all three
    finally:
        loop.close()
