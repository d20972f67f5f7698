"""Tasks of ``cliproj``: imported only when the app loads its ``include`` modules."""

from __future__ import annotations

from typing import Any

from cliproj import app
from reliable_beat.celery.task import IdempotentTask


@app.task(name="cliproj.tasks.record", base=IdempotentTask, bind=True)
def record(self: Any, *args: Any) -> None:
    """An IdempotentTask the CLI must know about."""


@app.task(name="cliproj.tasks.plain")
def plain(*args: Any) -> None:
    """A plain task."""
