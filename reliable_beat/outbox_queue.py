"""The outbox as a queue: the statements that claim, settle, purge and count outbox rows.

The relay (:class:`reliable_beat.relay.Relay`) and the beat's fast path
(:mod:`reliable_beat.loop`) run them, each in its own short transaction; every function joins
the caller's transaction (``conn``). Writing rows is :func:`reliable_beat.outbox.add`.

* **claim** (:func:`claim_outbox_batch`): ``UPDATE outbox SET claimed_by, attempts =
  attempts + 1, available_at = now + claim lease WHERE id IN (SELECT id ... pending, due,
  ordering rule, ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED)``, within a byte budget;
  rows that cannot be read are dead-lettered as malformed (:func:`dead_letter_malformed`).
* **settle**: :func:`mark_sent` (a trigger's run ``scheduled -> dispatched``),
  :func:`mark_expired` (the run ``scheduled -> skipped``).
* **purge** (:func:`purge_sent`): ``sent`` rows past retention, in bounded batches.
* **count** (:func:`outbox_status`): the backlog per destination, for ``status``.
* **wait** (``_Listener``, PostgreSQL): a ``LISTEN`` connection on the channel
  :func:`reliable_beat.outbox.add` notifies, so a relay wakes when a row is written.

Ordering rule: a row is not claimable while a row with the same ``ordering_key`` and a
lower id is still ``pending`` (claimed, backing off or due), so at most one row per key is
in flight and a later one never goes before an earlier one is ``sent`` or ``dead``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    LargeBinary,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    delete,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from reliable_beat import rows as rows_mod
from reliable_beat.db.dialects import MYSQL_DIALECTS, Store, update_returning
from reliable_beat.db.tables import dead_letters, outbox, runs
from reliable_beat.db.types import UTCDateTime
from reliable_beat.groups import run_in_group
from reliable_beat.logs import RepeatedLog
from reliable_beat.outbox import NOTIFY_CHANNEL, OutboxMessage, db_now
from reliable_beat.redaction import get_logger, redact_text
from reliable_beat.triggers import TRIGGER_DESTINATION, TRIGGER_DESTINATIONS

__all__ = [
    "EXPIRED_ERROR",
    "claim_outbox_batch",
    "dead_letter_malformed",
    "mark_expired",
    "mark_sent",
    "outbox_status",
    "purge_sent",
]

#: The relay's logger: records keep the name ``reliable_beat.relay``.
log = get_logger("reliable_beat.relay")

#: ``last_error`` of a trigger row not published because its ``expires_at`` had passed.
EXPIRED_ERROR = "expired before publish"
_MAX_ERROR_CHARS = 2000


def claim_outbox_batch(
    store: Store,
    conn: Connection,
    *,
    owner: str,
    now: datetime,
    lease: timedelta,
    limit: int,
    destinations: Iterable[str] | None = None,
    max_bytes: int | None = None,
    unreadable: bool = False,
    schedule_group: str | None = None,
) -> list[OutboxMessage]:
    """Claim up to ``limit`` due pending rows, lowest id first; run inside a short transaction.

    Joins the caller's transaction (commit it at once: the claim is the lease, not the lock).
    Each claimed row gets ``claimed_by = owner``, ``attempts + 1`` and ``available_at = now +
    lease``, so no other relay claims it until the lease expires. Rows locked by a concurrent
    claim are skipped (``SKIP LOCKED``; SQLite serialises writers instead). The ordering rule
    (module docstring) excludes rows with an earlier pending row of the same ordering key.

    Args:
        store: the store (picks the locking clause).
        conn: a connection inside a transaction.
        owner: this relay's id, recorded in ``claimed_by``.
        now: the store's clock, UTC.
        lease: how long the claim lasts (``timedelta``).
        limit: most rows to claim.
        destinations: only claim rows for these destinations (the relay's handlers); None:
            any destination.
        max_bytes: a byte budget: of the (up to ``limit``) rows locked, claim the lowest-id
            ones whose payload + headers (as stored JSON text) add up to at most this many
            bytes, and always the first one (a row larger than the budget is claimed alone);
            the rest stay unclaimed. None: no budget.
        unreadable: SQLite: also claim pending rows whose ``available_at`` is not a
            readable instant (never due otherwise), to dead-letter them as malformed. The
            relay asks for it once a minute (it costs a function call per pending row).
            PostgreSQL: first dead-letter pending rows whose ``available_at`` is
            ``'infinity'`` / ``'-infinity'`` (as malformed; an index range scan).
        schedule_group: of the rows of destination ``celery`` (triggers), only claim those
            whose run's entry is of this schedule group, has no group, or is gone
            (:func:`reliable_beat.groups.run_in_group`), and those with no run: a beat's sweep
            or a relay with an app publishes into its own app's broker, never another app's
            triggers. Other destinations are not scoped by run. Rows stored with a
            schedule group (a workflow's wakes, activity messages, compensations) are
            claimed only by that group; rows without one by any. None: every row.

    A claimed row that cannot be read or has the wrong shape (:func:`reliable_beat.rows.
    check_outbox`) is dead-lettered at once (:func:`dead_letter_malformed`) and not
    returned: one malformed row never fails the claim of the others.

    Returns:
        The claimed rows as :class:`OutboxMessage`, sorted by id.
    """
    o = outbox
    earlier = outbox.alias("earlier")
    earlier_pending = (
        select(literal(1))
        .select_from(earlier)
        .where(
            earlier.c.ordering_key == o.c.ordering_key,
            earlier.c.state == "pending",
            earlier.c.id < o.c.id,
        )
        .exists()
    )
    due = o.c.available_at <= now
    if unreadable and conn.dialect.name == "sqlite":  # a garbage instant is never due
        due = or_(due, rows_mod.unreadable_instant(o.c.available_at))
    if unreadable and conn.dialect.name == "postgresql":
        # 'infinity' is never due, and the claim would overwrite either sentinel with the
        # lease: dead-letter such rows before the claim, with their values as stored
        _dead_letter_infinite(store, conn, now, limit, destinations)
    sel = (
        select(o.c.id)
        .where(
            o.c.state == "pending",
            due,
            or_(o.c.ordering_key.is_(None), ~earlier_pending),
        )
        .order_by(o.c.id)
        .limit(limit)
    )
    if destinations is not None:
        sel = sel.where(o.c.destination.in_(sorted(destinations)))
    if schedule_group is not None:
        sel = sel.where(or_(o.c.destination != TRIGGER_DESTINATION,
                            run_in_group(o.c.run_id, schedule_group)),
                        # a workflow's messages: only its own group's publishers
                        or_(o.c.schedule_group.is_(None), o.c.schedule_group == schedule_group))
    if store.dialect in MYSQL_DIALECTS:
        return _claim_mysql(conn, sel, owner, now, lease, max_bytes)
    claim = store.for_update_skip_locked(sel).cte("claim")
    claimed_ids = select(claim.c.id)
    if max_bytes is not None:
        claimed_ids = _within_byte_budget(store, conn, claim, max_bytes)
    stmt = (
        update(o)
        .where(o.c.id.in_(claimed_ids))
        .values(claimed_by=owner, available_at=now + lease, attempts=o.c.attempts + 1)
        .returning(*_outbox_columns(conn))
    )
    return _decode_claimed(conn, conn.execute(stmt).all(), now)


def _outbox_columns(conn: Connection) -> list[Any]:
    """The outbox columns a claim reads, without decoding (:func:`rows.raw_columns`), less
    the optional ones a store not yet upgraded lacks (``traceparent``)."""
    return rows_mod.raw_columns(outbox, conn.dialect,
                                rows_mod.missing_optional_columns(conn, outbox))


def _dead_letter_infinite(store: Store, conn: Connection, now: datetime, limit: int,
                          destinations: Iterable[str] | None) -> None:
    """PostgreSQL: dead-letter (``malformed``) pending rows whose ``available_at`` is
    ``'infinity'`` / ``'-infinity'`` (or a year Python cannot hold), at most ``limit``."""
    o = outbox
    sel = (select(*_outbox_columns(conn))
           .where(o.c.state == "pending", rows_mod.infinite_instant(o.c.available_at))
           .order_by(o.c.id).limit(limit))
    if destinations is not None:
        sel = sel.where(o.c.destination.in_(sorted(destinations)))
    for raw in conn.execute(store.for_update_skip_locked(sel)).all():
        values, problems = rows_mod.decode_row(o, dict(raw._mapping), conn.dialect)
        dead_letter_malformed(conn, values, problems, now)


def _decode_claimed(conn: Connection, raws: Sequence[Any], now: datetime
                    ) -> list[OutboxMessage]:
    """The claimed rows (read raw) as messages, sorted by id; malformed ones dead-lettered."""
    o = outbox
    claimed: list[OutboxMessage] = []
    for raw in raws:
        values, problems = rows_mod.decode_row(o, dict(raw._mapping), conn.dialect)
        undecoded = {rows_mod.column_of(p) for p in problems}
        problems += [p for p in rows_mod.check_outbox(values)
                     if rows_mod.column_of(p) not in undecoded]
        if not problems:
            try:
                claimed.append(OutboxMessage.from_row(values))
                continue
            except Exception as exc:
                problems.append(f"row: {type(exc).__name__}: {exc}")
        dead_letter_malformed(conn, values, problems, now)
    return sorted(claimed, key=lambda m: m.id)


def dead_letter_malformed(
    conn: Connection, values: Mapping[str, Any], problems: Sequence[str], now: datetime
) -> None:
    """Dead-letter one malformed outbox row (reason ``malformed``); joins the caller's
    transaction.

    The row goes ``dead`` with ``last_error`` = the problems; the dead letter's payload keeps
    every original column value (undecodable ones as text), so a person can repair and
    requeue it; a ``celery`` trigger's run goes ``scheduled -> dead``. Logged at ERROR with
    the row and the fix. One malformed row never fails the claim of the others.
    """
    error = rows_mod.describe_problems(problems)
    row_id = values["id"]
    message_id = values.get("message_id")
    destination = values.get("destination")
    changed = conn.execute(
        update(outbox).where(outbox.c.id == row_id, outbox.c.state == "pending")
        .values(state="dead", claimed_by=None, last_error=error)
    ).rowcount
    if not changed:
        return
    log.error("outbox row %s (%s) to %s dead-lettered: malformed row: %s. Fix: repair the row "
              "from the dead letter's payload and add it again, or requeue it "
              "(`reliable-beat dead-letters show/requeue`)", row_id,
              rows_mod.raw_repr(message_id), rows_mod.raw_repr(destination), error)
    conn.execute(
        dead_letters.insert().values(
            kind="outbox",
            run_id=values.get("run_id") if isinstance(values.get("run_id"), int) else None,
            outbox_id=row_id,
            key=(message_id if isinstance(message_id, str) and message_id
                 else f"outbox:{row_id}")[:400],
            destination=destination[:200] if isinstance(destination, str) else None,
            payload=rows_mod.jsonable_raw(values),
            reason=rows_mod.MALFORMED,
            error=error,
            attempts=values.get("attempts") if isinstance(values.get("attempts"), int) else 0,
            created_at=now,
        )
    )
    _move_runs(conn, [row_id], frm="scheduled", to="dead", now=now,
               reason=f"trigger malformed: {error}"[:_MAX_ERROR_CHARS])


def _claim_mysql(conn: Connection, sel: Any, owner: str, now: datetime, lease: timedelta,
                 max_bytes: int | None) -> list[OutboxMessage]:
    """The claim on MySQL/MariaDB, which allow ``FOR UPDATE`` neither in a CTE nor a
    RETURNING on UPDATE: lock the ids (with their stored sizes when there is a byte budget)
    with ``SKIP LOCKED``, update those, read them back. Rows locked but not claimed (over
    the budget) are released at commit."""
    o = outbox
    if max_bytes is None:
        ids = list(conn.execute(sel.with_for_update(skip_locked=True)).scalars())
    else:
        size = _json_bytes(conn, o.c.payload) + _json_bytes(conn, o.c.headers)
        ids, running = [], 0
        sized = sel.add_columns(size.label("nbytes")).with_for_update(skip_locked=True)
        for row in conn.execute(sized).all():
            row_id, nbytes = row[0], row[1]
            running += int(nbytes)
            if ids and running > max_bytes:
                break
            ids.append(row_id)
    if not ids:
        return []
    conn.execute(
        update(o).where(o.c.id.in_(ids))
        .values(claimed_by=owner, available_at=now + lease, attempts=o.c.attempts + 1)
    )
    raws = conn.execute(
        select(*_outbox_columns(conn)).where(o.c.id.in_(ids)).order_by(o.c.id)
    ).all()
    return _decode_claimed(conn, raws, now)


def _json_bytes(conn: Connection, col: Any) -> Any:
    """SQL: the byte length of a JSON column as stored text (0 for NULL)."""
    if conn.dialect.name == "postgresql":
        return func.coalesce(func.octet_length(cast(col, Text)), 0)
    if conn.dialect.name == "sqlite":
        return func.coalesce(func.length(cast(col, LargeBinary)), 0)
    return func.coalesce(func.length(col), 0)


def _within_byte_budget(store: Store, conn: Connection, claim: Any, max_bytes: int) -> Any:
    """The ids of the locked rows (CTE ``claim``) that fit ``max_bytes`` (first always does).

    The sizes are read in a second CTE over the locked ids (a window function cannot sit in
    the ``FOR UPDATE`` select itself); rows locked but not claimed are released at commit.
    """
    o = outbox
    size = _json_bytes(conn, o.c.payload) + _json_bytes(conn, o.c.headers)
    sized = (
        select(
            o.c.id,
            func.sum(size).over(order_by=o.c.id).label("running"),
            func.row_number().over(order_by=o.c.id).label("n"),
        )
        .where(o.c.id.in_(select(claim.c.id)))
        .cte("sized")
    )
    return select(sized.c.id).where(or_(sized.c.running <= max_bytes, sized.c.n == 1))


def mark_sent(conn: Connection, ids: Sequence[int], now: datetime) -> int:
    """Mark delivered rows ``sent``; move their trigger runs ``scheduled -> dispatched``.

    Joins the caller's transaction. Rows already ``sent`` or ``dead`` are left alone, so it
    is idempotent. For each row this call changes to ``sent`` whose ``destination`` is
    a trigger destination and that has a ``run_id``, the run goes from ``scheduled`` to
    ``dispatched`` with ``dispatched_at = now``; a run already past ``scheduled`` (a worker
    claimed it before this mark) keeps its state and only gets ``dispatched_at = now`` if it
    had none. (A row someone else already marked had its run moved by that mark, in its
    transaction.) Used by the relay and by the beat's fast path.

    A negative id is a trigger published with no outbox row (the beat's due-now fast path,
    :mod:`reliable_beat.unsent`): its run's id negated; that run moves as above.

    Two statements whatever the batch size, both by primary key: the outbox ``UPDATE ...
    RETURNING run_id`` (none when every id is a run's) and one ``UPDATE`` of the runs. On
    PostgreSQL the ids go as one array parameter (``id = ANY(:ids)``), so the statement text
    is the same for every batch.

    Args:
        conn: a connection inside a transaction.
        ids: outbox row ids that were delivered (negative: run ids negated).
        now: the store's clock, UTC.

    Returns:
        How many outbox rows changed to ``sent``, plus the row-less triggers given.
    """
    if not ids:
        return 0
    row_ids = [int(i) for i in ids if i >= 0]
    rowless = {-int(i) for i in ids if i < 0}
    changed = update_returning(
        conn,
        update(outbox)
        .where(_ids_clause(conn, outbox.c.id, row_ids),
               outbox.c.state == "pending")
        .values(state="sent", sent_at=now, last_error=None),
        outbox, (outbox.c.destination, outbox.c.run_id), lock_by_primary_key=True,
    ) if row_ids else []
    run_ids = sorted(rowless | {run_id for destination, run_id in changed
                                if destination in TRIGGER_DESTINATIONS and run_id is not None})
    if run_ids:
        scheduled = runs.c.state == "scheduled"
        at = literal(now, UTCDateTime())
        conn.execute(
            update(runs)
            .where(_ids_clause(conn, runs.c.id, run_ids),
                   or_(scheduled, runs.c.dispatched_at.is_(None)))
            .values(
                state=case((scheduled, literal("dispatched")), else_=runs.c.state),
                updated_at=case((scheduled, at), else_=runs.c.updated_at),
                dispatched_at=case((scheduled, at),
                                   else_=func.coalesce(runs.c.dispatched_at, at)),
            )
        )
    return len(changed) + len(rowless)


def _ids_clause(conn: Connection, col: Any, ids: list[int]) -> Any:
    """``col = ANY(:ids)`` (one array parameter) on PostgreSQL, ``col IN (...)`` elsewhere."""
    if conn.dialect.name == "postgresql":
        return col == any_(bindparam("ids", ids, type_=postgresql.ARRAY(BigInteger())))
    return col.in_(ids)


def mark_expired(conn: Connection, ids: Sequence[int], now: datetime) -> int:
    """Retire triggers whose ``expires_at`` passed before publish (they were not published).

    Joins the caller's transaction. The outbox rows become ``sent`` with ``last_error =
    "expired before publish"``; linked runs go ``scheduled -> skipped`` with reason
    ``expired``. Not a dead letter: the entry's own expiry asked for exactly this. A negative
    id is a trigger with no outbox row (:mod:`reliable_beat.unsent`): its run's id negated;
    that run is skipped the same way.

    Returns:
        How many outbox rows changed, plus the row-less triggers given.
    """
    if not ids:
        return 0
    id_list = [int(i) for i in ids if i >= 0]
    rowless = sorted(-int(i) for i in ids if i < 0)
    changed = 0
    if id_list:
        changed = conn.execute(
            update(outbox)
            .where(outbox.c.id.in_(id_list), outbox.c.state == "pending")
            .values(state="sent", sent_at=now, claimed_by=None, last_error=EXPIRED_ERROR)
        ).rowcount or 0
        _move_runs(conn, id_list, frm="scheduled", to="skipped", now=now, reason="expired")
    if rowless:
        conn.execute(
            update(runs).where(runs.c.id.in_(rowless), runs.c.state == "scheduled")
            .values(state="skipped", reason="expired", updated_at=now, finished_at=now))
    return int(changed) + len(rowless)


def _move_runs(
    conn: Connection,
    outbox_ids: list[int],
    *,
    frm: str,
    to: str,
    now: datetime,
    reason: str | None = None,
) -> None:
    run_ids = select(outbox.c.run_id).where(
        outbox.c.id.in_(outbox_ids),
        outbox.c.destination.in_(sorted(TRIGGER_DESTINATIONS)),
        outbox.c.run_id.is_not(None),
    )
    values: dict[str, Any] = {"state": to, "updated_at": now}
    if reason is not None:
        values["reason"] = reason
    if to in ("skipped", "dead"):
        values["finished_at"] = now
    conn.execute(
        update(runs).where(runs.c.id.in_(run_ids.scalar_subquery()), runs.c.state == frm)
        .values(**values)
    )


def purge_sent(conn: Connection, *, older_than: datetime, limit: int = 1000) -> int:
    """Delete up to ``limit`` ``sent`` rows whose ``sent_at`` is before ``older_than`` (UTC).

    Joins the caller's transaction. ``dead`` and ``pending`` rows are never deleted.

    Returns:
        How many rows were deleted.
    """
    victims = (
        select(outbox.c.id)
        .where(outbox.c.state == "sent", outbox.c.sent_at < older_than)
        .order_by(outbox.c.id)
        .limit(limit)
    )
    if conn.dialect.name in MYSQL_DIALECTS:
        # MySQL/MariaDB refuse LIMIT inside an IN subquery (error 1235): ids first.
        ids = list(conn.execute(victims).scalars())
        if not ids:
            return 0
        result = conn.execute(delete(outbox).where(outbox.c.id.in_(ids),
                                                   outbox.c.state == "sent"))
        return int(result.rowcount or 0)
    result = conn.execute(delete(outbox).where(outbox.c.id.in_(victims.scalar_subquery())))
    return int(result.rowcount or 0)


def outbox_status(conn: Connection) -> list[dict[str, Any]]:
    """The outbox backlog per destination (for ``reliable-beat status``).

    Returns:
        One dict per destination that has pending or dead rows, sorted by destination::

            {"destination": str, "pending": int, "due": int, "backlog": int,
             "scheduled": int, "oldest_pending_at": datetime (UTC) | None,
             "oldest_pending_age_seconds": float | None, "dead": int}

        ``pending`` counts every pending row; ``due`` those whose ``available_at`` has
        passed (claimable now unless held back by an ordering key); ``scheduled`` those
        not yet due and never attempted (a delayed message, e.g. a workflow timer's wake:
        not backlog); ``backlog`` those due or failed at least once (waiting for a relay or
        for their retry: the rows the age is of). The oldest pending row and its age
        (seconds, store clock) are of the backlog only: a row never attempted counts from
        its ``available_at`` (when it became due), a row that failed at least once from its
        ``created_at`` (a failing destination keeps ageing through its retries' backoff). A
        row a relay holds right now (claimed, not failed) is neither backlog nor scheduled.
    """
    now = db_now(conn)
    pending = outbox.c.state == "pending"
    failed = outbox.c.last_error.is_not(None)
    backlog = and_(pending, or_(outbox.c.available_at <= now, failed))
    scheduled = and_(pending, outbox.c.available_at > now, outbox.c.last_error.is_(None),
                     outbox.c.claimed_by.is_(None))
    stmt = (
        select(
            outbox.c.destination,
            func.sum(case((pending, 1), else_=0)).label("pending"),
            func.sum(case((and_(pending, outbox.c.available_at <= now), 1), else_=0)).label("due"),
            func.sum(case((scheduled, 1), else_=0)).label("scheduled"),
            func.sum(case((backlog, 1), else_=0)).label("backlog"),
            func.min(case((and_(backlog, failed), outbox.c.created_at),
                          (backlog, outbox.c.available_at), else_=None)).label("oldest"),
            func.sum(case((outbox.c.state == "dead", 1), else_=0)).label("dead"),
        )
        .where(outbox.c.state.in_(("pending", "dead")))
        .group_by(outbox.c.destination)
        .order_by(outbox.c.destination)
    )
    out = []
    for row in conn.execute(stmt):
        oldest = row.oldest
        if isinstance(oldest, str):  # SQLite aggregate: text, no type processing
            oldest = datetime.fromisoformat(oldest)
        if oldest is not None and oldest.tzinfo is None:
            from datetime import timezone

            oldest = oldest.replace(tzinfo=timezone.utc)
        out.append(
            {
                "destination": row.destination,
                "pending": int(row.pending or 0),
                "due": int(row.due or 0),
                "scheduled": int(row.scheduled or 0),
                "backlog": int(row.backlog or 0),
                "oldest_pending_at": oldest,
                "oldest_pending_age_seconds": (
                    max(0.0, (now - oldest).total_seconds()) if oldest is not None else None
                ),
                "dead": int(row.dead or 0),
            }
        )
    return out


class _Listener:
    """A dedicated autocommit connection ``LISTEN``-ing on the outbox channel: psycopg 3,
    else psycopg2 (a psycopg2-only install, e.g. a Django project on psycopg2)."""

    def __init__(self, store: Store) -> None:
        self.conninfo = store.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False
        )
        self.conn: Any = None
        self._failures = RepeatedLog(log)  # one per poll during an outage: first, then 30 s

    def _connect(self) -> None:
        try:
            import psycopg
        except ImportError:
            import psycopg2  # type: ignore[import-untyped]

            self.conn = psycopg2.connect(self.conninfo, connect_timeout=10,
                                         application_name="reliable_beat:relay-listen")
            self.conn.autocommit = True
            with self.conn.cursor() as cur:
                cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
            return
        self.conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10,
                                    application_name="reliable_beat:relay-listen")
        self.conn.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def _wait_psycopg2(self, timeout: float) -> bool:
        import select as _select

        ready, _, _ = _select.select([self.conn.fileno()], [], [], timeout)
        if not ready:
            return False
        self.conn.poll()
        got = bool(self.conn.notifies)
        self.conn.notifies.clear()  # one cycle serves them all
        return got

    def listen(self) -> None:
        """Connect and ``LISTEN`` now, if not connected (a failure is logged, not raised:
        the next :meth:`wait` tries again). Notifications from then on are kept by the
        connection until a wait reads them."""
        self.wait(0.0)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a notification; True if one arrived."""
        try:
            if self.conn is None or self.conn.closed:
                self._connect()
                self._failures.reset()
            if hasattr(self.conn, "poll"):  # psycopg2
                return self._wait_psycopg2(timeout)
            got = False
            for _ in self.conn.notifies(timeout=timeout, stop_after=1):
                got = True
            if got:  # drain the rest: one cycle serves them all
                for _ in self.conn.notifies(timeout=0.0):
                    pass
            return got
        except Exception as exc:
            self._failures.log(logging.WARNING,
                               "relay LISTEN connection failed (%s); polling instead",
                               redact_text(exc))
            self.close()
            time.sleep(timeout)
            return False

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
