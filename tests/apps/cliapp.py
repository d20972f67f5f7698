"""A small Celery app for CLI tests: one plain task and, when available, one IdempotentTask.

Broker: in-memory (``memory://``), so ``entries trigger`` publishes without a server.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

app = Celery("cliapp", broker="memory://")
app.conf.timezone = "UTC"
app.conf.reliable_beat_backfill_limit = 50


@app.task(name="cliapp.plain")
def plain(*args: Any, **kwargs: Any) -> None:
    """A plain Celery task (effects at-least-once)."""


try:
    from reliable_beat.celery.task import IdempotentTask
except ImportError:  # the task module is not in this build
    IdempotentTask = None

HAS_IDEMPOTENT = IdempotentTask is not None

if IdempotentTask is not None:

    @app.task(name="cliapp.idem", base=IdempotentTask, bind=True)
    def idem(self: Any, *args: Any, **kwargs: Any) -> None:
        """An IdempotentTask."""
