"""4. Task overhead: an ``IdempotentTask`` against a plain task doing the same insert.

Pending until ``reliable_beat/celery/task.py`` lands on main.
"""

from __future__ import annotations

from benchmarks.common import Env


def run(env: Env) -> str:
    try:
        from reliable_beat.celery.task import IdempotentTask  # noqa: F401
    except ImportError:
        return ("### 4. Task overhead\n\npending: `reliable_beat/celery/task.py` "
                "(`IdempotentTask`) has not landed on main yet.")
    return "### 4. Task overhead\n\npending: not written yet."
