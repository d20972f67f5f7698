"""The workflow rows that lower layers read: what the beat's overlap policy asks of them.

The workflow engine (:mod:`reliable_beat.workflows`) writes these rows; modules below it (the
beat, the run store) read them here, so they never import the engine.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.engine import Connection

from reliable_beat.db.tables import workflows

__all__ = ["OVERLAP_STATES", "active_entries"]

#: Workflow states in which an entry's previous slot counts as still running (overlap).
OVERLAP_STATES = ("pending", "running", "waiting", "blocked")


def active_entries(conn: Connection, names: Iterable[str]) -> set[str]:
    """The entries among ``names`` with a workflow still pending, running, waiting or
    blocked (the beat's overlap policy reads it beside the runs' states)."""
    wanted = list(names)
    if not wanted:
        return set()
    return {str(n) for n in conn.execute(
        select(workflows.c.entry_name).distinct().where(
            workflows.c.entry_name.in_(wanted), workflows.c.state.in_(OVERLAP_STATES))
    ).scalars()}
