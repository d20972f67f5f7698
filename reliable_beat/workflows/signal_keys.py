"""Dedup keys of signals: a key is unique per workflow (``(workflow_pk, dedup_key)``).

:func:`reliable_beat.workflows.engine.signal` stores a keyed signal once per workflow: a
second send of the key to the same workflow is a no-op answered False, and two workflows may
use the same key. A re-send whose name or payload differs from the stored signal is not
stored either (the key names one signal), and a WARNING says so: the new payload would
otherwise vanish without a word. A store still on the schema before ``0016_signalkey`` (one
key per store) refuses a key another workflow holds with :class:`WorkflowConflict` naming
both workflows, instead of answering False for a signal that was never stored.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from reliable_beat.db.tables import MYSQL_DIALECTS, workflow_signals, workflows
from reliable_beat.redaction import get_logger, redact_value
from reliable_beat.workflows.errors import WorkflowConflict

__all__ = ["repeated", "stored_key"]

log = get_logger("reliable_beat.workflows")


def stored_key(conn: Connection, workflow_pk: int, workflow_id: str, name: str, payload: Any,
               key: str) -> bool:
    """The answer of ``signal`` whose insert of ``key`` the database ignored: False, after
    :func:`repeated` compared it with the stored signal.

    The stored row is read with a locking read on MySQL/MariaDB, which sees the row a
    concurrent sender committed while this transaction waited (a plain read of a
    REPEATABLE READ caller's snapshot would not); PostgreSQL's READ COMMITTED statement and
    SQLite's single writer see it anyway.

    Raises:
        WorkflowConflict: another workflow holds ``key`` (a schema before 0016_signalkey,
            where keys were unique per store); nothing was stored.
    """
    stmt = (select(workflow_signals.c.name, workflow_signals.c.payload)
            .where(workflow_signals.c.workflow_pk == workflow_pk,
                   workflow_signals.c.dedup_key == key)
            .limit(1))
    if conn.dialect.name in MYSQL_DIALECTS:
        stmt = stmt.with_for_update(read=True)
    row = conn.execute(stmt).first()
    if row is not None:
        return repeated(workflow_id, key, row, name, payload)
    owner = conn.execute(
        select(workflows.c.workflow_id)
        .join(workflow_signals, workflow_signals.c.workflow_pk == workflows.c.id)
        .where(workflow_signals.c.dedup_key == key)
        .limit(1)
    ).scalar()
    if owner is None:  # the holder went meanwhile (retention): nothing was stored
        raise WorkflowConflict(
            f"signal {name!r} to workflow {workflow_id!r} not stored: its dedup key {key!r} "
            "was held by a signal deleted meanwhile; send it again")
    raise WorkflowConflict(
        f"signal {name!r} to workflow {workflow_id!r} not stored: its dedup key {key!r} "
        f"belongs to a signal of workflow {owner!r}. This store's schema keeps one key per "
        "store (before 0016_signalkey); run `reliable-beat db upgrade`, after which a key "
        "deduplicates per workflow")


def repeated(workflow_id: str, key: str, stored: Any, name: str, payload: Any) -> bool:
    """False (a re-send of a stored key), with a WARNING when ``name`` or ``payload`` differ
    from the ``stored`` row (``.name``, ``.payload``): the new signal is not stored."""
    if (stored.name, stored.payload) != (name, payload):
        log.warning(
            "signal %r to workflow %r not stored: its dedup key %r was already used by "
            "signal %r with payload %s (this one's payload: %s); signal() returned False. "
            "A key names one signal of a workflow: give a new signal a new key",
            name, workflow_id, key, stored.name, _short(stored.payload), _short(payload))
    return False


def _short(value: Any, limit: int = 300) -> str:
    """``value`` redacted, as text of at most ``limit`` characters (a log line, not a dump)."""
    text = repr(redact_value(value))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
