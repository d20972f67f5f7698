"""An advance's hot statements on PostgreSQL, fixed SQL run on the driver connection.

Each is the statement the portable path runs, written once as SQL and run
through :class:`reliable_beat.db.driver.DriverStatement` (psycopg: no per-call statement
building, compilation lookup or result objects). Same rows, same locks, same order of
locks, same transaction as the portable path; the callers use them only when
:func:`~reliable_beat.db.driver.uses_psycopg` says the connection is psycopg's.
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Interval,
    Select,
    String,
    bindparam,
    case,
    cast,
    func,
    literal_column,
    null,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from reliable_beat.db.driver import DriverStatement
from reliable_beat.db.tables import outbox, workflow_events, workflows

__all__ = ["EVENT_COLUMNS", "fence_check", "fence_check_and_insert_event",
           "fence_check_event_and_outbox", "history_since", "insert_event", "load_history",
           "release", "release_and_mark"]


def _p(name: str, column: Any) -> Any:
    # p_ names: a parameter named like a column would become a SET (see runs/complete.py)
    return bindparam(f"p_{name}", type_=column.type)


@cache
def _release_statement() -> Select[Any]:
    """The release of an advance::

        WITH rel AS (UPDATE workflows SET state = 'waiting', leased_by = NULL,
                            lease_expires_at = NULL, updated_at = clock_timestamp()
                     WHERE id = :pk AND fence_token = :mine AND wake_seq = :seen
                     RETURNING id)
        SELECT count(*) AS released FROM rel
    """
    rel = (
        update(workflows)
        .where(workflows.c.id == _p("pk", workflows.c.id),
               workflows.c.fence_token == _p("fence", workflows.c.fence_token),
               workflows.c.wake_seq == _p("seen", workflows.c.wake_seq))
        .values(state=literal_column("'waiting'"), leased_by=null(), lease_expires_at=null(),
                updated_at=func.clock_timestamp())
        .returning(workflows.c.id)
        .cte("rel")
    )
    return select(func.count().label("released")).select_from(rel)


_RELEASE = DriverStatement(_release_statement)


def release(conn: Connection, pk: int, fence_token: int, seen_wake_seq: int) -> bool:
    """Release the workflow (``waiting``, no lease) if it is still ours and nothing woke it
    since ``seen_wake_seq``. True when released."""
    row = _RELEASE.first(conn, {"p_pk": pk, "p_fence": fence_token, "p_seen": seen_wake_seq})
    return bool(row.released == 1)


@cache
def _release_and_mark_statement() -> Select[Any]:
    """The release and the marks of the messages the advance published, one statement::

        WITH rel AS (UPDATE workflows SET state = 'waiting', ... (as _release_statement)
                     RETURNING id),
        mk AS (UPDATE outbox SET state = 'sent', sent_at = clock_timestamp(),
                      last_error = NULL
               WHERE id = ANY(:ids) AND state = 'pending'
                 AND (SELECT count(*) FROM rel) >= 0
               RETURNING id)
        SELECT (SELECT count(*) FROM rel) AS released, (SELECT count(*) FROM mk) AS marked

    ``mk``'s condition on ``rel`` is an init plan, run first: the workflow row is updated
    (locked) before the outbox rows, the order of the two statements it replaces.
    """
    rel = (
        update(workflows)
        .where(workflows.c.id == _p("pk", workflows.c.id),
               workflows.c.fence_token == _p("fence", workflows.c.fence_token),
               workflows.c.wake_seq == _p("seen", workflows.c.wake_seq))
        .values(state=literal_column("'waiting'"), leased_by=null(), lease_expires_at=null(),
                updated_at=func.clock_timestamp())
        .returning(workflows.c.id)
        .cte("rel")
    )
    released = select(func.count()).select_from(rel).scalar_subquery()
    ids = cast(bindparam("p_ids", type_=ARRAY(BigInteger())), ARRAY(BigInteger()))
    mk = (
        update(outbox)
        .where(outbox.c.id == func.any(ids), outbox.c.state == literal_column("'pending'"),
               released >= 0)
        .values(state=literal_column("'sent'"), sent_at=func.clock_timestamp(),
                last_error=null())
        .returning(outbox.c.id)
        .cte("mk")
    )
    return select(released.label("released"),
                  select(func.count()).select_from(mk).scalar_subquery().label("marked"))


_RELEASE_AND_MARK = DriverStatement(_release_and_mark_statement)


def release_and_mark(conn: Connection, pk: int, fence_token: int, seen_wake_seq: int,
                     ids: list[int]) -> bool:
    """:func:`release` and, in the same statement, mark the outbox rows ``ids`` ``sent``
    (those still pending: what :func:`reliable_beat.handoff.mark_in` writes). True when
    released."""
    row = _RELEASE_AND_MARK.first(conn, {"p_pk": pk, "p_fence": fence_token,
                                         "p_seen": seen_wake_seq, "p_ids": list(ids)})
    return bool(row.released == 1)


@cache
def _fence_check_statement() -> Select[Any]:
    """:func:`reliable_beat.workflows.history.fence_check` on PostgreSQL::

        WITH f AS (UPDATE workflows SET history_len = history_len + :events,
                          history_bytes = history_bytes + :size,
                          lease_expires_at = clock_timestamp() + :lease,
                          updated_at = clock_timestamp()
                   WHERE id = :pk AND fence_token = :mine RETURNING updated_at)
        SELECT updated_at FROM f
    """
    f = (
        update(workflows)
        .where(workflows.c.id == _p("pk", workflows.c.id),
               workflows.c.fence_token == _p("fence", workflows.c.fence_token))
        .values(history_len=workflows.c.history_len + _p("events", workflows.c.history_len),
                history_bytes=workflows.c.history_bytes
                + _p("size", workflows.c.history_bytes),
                lease_expires_at=func.clock_timestamp()
                + bindparam("p_lease", type_=Interval()),
                updated_at=func.clock_timestamp())
        .returning(workflows.c.updated_at)
        .cte("f")
    )
    return select(f.c.updated_at)


_FENCE_CHECK = DriverStatement(_fence_check_statement)


def fence_check(conn: Connection, pk: int, fence_token: int, lease: Any, events: int,
                size: int) -> datetime | None:
    """The fence check (and history counters, lease renewal); the clock it wrote, or None
    when the fence moved."""
    row = _FENCE_CHECK.first(conn, {"p_pk": pk, "p_fence": fence_token, "p_lease": lease,
                                    "p_events": events, "p_size": size})
    return None if row is None else row.updated_at  # type: ignore[no-any-return]


@cache
def _history_statement() -> Select[Any]:
    """:func:`reliable_beat.workflows.history.load_history`'s select."""
    return (
        select(
            workflow_events.c.seq, workflow_events.c.kind, workflow_events.c.name,
            workflow_events.c.args_digest, workflow_events.c.state, workflow_events.c.result,
            workflow_events.c.error, workflow_events.c.fire_at, workflow_events.c.run_key,
        )
        .where(workflow_events.c.workflow_pk == _p("pk", workflow_events.c.workflow_pk),
               workflow_events.c.run_no == _p("run_no", workflow_events.c.run_no))
        .order_by(workflow_events.c.seq)
    )


_HISTORY = DriverStatement(_history_statement)


def load_history(conn: Connection, pk: int, run_no: int) -> list[Any]:
    """The run's events in seq order (only the columns replay needs)."""
    return _HISTORY.all(conn, {"p_pk": pk, "p_run_no": run_no})


@cache
def _history_since_statement() -> Select[Any]:
    """:func:`_history_statement` from a seq on (the sticky cache's read)."""
    return _history_statement().where(
        workflow_events.c.seq >= _p("low", workflow_events.c.seq))


_HISTORY_SINCE = DriverStatement(_history_since_statement)


def history_since(conn: Connection, pk: int, run_no: int, low: int) -> list[Any]:
    """The run's events from seq ``low`` on, in seq order."""
    return _HISTORY_SINCE.all(conn, {"p_pk": pk, "p_run_no": run_no, "p_low": low})


#: The columns :func:`insert_event` writes (its parameters, ``p_<column>``).
EVENT_COLUMNS = ("workflow_pk", "run_no", "seq", "kind", "name", "args_digest", "args",
                 "state", "result", "error", "fire_at", "run_key", "fence_token",
                 "created_at", "completed_at")


@cache
def _insert_event_statement() -> Select[Any]:
    """The record's event insert: ``WITH ins AS (INSERT INTO workflow_events (...) VALUES
    (...) RETURNING seq) SELECT seq FROM ins``."""
    ins = (workflow_events.insert()
           .values({c: _p(c, workflow_events.c[c]) for c in EVENT_COLUMNS})
           .returning(workflow_events.c.seq).cte("ins"))
    return select(ins.c.seq)


_INSERT_EVENT = DriverStatement(_insert_event_statement)


def insert_event(conn: Connection, values: dict[str, Any]) -> None:
    """Insert one history event (``values``: every column of :data:`EVENT_COLUMNS`)."""
    _INSERT_EVENT.first(conn, {f"p_{c}": values[c] for c in EVENT_COLUMNS})


#: The event columns :func:`fence_check_and_insert_event` takes (the clock columns come
#: from the fence check's ``updated_at``).
_FENCED_EVENT_COLUMNS = tuple(c for c in EVENT_COLUMNS
                              if c not in ("created_at", "completed_at"))


def _typed(c: Any) -> Any:
    """The parameter ``p_<name>`` of column ``c`` in a select list, typed as the column: an
    untyped parameter there would be text; a string is cast to unbounded varchar (a cast to
    varchar(n) would truncate: the insert refuses a value too long, as the insert of VALUES
    does)."""
    kind = String() if isinstance(c.type, String) else c.type
    return cast(_p(c.name, c), kind)


def _fence_and_event_ctes() -> tuple[Any, Any]:
    """The ``f`` (fence check) and ``ins`` (event insert, from ``f``) CTEs of
    :func:`_fence_and_event_statement`."""
    f = (
        update(workflows)
        .where(workflows.c.id == _p("pk", workflows.c.id),
               workflows.c.fence_token == _p("fence", workflows.c.fence_token))
        .values(history_len=workflows.c.history_len + 1,
                history_bytes=workflows.c.history_bytes
                + _p("size", workflows.c.history_bytes),
                lease_expires_at=func.clock_timestamp()
                + bindparam("p_lease", type_=Interval()),
                updated_at=func.clock_timestamp())
        .returning(workflows.c.updated_at)
        .cte("f")
    )
    col = workflow_events.c
    values = [_typed(col[c]) for c in _FENCED_EVENT_COLUMNS]
    state = _typed(col.state)
    ins = (
        workflow_events.insert()
        .from_select([*_FENCED_EVENT_COLUMNS, "created_at", "completed_at"],
                     select(*values, f.c.updated_at,
                            case((state != literal_column("'scheduled'"), f.c.updated_at),
                                 else_=null())).select_from(f))
        .returning(col.seq)
        .cte("ins")
    )
    return f, ins


@cache
def _fence_and_event_statement() -> Select[Any]:
    """The fence check (:func:`fence_check`, one event) and the event's insert, one
    statement::

        WITH f AS (UPDATE workflows SET history_len = history_len + 1, ... (as
                          _fence_check_statement) WHERE id = :pk AND fence_token = :mine
                   RETURNING updated_at),
        ins AS (INSERT INTO workflow_events (..., created_at, completed_at)
                SELECT :workflow_pk, ..., f.updated_at,
                       CASE WHEN :state <> 'scheduled' THEN f.updated_at END
                FROM f RETURNING seq)
        SELECT f.updated_at, (SELECT count(*) FROM ins) AS inserted FROM f

    ``ins`` reads ``f``: the workflow row is updated (locked) first, and a stale fence
    (no ``f`` row) inserts nothing."""
    f, ins = _fence_and_event_ctes()
    return select(f.c.updated_at,
                  select(func.count()).select_from(ins).scalar_subquery().label("inserted"))


_FENCE_AND_EVENT = DriverStatement(_fence_and_event_statement)


def fence_check_and_insert_event(conn: Connection, pk: int, fence_token: int, lease: Any,
                                 size: int, values: dict[str, Any]) -> datetime | None:
    """The fence check of a record (one event of ``size`` bytes) and the insert of its
    event (``values``: the columns of :data:`EVENT_COLUMNS` but the two clock columns,
    which are the fence check's clock: ``completed_at`` unless the event is
    ``scheduled``). The clock written, or None when the fence moved (nothing inserted)."""
    params = {f"p_{c}": values[c] for c in _FENCED_EVENT_COLUMNS}
    params.update(p_pk=pk, p_fence=fence_token, p_lease=lease, p_size=size)
    row = _FENCE_AND_EVENT.first(conn, params)
    return None if row is None else row.updated_at  # type: ignore[no-any-return]


@cache
def _fence_event_and_outbox_statement(traced: bool) -> Select[Any]:
    """:func:`_fence_and_event_statement` and the hand-off's outbox insert
    (:func:`reliable_beat.outbox.add`'s psycopg insert: its parameters, ``p_<column>`` and
    ``p_delay``), one statement::

        WITH f AS (... as _fence_and_event_statement),
        ins AS (... as _fence_and_event_statement),
        ob AS (INSERT INTO outbox (...) SELECT :message_id, ..., clock_timestamp() + :delay,
                      clock_timestamp() FROM f ON CONFLICT DO NOTHING RETURNING *)
        SELECT f.updated_at AS fence_clock, (SELECT count(*) FROM ins) AS inserted, ob.*
        FROM f LEFT JOIN ob ON true

    ``ob`` reads ``f`` as ``ins`` does: the workflow row is locked first, and a stale fence
    inserts neither row (and selects none). An outbox row whose id exists already: ``ob``'s
    columns are NULL. ``traced``: with the ``traceparent`` column."""
    f, ins = _fence_and_event_ctes()
    names = ["message_id", "destination", "payload", "headers", "ordering_key", "run_id",
             "schedule_group", *(["traceparent"] if traced else [])]
    values: list[ColumnElement[Any]] = [_typed(outbox.c[n]) for n in names]
    values += [literal_column("'pending'"), literal_column("0"),
               func.clock_timestamp() + bindparam("p_delay", type_=Interval()),
               func.clock_timestamp()]
    ob = (postgresql.insert(outbox)
          .from_select([*names, "state", "attempts", "available_at", "created_at"],
                       select(*values).select_from(f))
          .on_conflict_do_nothing()
          .returning(*outbox.c)
          .cte("ob"))
    return (select(f.c.updated_at.label("fence_clock"),
                   select(func.count()).select_from(ins).scalar_subquery().label("inserted"),
                   *ob.c)
            .select_from(f.outerjoin(ob, true())))


#: :func:`_fence_event_and_outbox_statement` (untraced, traced)
_FENCE_EVENT_AND_OUTBOX = (DriverStatement(lambda: _fence_event_and_outbox_statement(False)),
                           DriverStatement(lambda: _fence_event_and_outbox_statement(True)))


def fence_check_event_and_outbox(conn: Connection, pk: int, fence_token: int, lease: Any,
                                 size: int, values: dict[str, Any],
                                 outbox_params: dict[str, Any]) -> tuple[datetime, Any] | None:
    """:func:`fence_check_and_insert_event` and, in the same statement, the outbox insert
    of ``outbox_params`` (:func:`reliable_beat.outbox.add`'s psycopg parameters). None when
    the fence moved (nothing inserted); else (the clock written, the inserted outbox row or
    None when its message id existed already)."""
    params = {f"p_{c}": values[c] for c in _FENCED_EVENT_COLUMNS}
    params.update(outbox_params)
    params.update(p_pk=pk, p_fence=fence_token, p_lease=lease, p_size=size)
    row = _FENCE_EVENT_AND_OUTBOX["p_traceparent" in outbox_params].first(conn, params)
    if row is None:
        return None
    return row.fence_clock, (row if row.id is not None else None)
