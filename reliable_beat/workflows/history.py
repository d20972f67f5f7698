"""The run's history and the claimed row: what every room of the engine shares.

A position's digest and JSON form (:func:`args_digest`, :func:`to_json`), the workflow row an
advance claimed (:class:`Claimed`: its fence token is the advance's identity), the fence
check that opens every write of an advance (:func:`fence_check`), the history as replay reads
it (:func:`load_history`), and the small SQL helpers the start, signal and advance
transactions share.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from reliable_beat import values as rb_values
from reliable_beat.db.dialects import Store
from reliable_beat.db.driver import uses_psycopg
from reliable_beat.db.tables import workflow_events, workflows
from reliable_beat.outbox import db_now
from reliable_beat.workflows import pg_statements
from reliable_beat.workflows.errors import ActivityError, FencedOut

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_HISTORY_LIMIT",
    "MAX_WORKFLOW_ID",
    "TERMINAL_STATES",
    "Claimed",
    "args_digest",
    "canonical_json",
    "error_json",
    "fence_check",
    "first",
    "insert_one_ignored",
    "load_history",
    "outcome",
    "to_json",
    "transaction",
]

ACTIVE_STATES = ("pending", "running", "waiting")
TERMINAL_STATES = ("completed", "failed", "cancelled")
#: Events per run past which a frontier record blocks the workflow (``history_limit``).
DEFAULT_HISTORY_LIMIT = 2000
#: Longest workflow id (its activity keys and wake message ids must fit 400 characters).
MAX_WORKFLOW_ID = 300


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces (the digest's input)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def args_digest(kind: str, name: str | None, args: Any) -> str:
    """``sha256(canonical JSON of [kind, name, args])[:16]``: what a position must match."""
    return hashlib.sha256(canonical_json([kind, name, args]).encode()).hexdigest()[:16]


def to_json(value: Any, what: str) -> Any:
    """``value`` as the JSON stored in the history, encoded as Celery's JSON serializer
    (kombu) encodes it (:func:`reliable_beat.values.to_json_value`): plain JSON, and
    ``datetime`` / ``date`` / ``time`` / ``Decimal`` / ``UUID`` / ``bytes`` as kombu's
    ``{"__type__", "__value__"}`` objects, which :func:`reliable_beat.values.from_json_value`
    turns back into the Python values the workflow code gets (the same on every replay).

    Raises:
        TypeError: a value neither JSON nor kombu carries (or a NaN, infinity or ``\\x00``);
            the message names the path to it (``workflow 'x' args[1]['when']``) and the fix.
    """
    try:
        return rb_values.to_json_value(value, what)
    except ValueError as exc:
        raise TypeError(f"{exc} (workflow data is stored as JSON)") from exc


def error_json(exc: BaseException) -> dict[str, str]:
    """``{"type", "message", "traceback"}`` of an exception (stored, never pickled)."""
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
    }


def insert_one_ignored(conn: Connection, stmt: Any, table: Any) -> bool:
    """Run an insert-ignore of one row; True if it was stored, False if the unique key
    already existed.

    PostgreSQL / SQLite / MariaDB 10.5+: ``RETURNING`` the primary key (psycopg reports no
    useful rowcount for ``INSERT ... ON CONFLICT DO NOTHING`` with an implicit RETURNING).
    MySQL 8 has no ``RETURNING``: the ``INSERT IGNORE``'s rowcount (0 for a duplicate).
    """
    if conn.dialect.insert_returning:
        (pk,) = table.primary_key.columns
        return conn.execute(stmt.returning(pk)).first() is not None
    return int(conn.execute(stmt).rowcount) == 1


@contextmanager
def transaction(target: Store | Connection) -> Iterator[Connection]:
    """Join the caller's transaction (a Connection) or run one on the store."""
    if isinstance(target, Connection):
        if not target.in_transaction():
            with target.begin():
                yield target
            return
        yield target
        return
    with target.begin() as conn:
        yield conn


def first(rows: list[Any]) -> Any:
    return rows[0] if rows else None



@dataclass
class Claimed:
    """The workflow row an advance claimed (its fence token is the advance's identity)."""

    pk: int
    workflow_id: str
    name: str
    run_no: int
    args: list[Any]
    kwargs: dict[str, Any]
    queue: str | None
    random_seed: int
    fence_token: int
    seen_wake_seq: int
    history_len: int
    history_bytes: int
    owner: str
    lease: timedelta
    extra: dict[str, Any] = field(default_factory=dict)
    version: str | None = None  # recorded at start / continue-as-new
    #: The history read in the claim transaction (the first run of the code uses it).
    history: dict[int, Any] | None = None
    #: The workflow's identity in this process's sticky history cache
    #: (:mod:`reliable_beat.workflows.sticky`); None: not cached.
    cache_key: tuple[Any, ...] | None = None



def load_history(conn: Connection, pk: int, run_no: int) -> dict[int, Any]:
    """The run's events by seq (only the columns replay needs)."""
    if uses_psycopg(conn):  # the same select, on the driver connection
        return {r.seq: r for r in pg_statements.load_history(conn, pk, run_no)}
    rows = conn.execute(
        select(
            workflow_events.c.seq, workflow_events.c.kind, workflow_events.c.name,
            workflow_events.c.args_digest, workflow_events.c.state, workflow_events.c.result,
            workflow_events.c.error, workflow_events.c.fire_at, workflow_events.c.run_key,
        )
        .where(workflow_events.c.workflow_pk == pk, workflow_events.c.run_no == run_no)
        .order_by(workflow_events.c.seq)
    ).all()
    return {r.seq: r for r in rows}


def fence_check(
    conn: Connection, claimed: Claimed, *, events: int = 0, size: int = 0
) -> datetime:
    """First statement of every write of an advance: ``UPDATE ... WHERE fence = mine``.

    Returns:
        The store's clock read for it (UTC-aware), for the rest of the transaction.

    Raises:
        FencedOut: a newer advance claimed the workflow (the caller's transaction must roll
            back: nothing of this advance is written).
    """
    if uses_psycopg(conn):  # the same statement, on the driver connection
        now = pg_statements.fence_check(conn, claimed.pk, claimed.fence_token,
                                        claimed.lease, events, size)
        if now is None:
            raise FencedOut(
                f"workflow {claimed.workflow_id!r}: fence {claimed.fence_token} is stale")
        return now
    stmt = (update(workflows)
            .where(workflows.c.id == claimed.pk,
                   workflows.c.fence_token == claimed.fence_token)
            .values(history_len=workflows.c.history_len + events,
                    history_bytes=workflows.c.history_bytes + size))
    if conn.dialect.name == "postgresql":  # the clock inside the statement: one round trip
        clock = func.clock_timestamp()
        row = conn.execute(stmt.values(lease_expires_at=clock + claimed.lease,
                                       updated_at=clock)
                           .returning(workflows.c.updated_at)).first()
        if row is None:
            raise FencedOut(
                f"workflow {claimed.workflow_id!r}: fence {claimed.fence_token} is stale")
        return row.updated_at  # type: ignore[no-any-return]
    now = db_now(conn)
    done = conn.execute(stmt.values(lease_expires_at=now + claimed.lease,
                                    updated_at=now)).rowcount
    if done != 1:
        raise FencedOut(f"workflow {claimed.workflow_id!r}: fence {claimed.fence_token} is stale")
    return now



def outcome(ev_state: str, result: Any, error: Any, kind: str, name: str) -> Any:
    """The answer of a recorded position: its result, or :class:`ActivityError` (``kind``,
    ``name``, the recorded error's ``type`` and ``message``) when it ``failed``."""
    if ev_state == "failed":
        err = error or {}
        raise ActivityError(str(err.get("type")), str(err.get("message")), kind=kind,
                            name=name)
    return rb_values.from_json_value(result)
