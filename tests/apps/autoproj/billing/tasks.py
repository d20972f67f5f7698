"""Found by ``app.autodiscover_tasks(["autoproj.billing"])``."""

from __future__ import annotations

from typing import Any

from autoproj import app


@app.task(name="autoproj.billing.tasks.invoice")
def invoice(*args: Any) -> None:
    """A plain task."""
