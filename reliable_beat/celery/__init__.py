"""The Celery adapter: scheduler, task base class and CLI sub-command.

``beat_scheduler = "reliable_beat.celery:ReliableScheduler"`` (or
``"reliable_beat.ReliableScheduler"``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["IdempotentTask", "ReliableScheduler"]


def __getattr__(name: str) -> Any:
    if name == "ReliableScheduler":
        from reliable_beat.celery.scheduler import ReliableScheduler

        return ReliableScheduler
    if name == "IdempotentTask":
        from reliable_beat.celery.task import IdempotentTask

        return IdempotentTask
    raise AttributeError(name)
