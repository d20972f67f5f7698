"""Operator actions on one entry: fire it now, backfill a window, describe its guarantees.

The operations live in :mod:`reliable_beat.ops` (:mod:`reliable_beat.ops.actions`: trigger,
backfill; :mod:`reliable_beat.ops.describe`: the five questions); this module keeps the
names importable from here.
"""

from __future__ import annotations

from reliable_beat.ops.actions import (
    BackfillLimitError,
    BackfillResult,
    app_publishes,
    backfill,
    manual_key,
    trigger,
)
from reliable_beat.ops.describe import answer_questions, describe, task_kind

__all__ = [
    "BackfillLimitError",
    "BackfillResult",
    "answer_questions",
    "app_publishes",
    "backfill",
    "describe",
    "manual_key",
    "task_kind",
    "trigger",
]
