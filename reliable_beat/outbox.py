"""The transactional outbox: external effects written in the effect's own transaction.

A task (or any application code) that commits an effect and must tell the outside world
about it (a broker message, a webhook, an e-mail) writes the *intent* as an outbox row in the
same transaction with :func:`add`. If the transaction rolls back, the intent disappears with
the effect; if it commits, a :class:`~reliable_beat.relay.Relay` delivers the row at least
once, carrying the row's stable ``message_id`` so the far end can deduplicate
(design.md invariant 7)::

    app transaction                          relay (any number of them)
    ---------------                          ---------------------------
    BEGIN
      INSERT effect
      outbox.add(conn, "webhook", {...})  -> reliable_beat_outbox (state=pending)
      [PG: NOTIFY reliable_beat_outbox]
    COMMIT  ------------- wakes ----------->  claim batch (SKIP LOCKED, short txn)
                                              deliver outside any transaction
                                              mark sent / back off / dead-letter

Message ids: pass ``key=`` whenever the code that adds the row can run more than once for
the same logical message (a retried task, a re-delivered request): the same key collapses
onto the same row (``INSERT ... ON CONFLICT (message_id) DO NOTHING``), so the message is
sent once. ``IdempotentTask.outbox.add`` derives the key from the run's idempotency key and
the row's position in the task body. Without a key, a random ``uuid4``-based id is generated:
that is right only for code that runs once per logical message (e.g. inside the web request
transaction that creates the entity), because a second call adds a second message.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from functools import cache
from typing import Any

from sqlalchemy import Interval, Select, Table, bindparam, func, literal_column, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnElement

from reliable_beat import tracing
from reliable_beat.db.driver import DriverStatement, uses_psycopg
from reliable_beat.db.tables import outbox
from reliable_beat.messages import OutboxMessage
from reliable_beat.payloads import check_payload
from reliable_beat.values import DEFAULT_MAX_PAYLOAD_BYTES, json_size, to_json_value

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_MESSAGE_ID_LENGTH",
    "NOTIFY_CHANNEL",
    "OutboxMessage",
    "add",
    "db_now",
    "json_size",
    "new_message_id",
    "now_sql",
]

#: PostgreSQL channel the inserting transaction notifies; relays ``LISTEN`` on it.
NOTIFY_CHANNEL = "reliable_beat_outbox"
#: Length of the ``message_id`` column.
MAX_MESSAGE_ID_LENGTH = 400


def _traceparent_column() -> dict[str, str]:
    """``{"traceparent": ...}`` while a span is recording, else nothing: the column is
    written only when tracing is on, so a store not yet upgraded to it (new code during a
    rolling deploy) takes rows as before (`reliable-beat db upgrade` before turning tracing
    on)."""
    tp = tracing.current_traceparent()
    return {"traceparent": tp} if tp else {}


def db_now(conn: Connection) -> datetime:
    """The store's clock as a UTC-aware ``datetime``, read on ``conn``.

    PostgreSQL: ``clock_timestamp()`` of the server; SQLite: this host's clock (a SQLite store
    is single-host). Same rule as :meth:`reliable_beat.db.dialects.Store.now`.
    """
    name = conn.dialect.name
    if name == "postgresql":
        value = conn.execute(select(func.clock_timestamp())).scalar_one()
        return value.astimezone(timezone.utc)  # type: ignore[no-any-return]
    if name in ("mysql", "mariadb"):
        value = conn.execute(select(func.utc_timestamp(6))).scalar_one()
        return value.replace(tzinfo=timezone.utc)  # type: ignore[no-any-return]
    return datetime.now(timezone.utc)


def now_sql(conn: Connection) -> Any:
    """The store's clock as a SQL expression evaluated inside the statement that uses it
    (saves the round trip of :func:`db_now` when the value is only
    written): ``clock_timestamp()`` on PostgreSQL, ``UTC_TIMESTAMP(6)`` on MySQL/MariaDB;
    on SQLite (no server) this host's clock, read now, as :func:`db_now` does."""
    name = conn.dialect.name
    if name == "postgresql":
        return func.clock_timestamp()
    if name in ("mysql", "mariadb"):
        return func.utc_timestamp(6)
    return db_now(conn)


def new_message_id() -> str:
    """A fresh random message id, ``"msg:" + uuid4().hex`` (for run-once code only)."""
    return f"msg:{uuid.uuid4().hex}"


def insert_ignore(conn: Connection, table: Table) -> Insert:
    """``INSERT ... ON CONFLICT DO NOTHING`` for the dialect of ``conn``."""
    name = conn.dialect.name
    if name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    if name == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing()
    return table.insert().prefix_with("IGNORE")


def _notify_once(conn: Connection, destination: str) -> None:
    """``NOTIFY`` once per transaction and destination (relays need one wake-up, not n)."""
    # a SAVEPOINT that rolls back drops its NOTIFY: key on the innermost transaction
    tx = conn.get_nested_transaction() or conn.get_transaction()
    if tx is None:  # autocommit-style use: notify every time
        conn.execute(text("SELECT pg_notify(:c, :d)"), {"c": NOTIFY_CHANNEL, "d": destination})
        return
    ref = conn.info.get("reliable_beat_notified")
    sent: set[str]
    if ref is not None and ref[0]() is tx:
        sent = ref[1]
    else:
        sent = set()
        conn.info["reliable_beat_notified"] = (weakref.ref(tx), sent)
    if destination not in sent:
        conn.execute(text("SELECT pg_notify(:c, :d)"), {"c": NOTIFY_CHANNEL, "d": destination})
        sent.add(destination)


def add(
    conn: Connection,
    destination: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    delay: timedelta | None = None,
    ordering_key: str | None = None,
    run_id: int | None = None,
    max_bytes: int | None = None,
    schedule_group: str | ColumnElement[Any] | None = None,
    handlers: Mapping[str, Any] | None = None,
    notify: bool = True,
    returned: list[Any] | None = None,
    insert: Callable[[Connection, dict[str, Any] | None], Any] | None = None,
) -> str:
    """Add one message to the outbox inside the caller's transaction.

    Joins the caller's transaction and never commits or rolls back: the row becomes visible
    to relays when, and only if, the caller commits. On PostgreSQL a ``NOTIFY
    reliable_beat_outbox`` is issued in the same transaction, which PostgreSQL delivers on
    commit only (and drops on rollback), so idle relays wake without polling.

    Idempotent on ``key``: adding a message whose id already exists (committed, or earlier in
    this transaction) is a no-op, whatever its state (even ``sent``: a sent message is not
    sent again; nor is its payload updated).

    Args:
        conn: a connection inside an open transaction on the reliable_beat store (the
            database that also holds the effect).
        destination: handler name: ``celery``, ``kombu``, ``webhook``, ``smtp`` or one
            registered in ``reliable_beat_outbox_handlers`` / the entry point group
            ``reliable_beat.outbox_handlers``.
        payload: the payload whose shape the handler defines (see
            :mod:`reliable_beat.handlers`): JSON values, or any value Celery's JSON
            serializer carries (``Decimal``, ``datetime``, ``date``, ``time``, ``UUID``,
            ``bytes``, tuples), stored in kombu's typed form
            (:func:`reliable_beat.values.to_json_value`): a Celery worker receives the Python
            value back, a webhook receives it as text (``"12.50"``, ISO 8601).
        key: the stable message id (at most 400 characters). Without it a random
            ``msg:<uuid4 hex>`` id is generated, which is right only for code that runs once
            per logical message; tasks must pass a key (``IdempotentTask.outbox`` does).
        headers: JSON object of handler options (e.g. ``smtp_host``); default ``{}``.
        delay: deliver no earlier than the store's clock + ``delay`` (``timedelta`` >= 0).
        ordering_key: messages with the same ordering key are delivered in id order; a later
            one is never delivered before an earlier one is sent or dead.
        run_id: the ``reliable_beat_runs`` row this message belongs to, if any.
        max_bytes: the largest JSON size of ``payload`` + ``headers``, bytes (default
            :data:`DEFAULT_MAX_PAYLOAD_BYTES`; ``IdempotentTask.outbox`` passes
            ``reliable_beat_max_payload_bytes``).
        schedule_group: only the relays and beats of this schedule group publish the row
            (a workflow's messages carry its group, so they reach the broker of the app that
            runs it); a SQL expression is evaluated in the insert (the workflow engine passes
            its row's group). None: any relay with a handler for ``destination``.
        handlers: the ``reliable_beat_outbox_handlers`` setting (name ->
            ``"package.module:attr"`` or the handler): the ``validate(payload)`` hook of the
            handler named for ``destination`` checks the payload (``IdempotentTask.outbox``
            and ``current().outbox`` pass their settings'). Built-in destinations and entry
            point handlers are found without it. See :mod:`reliable_beat.payloads`.

        returned: a list to receive the inserted row (all columns, ``INSERT ... RETURNING``
            where the dialect has it; nothing appended when the id already existed). Left
            empty where the dialect cannot return the row: read it back then.
        insert: the caller's statement merged with the insert, called once: with
            ``returned`` on psycopg, ``insert(conn, params)`` runs the insert in it
            (``params``: the psycopg insert's parameters, as :func:`_pg_insert_statement`
            names them; returns the inserted row, or None when the id existed already); on
            any other path ``insert(conn, None)`` runs the caller's statement alone, before
            the insert. The workflow engine merges the insert of an activity's message into
            its fenced record this way.

    Returns:
        The message id (``key`` or the generated one), whether or not a row was inserted.

    Raises:
        OutboxPayloadError: (a ``ValueError``) the destination's handler can never deliver
            ``payload`` (e.g. a ``webhook`` row with the retired ``url``, an ``smtp`` row
            without ``to``); the message names the field and the fix, nothing is written.
        ValueError: a payload or header value neither JSON nor Celery's JSON serializer
            carries (the message names the message and the path to the value), ``key`` is
            empty or longer than 400 characters, ``delay`` is negative,
            or ``payload`` + ``headers`` are larger than ``max_bytes`` as JSON (nothing is
            written; store a reference, e.g. an id or an object-store key, instead).
        sqlalchemy.exc.DBAPIError: the insert failed (the caller's transaction is then
            unusable and should be rolled back).
    """
    if key is not None and not (0 < len(key) <= MAX_MESSAGE_ID_LENGTH):
        raise ValueError(f"outbox key must be 1..{MAX_MESSAGE_ID_LENGTH} characters, got {key!r}")
    if delay is not None and delay < timedelta(0):
        raise ValueError(f"outbox delay must be >= 0, got {delay!r}")
    label = f"outbox message {key or '(no key)'!r} to {destination!r}"
    payload = to_json_value(payload, f"{label}: payload")
    header_values = to_json_value(dict(headers or {}), f"{label}: headers")
    check_payload(destination, payload, label=label, handlers=handlers)
    limit = DEFAULT_MAX_PAYLOAD_BYTES if max_bytes is None else max_bytes
    size = json_size(payload) + json_size(header_values)
    if size > limit:
        raise ValueError(
            f"outbox message {key or '(no key)'!r} to {destination!r}: payload + headers are "
            f"{size} bytes as JSON, over the limit of {limit} (reliable_beat_max_payload_bytes);"
            " store the data elsewhere and put a reference (an id, a key) in the payload"
        )
    message_id = key if key is not None else new_message_id()
    if returned is not None and uses_psycopg(conn) and not isinstance(schedule_group,
                                                                       ColumnElement):
        # the hand-off's insert (reliable_beat.handoff): fixed SQL on the driver connection
        traceparent = _traceparent_column().get("traceparent")
        params = {
            "p_message_id": message_id, "p_destination": destination, "p_payload": payload,
            "p_headers": header_values, "p_ordering_key": ordering_key, "p_run_id": run_id,
            "p_schedule_group": schedule_group, "p_delay": delay or timedelta(0),
            **({"p_traceparent": traceparent} if traceparent is not None else {})}
        row = (_PG_INSERT[traceparent is not None].first(conn, params) if insert is None
               else insert(conn, params))
        if row is not None:  # a named tuple: attributes as a Row's
            returned.append(row)
        if notify:
            _notify_once(conn, destination)
        return message_id
    if insert is not None:
        insert(conn, None)
    pg = conn.dialect.name == "postgresql"
    created_at: Any
    available_at: Any
    if pg:  # the server's clock inside the INSERT: one round trip instead of two
        created_at = func.clock_timestamp()
        available_at = created_at + bindparam("rb_delay", delay or timedelta(0), type_=Interval())
    else:
        created_at = db_now(conn)
        available_at = created_at + (delay or timedelta(0))
    stmt = (
        insert_ignore(conn, outbox).values(
            message_id=message_id,
            destination=destination,
            payload=payload,
            headers=header_values,
            ordering_key=ordering_key,
            run_id=run_id,
            schedule_group=schedule_group,
            state="pending",
            attempts=0,
            available_at=available_at,
            created_at=created_at,
            **_traceparent_column(),
        )
    )
    if returned is not None and conn.dialect.name in ("postgresql", "sqlite"):
        returned.extend(conn.execute(stmt.returning(*outbox.c)).all())
    else:
        conn.execute(stmt)
    if pg and notify:
        _notify_once(conn, destination)
    return message_id


@cache
def _pg_insert_statement(traced: bool) -> Select[Any]:
    """:func:`add`'s insert on PostgreSQL returning the row, as one select of a CTE::

        WITH ins AS (INSERT INTO outbox (...) VALUES (..., clock_timestamp() + :delay,
                     clock_timestamp()) ON CONFLICT DO NOTHING RETURNING *)
        SELECT * FROM ins

    ``traced``: with the ``traceparent`` column (written only while tracing is on)."""
    def p(name: str) -> Any:  # p_ names: see reliable_beat.runs.complete
        return bindparam(f"p_{name}", type_=outbox.c[name].type)

    values: dict[str, Any] = {
        "message_id": p("message_id"), "destination": p("destination"),
        "payload": p("payload"), "headers": p("headers"), "ordering_key": p("ordering_key"),
        "run_id": p("run_id"), "schedule_group": p("schedule_group"),
        "state": literal_column("'pending'"), "attempts": literal_column("0"),
        "available_at": func.clock_timestamp() + bindparam("p_delay", type_=Interval()),
        "created_at": func.clock_timestamp(),
    }
    if traced:
        values["traceparent"] = p("traceparent")
    ins = (postgresql.insert(outbox).values(**values).on_conflict_do_nothing()
           .returning(*outbox.c).cte("ins"))
    return select(*ins.c)


#: :func:`_pg_insert_statement` (untraced, traced) on the psycopg connection
_PG_INSERT = (DriverStatement(lambda: _pg_insert_statement(False)),
              DriverStatement(lambda: _pg_insert_statement(True)))
