"""A trigger handler that accepts every message and publishes nothing: for tests that run a
:class:`~reliable_beat.loop.BeatLoop` in process and look only at the store."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime

from reliable_beat.outbox import OutboxMessage


class QuietHandler:
    destination = "celery"

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        return [(m.id, None) for m in messages]

    def tracked_tasks(self) -> Collection[str]:
        return []
