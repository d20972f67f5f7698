"""Runs and dead letters read for display (the CLI, the dashboard, the Django admin).

Rows are decoded value by value (:func:`reliable_beat.rows.display_rows`): a malformed
value shows as such instead of failing the listing.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select

from reliable_beat import rows as rows_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, runs
from reliable_beat.errors import DeadLetterNotFound, RunNotFound

__all__ = [
    "get_dead_letter",
    "get_run",
    "list_attempts",
    "list_dead_letters",
    "list_runs",
]


def list_runs(
    store: Store,
    *,
    entry: str | None = None,
    state: str | None = None,
    since: datetime | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Runs, newest first (by ``created_at``), as dicts of the row's columns.

    Args:
        entry / state: exact filters.
        since: only runs created at or after this UTC instant (tz-aware).
        limit: most rows returned.
    """
    stmt = select(runs).order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit)
    if entry is not None:
        stmt = stmt.where(runs.c.entry_name == entry)
    if state is not None:
        stmt = stmt.where(runs.c.state == state)
    if since is not None:
        stmt = stmt.where(runs.c.created_at >= since)
    with store.engine.connect() as conn:
        return rows_mod.display_rows(conn, stmt, runs)


def get_run(store: Store, key: str) -> dict[str, Any]:
    """The run with ``key`` as a dict. Raises :class:`RunNotFound`."""
    with store.engine.connect() as conn:
        rows = rows_mod.display_rows(conn, select(runs).where(runs.c.idempotency_key == key), runs)
    if not rows:
        raise RunNotFound(f"no run with key {key!r}")
    return rows[0]


def list_attempts(store: Store, run_id: int) -> list[dict[str, Any]]:
    """Attempt rows of a run, oldest first, as dicts."""
    with store.engine.connect() as conn:
        return rows_mod.display_rows(
            conn, select(attempts).where(attempts.c.run_id == run_id).order_by(attempts.c.id),
            attempts)


def list_dead_letters(
    store: Store, *, include_requeued: bool = True, limit: int = 100,
    handled: bool | None = None,
) -> list[dict[str, Any]]:
    """Dead letters, newest first, as dicts.

    ``handled``: True only those the application handled by design (``handled_at`` set: a
    saga's step whose compensations completed; they raise no alarm), False only the others
    (what ``status --check`` counts), None both."""
    stmt = select(dead_letters).order_by(dead_letters.c.id.desc()).limit(limit)
    if not include_requeued:
        stmt = stmt.where(dead_letters.c.requeued_at.is_(None))
    if handled is not None:
        stmt = stmt.where(dead_letters.c.handled_at.is_not(None) if handled
                          else dead_letters.c.handled_at.is_(None))
    with store.engine.connect() as conn:
        return rows_mod.display_rows(conn, stmt, dead_letters)


def get_dead_letter(store: Store, dead_letter_id: int) -> dict[str, Any]:
    """One dead letter as a dict. Raises :class:`DeadLetterNotFound`."""
    with store.engine.connect() as conn:
        rows = rows_mod.display_rows(
            conn, select(dead_letters).where(dead_letters.c.id == dead_letter_id), dead_letters)
    if not rows:
        raise DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
    return rows[0]
