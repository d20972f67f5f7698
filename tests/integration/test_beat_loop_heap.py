"""The core beat loop freezes its process's heap after its first claim (the cyclic garbage
collector stops walking the objects a beat keeps for its whole life) and thaws it at
``close()`` (a process that goes on after its loop sees every object again). A real SQLite
store, an entry due every second, the loop ticked until it claimed."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta

from reliable_beat.db.dialects import Store
from reliable_beat.entries import EntryDefinition
from reliable_beat.loop import BeatLoop
from reliable_beat.outbox import OutboxMessage
from reliable_beat.schedules import IntervalSchedule
from reliable_beat.settings import Settings


class _Sink:
    destination = "celery"

    def __init__(self) -> None:
        self.sent: list[OutboxMessage] = []

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        self.sent.extend(messages)
        return [(m.id, None) for m in messages]

    def tracked_tasks(self) -> Collection[str]:
        return []


def test_heap_frozen_after_the_first_claim_and_thawed_at_close(sqlite_store: Store) -> None:
    def definitions(now: datetime) -> list[EntryDefinition]:
        return [EntryDefinition(name="every-second", task="t",
                                schedule=IntervalSchedule(timedelta(seconds=1), now))]

    sink = _Sink()
    loop = BeatLoop(sqlite_store, Settings(), sink, owner="t:1", definitions=definitions)
    loop.stop_event = threading.Event()
    assert loop.start() is True
    try:
        deadline = time.monotonic() + 10
        while not sink.sent and time.monotonic() < deadline:
            loop.tick()
        assert sink.sent, "no slot fired in 10 s"
        assert gc.get_freeze_count() > 0
    finally:
        loop.close()
    assert gc.get_freeze_count() == 0
