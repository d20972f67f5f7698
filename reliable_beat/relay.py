"""The outbox relay: claim due rows, deliver them, mark them sent / back off / dead-letter.

One cycle (:meth:`Relay.run_once`)::

    1. claim   (short txn)  UPDATE outbox SET claimed_by, attempts = attempts + 1,
                                   available_at = now + claim lease
                            WHERE id IN (SELECT id ... pending, due, ordering rule,
                                         ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED)
                              [AND within the byte budget: running sum of payload sizes]
                            RETURNING *
    2. deliver (no txn)     per destination; batches over one connection where the handler can
    3. settle  (short txns) sent -> state sent (+ the trigger's run scheduled -> dispatched)
                            failed -> available_at = now + full-jitter backoff
                            permanent / attempts exhausted -> dead + dead-letter row

Guarantees (safe with any number of relays, threads or processes, on PostgreSQL; on SQLite
the claim runs under ``BEGIN IMMEDIATE``, which serialises claimers on the one host):

* **At least once.** A row leaves ``pending`` only after its handler returned. A relay that
  dies between delivery and step 3 leaves the row claimed; when the claim lease expires
  (``claim_lease_seconds``) another relay claims and delivers it again, with the same
  ``message_id``. Deduplication is the far end's job (Celery task ids, ``Idempotency-Key``,
  ``Message-ID``); at least once + a stable key = effectively once there.
* **No duplicates from claiming.** ``FOR UPDATE SKIP LOCKED`` plus the lease: two live relays
  never hold the same row at once.
* **Ordering keys.** A row is not claimable while a row with the same ``ordering_key`` and a
  lower id is still ``pending`` (claimed, backing off or due), so at most one row per key
  is in flight and a later one never goes before an earlier one is ``sent`` or ``dead``.
  Rows inserted by concurrent, still-uncommitted transactions have no defined order.
* **One poison row never blocks the others** (except its own ordering-key successors): it
  backs off alone, then is dead-lettered.
* **A destination outage never dead-letters.** :class:`~reliable_beat.handlers.
  DestinationUnavailableError` releases the batch with a per-destination backoff and gives
  the attempt back.
* **Expired triggers.** A ``celery`` row whose payload ``expires_at`` passed is not
  published: it is marked ``sent`` with ``last_error = "expired before publish"`` and its run
  goes ``scheduled -> skipped`` with reason ``expired``.
* **Retention.** ``sent`` rows older than ``outbox_retention_seconds`` are deleted, at most
  1000 per pass and one pass a minute per relay; ``dead`` rows are kept until a person acts.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
from reliable_beat import tracing
from reliable_beat.db.dialects import MYSQL_DIALECTS, Store, update_returning
from reliable_beat.db.tables import dead_letters, outbox, runs
from reliable_beat.db.types import UTCDateTime
from reliable_beat.errors import PermanentDeliveryError, StoreUnavailableError
from reliable_beat.groups import (
    record_relay,
    relay_forget,
    relay_heartbeat,
    relay_stopped,
    run_in_group,
    schedule_group_of,
)
from reliable_beat.handlers import (
    DestinationUnavailableError,
    MessageExpiredError,
    load_handlers,
)
from reliable_beat.logs import RepeatedLog
from reliable_beat.outbox import NOTIFY_CHANNEL, OutboxMessage, db_now
from reliable_beat.policies import backoff_delay
from reliable_beat.redaction import get_logger, redact_text
from reliable_beat.settings import Settings
from reliable_beat.triggers import TRIGGER_DESTINATION, TRIGGER_DESTINATIONS

__all__ = [
    "EXPIRED_ERROR",
    "MAX_UNCHARGED_RETURNS",
    "Relay",
    "claim_outbox_batch",
    "dead_letter_malformed",
    "mark_expired",
    "mark_sent",
    "outbox_status",
    "purge_sent",
]

log = get_logger(__name__)

#: ``last_error`` of a trigger row not published because its ``expires_at`` had passed.
EXPIRED_ERROR = "expired before publish"
#: After a database outage a relay leaves beat triggers (destination ``celery``) alone this
#: long (the beat's sweep delay): a beat that published one while the database was gone
#: records it as sent first, so the relay does not send it a second time.
TRIGGER_HOLD_AFTER_OUTAGE_SECONDS = 10.0
_MAX_ERROR_CHARS = 2000
#: How many times one row may be handed back uncharged ("destination unavailable") while its
#: destination delivers other rows meanwhile; after that it is charged an attempt like any
#: failure, so a row that only *looks* like an outage to the handler still dead-letters.
MAX_UNCHARGED_RETURNS = 5
Handler = Callable[[OutboxMessage], None]


# --------------------------------------------------------------------------- statements


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
        .returning(*rows_mod.raw_columns(o, conn.dialect))
    )
    return _decode_claimed(conn, conn.execute(stmt).all(), now)


def _dead_letter_infinite(store: Store, conn: Connection, now: datetime, limit: int,
                          destinations: Iterable[str] | None) -> None:
    """PostgreSQL: dead-letter (``malformed``) pending rows whose ``available_at`` is
    ``'infinity'`` / ``'-infinity'`` (or a year Python cannot hold), at most ``limit``."""
    o = outbox
    sel = (select(*rows_mod.raw_columns(o, conn.dialect))
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
        select(*rows_mod.raw_columns(o, conn.dialect)).where(o.c.id.in_(ids)).order_by(o.c.id)
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
    ``celery`` and that has a ``run_id``, the run goes from ``scheduled`` to ``dispatched``
    with ``dispatched_at = now``; a run already past ``scheduled`` (a worker claimed it
    before this mark) keeps its state and only gets ``dispatched_at = now`` if it had none.
    (A row someone else already marked had its run moved by that mark, in its transaction.)
    Used by the relay and by the beat's fast path.

    Two statements whatever the batch size, both by primary key: the outbox ``UPDATE ...
    RETURNING run_id`` and one ``UPDATE`` of those runs. On PostgreSQL the ids go as one
    array parameter (``id = ANY(:ids)``), so the statement text is the same for every batch.

    Args:
        conn: a connection inside a transaction.
        ids: outbox row ids that were delivered.
        now: the store's clock, UTC.

    Returns:
        How many outbox rows changed to ``sent``.
    """
    if not ids:
        return 0
    changed = update_returning(
        conn,
        update(outbox)
        .where(_ids_clause(conn, outbox.c.id, [int(i) for i in ids]),
               outbox.c.state == "pending")
        .values(state="sent", sent_at=now, last_error=None),
        outbox, (outbox.c.destination, outbox.c.run_id), lock_by_primary_key=True,
    )
    run_ids = sorted({run_id for destination, run_id in changed
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
    return len(changed)


def _ids_clause(conn: Connection, col: Any, ids: list[int]) -> Any:
    """``col = ANY(:ids)`` (one array parameter) on PostgreSQL, ``col IN (...)`` elsewhere."""
    if conn.dialect.name == "postgresql":
        return col == any_(bindparam("ids", ids, type_=postgresql.ARRAY(BigInteger())))
    return col.in_(ids)


def mark_expired(conn: Connection, ids: Sequence[int], now: datetime) -> int:
    """Retire triggers whose ``expires_at`` passed before publish (they were not published).

    Joins the caller's transaction. The outbox rows become ``sent`` with ``last_error =
    "expired before publish"``; linked runs go ``scheduled -> skipped`` with reason
    ``expired``. Not a dead letter: the entry's own expiry asked for exactly this.

    Returns:
        How many outbox rows changed.
    """
    if not ids:
        return 0
    id_list = list(ids)
    changed = conn.execute(
        update(outbox)
        .where(outbox.c.id.in_(id_list), outbox.c.state == "pending")
        .values(state="sent", sent_at=now, claimed_by=None, last_error=EXPIRED_ERROR)
    ).rowcount
    _move_runs(conn, id_list, frm="scheduled", to="skipped", now=now, reason="expired")
    return int(changed or 0)


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


# --------------------------------------------------------------------------- relay


@dataclass
class _Outcome:
    sent: list[int]
    expired: list[int]
    failed: list[tuple[OutboxMessage, BaseException]]
    unavailable: dict[str, list[tuple[OutboxMessage, BaseException]]]
    #: destinations at least one row of this batch was delivered to
    delivered_to: set[str] = field(default_factory=set)


class Relay:
    """Delivers outbox rows. Safe to run many at once (threads or processes, any hosts).

    Args:
        store: the reliable_beat store (create one per process).
        app: the Celery app for the ``celery`` and ``kombu`` handlers (None: those
            destinations are not claimed by this relay and stay pending for another). Of the
            triggers (destination ``celery``) it only claims its schedule group's and
            group-less ones: they go into this app's broker (several apps may share a store).
        handlers: destination -> handler; default :func:`~reliable_beat.handlers.
            load_handlers` (built-ins, entry points, ``reliable_beat_outbox_handlers``).
            Only destinations with a handler are claimed.
        owner: the relay's id in ``claimed_by`` (default ``settings.owner``).
        batch_size: rows per claim (default ``settings.outbox_batch_size``).
        settings: default :meth:`Settings.from_celery(app) <Settings.from_celery>` or
            ``Settings()``; supplies attempts, backoff, retention and poll period.
        claim_lease_seconds: how long a claim lasts; a relay that dies after claiming loses
            its rows to others after this long. Must exceed the time to deliver one batch.
        purge_interval_seconds: at most one retention pass per this many seconds.
        rng: random source for the backoff jitter.
    """

    def __init__(
        self,
        store: Store,
        app: Any = None,
        handlers: Mapping[str, Handler] | None = None,
        *,
        owner: str | None = None,
        batch_size: int | None = None,
        settings: Settings | None = None,
        claim_lease_seconds: float = 60.0,
        purge_interval_seconds: float = 60.0,
        rng: random.Random | None = None,
        redispatch: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.app = app
        #: The re-dispatch sweep of a framework adapter (None: the Celery app's, when given).
        self._redispatch = redispatch
        if settings is None:
            from reliable_beat.adapters import app_settings

            settings = app_settings(app) if app is not None else Settings()
        self.settings = settings
        # a relay with an app publishes triggers into that app's broker: only its schedule
        # group's (and group-less ones); without an app it claims no `celery` rows at all
        self.schedule_group = (
            schedule_group_of(app, settings.schedule_group) if app is not None else None
        )
        self.handlers: dict[str, Handler] = dict(
            handlers if handlers is not None else load_handlers(
                app, settings.outbox_handlers, settings=settings)
        )
        self.owner = owner or settings.owner
        self.batch_size = batch_size or settings.outbox_batch_size
        self.claim_lease = timedelta(seconds=claim_lease_seconds)
        self.purge_interval_seconds = purge_interval_seconds
        self._rng = rng or random.Random()
        self._last_purge = float("-inf")
        self._last_redispatch = float("-inf")
        self._down_streak: dict[str, int] = {}
        #: destination -> ids of rows this relay backed off while the destination was down:
        #: made due again at once when a delivery to it succeeds (see :meth:`settle`)
        self._backed_off: dict[str, set[int]] = {}
        self._last_scan = float("-inf")  # last claim that also took unreadable rows
        self._last_unhandled_check = float("-inf")
        self._outage_log = RepeatedLog(log)  # "store unavailable": first, then every 30 s
        self._uncharged: dict[int, tuple[int, float]] = {}  # row id -> (returns, first at)
        self._delivered_at: dict[str, float] = {}  # destination -> last success (monotonic)
        self._listener: _Listener | None = None
        # After a database outage, beat triggers (destination ``celery``) are left alone for
        # a sweep delay: the beat that published one during the outage records it first.
        self._triggers_after = 0.0
        self._retention: Any = None  # a RetentionThread while run_forever runs
        # heartbeat row in reliable_beat_beats (role 'relay'): `status` tells a group whose
        # rows no live relay or beat publishes; None until first recorded
        self._heartbeat_key: str | None = None
        self._last_heartbeat = float("-inf")
        self._heartbeat_log = RepeatedLog(log)
        # the heartbeat thread (run_forever) and run_once both beat: one at a time
        self._heartbeat_lock = threading.Lock()
        #: monotonic start of the cycle now running (None between cycles): the heartbeat
        #: thread stops beating for a cycle stuck longer than STALLED_CYCLE_SECONDS
        self._cycle_started: float | None = None
        self._stall_log = RepeatedLog(log)

    # -- one cycle -----------------------------------------------------------------------

    def claim(self) -> list[OutboxMessage]:
        """Claim one batch in its own short transaction (see :func:`claim_outbox_batch`)."""
        destinations = [d for d in self.handlers
                        if d not in TRIGGER_DESTINATIONS
                        or time.monotonic() >= self._triggers_after]
        if not destinations:
            return []
        scan = time.monotonic() - self._last_scan >= 60.0
        if scan:
            self._last_scan = time.monotonic()
        with self.store.begin() as conn:
            now = db_now(conn)
            return claim_outbox_batch(
                self.store,
                conn,
                owner=self.owner,
                now=now,
                lease=self.claim_lease,
                limit=self.batch_size,
                destinations=destinations,
                max_bytes=self.settings.outbox_batch_bytes,
                unreadable=scan,
                schedule_group=self.schedule_group,
            )

    def run_once(self) -> int:
        """Claim one batch, deliver it, settle it; purge old sent rows when due.

        Returns:
            How many rows were claimed (0: nothing was due).

        Raises:
            StoreUnavailableError: the database cannot be reached (nothing was lost: claimed
                rows are delivered again after their lease).
        """
        self._cycle_started = time.monotonic()
        try:
            self.maybe_heartbeat()
            messages = self.claim()
            if messages:
                outcome = self.deliver(messages)
                self.settle(outcome)
            self.maybe_warn_unhandled()
            self.maybe_purge()
            self.maybe_redispatch()
        finally:
            self._cycle_started = None
        return len(messages)

    def maybe_heartbeat(self) -> bool:
        """Every :data:`HEARTBEAT_SECONDS`: record this relay as alive in
        ``reliable_beat_beats`` (``role = 'relay'``: its owner id, schedule group, handler
        destinations and ``seen_at`` on the store clock; :func:`~reliable_beat.groups.
        record_relay`). ``reliable-beat status`` reads it to tell a schedule group whose
        outbox rows no live relay or beat publishes.

        A failure other than the store being unreachable (e.g. a store not yet upgraded to
        0011_relaywatch) is logged at WARNING (first, then every 30 s) and never stops
        delivery.

        Returns:
            True when a heartbeat was written now.

        Raises:
            StoreUnavailableError: the database cannot be reached.
        """
        with self._heartbeat_lock:
            if time.monotonic() - self._last_heartbeat < HEARTBEAT_SECONDS:
                return False
            self._last_heartbeat = time.monotonic()
            try:
                if self._heartbeat_key is None or not relay_heartbeat(self.store,
                                                                      self._heartbeat_key):
                    self._heartbeat_key = record_relay(
                        self.store, owner=self.owner, group=self.schedule_group,
                        destinations=self.handlers)
            except StoreUnavailableError:
                raise
            except Exception as exc:
                self._heartbeat_log.log(
                    logging.WARNING, "relay: could not record its heartbeat (`reliable-beat "
                    "status` may report its schedule group %r as unserved; run `reliable-beat "
                    "db upgrade`?): %s", self.schedule_group, _describe(exc))
                return False
            self._heartbeat_log.reset()
            return True

    def heartbeat_from_thread(self) -> bool:
        """One beat of the heartbeat thread :meth:`run_forever` runs: :meth:`maybe_heartbeat`
        whatever the delivery loop is doing (a long batch, a slow broker), so ``status``
        does not take a busy relay for a dead one; never raises (an unreachable store is the
        delivery loop's to report).

        A cycle running longer than :data:`STALLED_CYCLE_SECONDS` is taken to be stuck (a
        publish that never returns): the thread then stops beating, logs WARNING (first,
        then every 30 s) and ``status`` shows the relay gone after its liveness window,
        as if it had died (its claimed rows go to other relays when their lease ends).

        Returns:
            True when a heartbeat was written now.
        """
        started = self._cycle_started
        if started is not None and time.monotonic() - started > STALLED_CYCLE_SECONDS:
            self._stall_log.log(
                logging.WARNING, "relay: one delivery cycle has been running for %.0f s "
                "(more than %.0f s: a publish that does not return?): no longer recording "
                "a heartbeat, so `reliable-beat status` shows this relay gone",
                time.monotonic() - started, STALLED_CYCLE_SECONDS)
            return False
        self._stall_log.reset()
        try:
            return self.maybe_heartbeat()
        except Exception as exc:  # the store is down: the delivery loop says so
            log.debug("relay: heartbeat thread could not record a heartbeat: %s", exc)
            return False

    def maybe_warn_unhandled(self) -> list[tuple[str, int]]:
        """Once a minute: WARN about due rows of destinations no relay takes.

        A pending row due for more than :data:`UNHANDLED_AFTER_SECONDS` whose destination
        this relay has no handler for (and that no other relay claimed meanwhile: a claim
        moves ``available_at`` a lease ahead) waits forever: usually a typo in
        ``outbox.add(conn, "emial", ...)``. Logged at WARNING once per check, naming the
        destination, the row count and this relay's handlers; ``status --check`` alarms on
        the same rows after ``--outbox-stuck`` minutes.

        Returns:
            ``[(destination, rows)]`` warned about (empty when the check was not due).
        """
        if time.monotonic() - self._last_unhandled_check < UNHANDLED_CHECK_SECONDS:
            return []
        self._last_unhandled_check = time.monotonic()
        with self.store.begin() as conn:
            cutoff = db_now(conn) - timedelta(seconds=UNHANDLED_AFTER_SECONDS)
            found = [(str(d), int(n)) for d, n in conn.execute(
                select(outbox.c.destination, func.count())
                .where(outbox.c.state == "pending", outbox.c.available_at <= cutoff,
                       outbox.c.destination.not_in(list(self.handlers)))
                .group_by(outbox.c.destination)
                .order_by(outbox.c.destination)
            )]
        for destination, n in found:
            log.warning(
                "relay: %d outbox rows for destination %r are due and no relay claims them: "
                "this relay has no handler for %r (its handlers: %s). A typo in "
                "outbox.add(..., destination)? Or start a relay with that handler "
                "(reliable_beat_outbox_handlers).",
                n, destination, destination, ", ".join(sorted(self.handlers)) or "none")
        return found

    def maybe_redispatch(self) -> None:
        """Every few seconds, with an app: re-send triggers of stuck tracked runs (their
        message was lost; see :mod:`reliable_beat.redispatch`)."""
        if (self.app is None and self._redispatch is None) or \
                time.monotonic() - self._last_redispatch < 5.0:
            return
        self._last_redispatch = time.monotonic()
        if self._redispatch is not None:
            self._redispatch()
            return
        from reliable_beat.redispatch import redispatch_stuck_runs

        redispatch_stuck_runs(self.store, self.app, self.settings)
        # durable workflows: dead advances, lost wakes, lost activity messages
        from reliable_beat.adapters import adapter_for
        from reliable_beat.workflows.engine import redispatch_workflows

        app, probe = self.app, getattr(adapter_for(self.app), "queue_depths", None)
        redispatch_workflows(self.store, older_than=timedelta(
            seconds=self.settings.redispatch_seconds), retrying_after=timedelta(
            seconds=self.settings.redispatch_seconds + self.settings.retry_cap_seconds),
            # the backlog check (optional adapter hook): a queue deep enough is not re-sent to
            queue_depths=None if probe is None or not self.settings.redispatch_backlog_check
            else (lambda messages: list(probe(app, messages))),
            max_takeovers=self.settings.workflow_max_takeovers)

    def deliver(self, messages: Sequence[OutboxMessage]) -> _Outcome:
        """Deliver claimed rows outside any transaction; never raises for one bad row."""
        outcome = _Outcome([], [], [], {})
        groups: dict[str, list[OutboxMessage]] = {}
        for m in messages:
            groups.setdefault(m.destination, []).append(m)
        for destination, group in groups.items():
            results = self._deliver_group(destination, group)
            for m, err in zip(group, results, strict=True):
                if err is None:
                    outcome.sent.append(m.id)
                    outcome.delivered_to.add(destination)
                    self._delivered_at[destination] = time.monotonic()
                    self._uncharged.pop(m.id, None)
                elif isinstance(err, MessageExpiredError):
                    outcome.expired.append(m.id)
                elif isinstance(err, DestinationUnavailableError):
                    outcome.unavailable.setdefault(destination, []).append((m, err))
                else:
                    outcome.failed.append((m, err))
            if destination not in outcome.unavailable:
                self._down_streak.pop(destination, None)
        return outcome

    #: While a destination is down, one of the rows handed back is retried after this long
    #: (seconds) at most, whatever the backoff of the others: the probe that notices the
    #: destination is back (the others then become due at once, :meth:`settle`).
    PROBE_SECONDS = 5.0

    def _deliver_group(self, destination: str, group: list[OutboxMessage]) -> list[Any]:
        handler = self.handlers.get(destination)
        if handler is None:  # cannot happen through claim(); kept for direct callers
            err = PermanentDeliveryError(f"no outbox handler for destination {destination!r}")
            return [err] * len(group)
        spans = tracing.DeliverySpans.of(group)  # None: tracing off
        if spans is not None:
            results = self._deliver_to(handler, destination, spans.messages)
            spans.end(results)
            return results
        return self._deliver_to(handler, destination, group)

    def _deliver_to(self, handler: Any, destination: str, group: list[OutboxMessage]
                    ) -> list[Any]:
        batch = getattr(handler, "deliver_batch", None)
        if batch is not None:
            try:
                batch_results = list(batch(group))
                if len(batch_results) != len(group):
                    raise RuntimeError(
                        f"handler {destination!r}.deliver_batch returned {len(batch_results)} "
                        f"results for {len(group)} messages"
                    )
                return batch_results
            except Exception as exc:
                log.exception("outbox handler %r failed on a batch of %d", destination, len(group))
                return [exc] * len(group)
        results: list[Any] = []
        for m in group:
            try:
                handler(m)
                results.append(None)
            except Exception as exc:
                results.append(exc)
        return results

    def settle(self, outcome: _Outcome) -> None:
        """Record the outcome of a delivered batch, in short transactions.

        Rows of a destination that is down are handed back with a growing backoff (up to
        ``outbox_retry_cap_seconds``), except one, retried within :attr:`PROBE_SECONDS`; once
        a delivery to the destination succeeds again, the rows this relay backed off for it
        are made due at once (a broker back after a hang does not leave them waiting out a
        5-minute backoff)."""
        with self.store.begin() as conn:
            now = db_now(conn)
            mark_sent(conn, outcome.sent, now)
            mark_expired(conn, outcome.expired, now)
            back = sorted(d for d in outcome.delivered_to if d in self._backed_off)
            for destination in back:
                ids = sorted(self._backed_off.pop(destination))
                for i in range(0, len(ids), 500):
                    conn.execute(
                        update(outbox)
                        .where(outbox.c.id.in_(ids[i:i + 500]), outbox.c.state == "pending",
                               outbox.c.claimed_by.is_(None), outbox.c.available_at > now)
                        .values(available_at=now))
                log.info("outbox destination %r answers again: %d rows it was backed off for "
                         "are due now", destination, len(ids))
        if outcome.failed:
            with self.store.begin() as conn:
                self._record_failures(conn, outcome.failed, db_now(conn))
        for destination, items in list(outcome.unavailable.items()):
            items = self._charge_repeat_returns(destination, items)
            if not items:
                continue
            streak = self._down_streak.get(destination, 0)
            self._down_streak[destination] = streak + 1
            delay = max(
                self.settings.outbox_retry_base_seconds,
                backoff_delay(
                    streak,
                    base=self.settings.outbox_retry_base_seconds,
                    cap=self.settings.outbox_retry_cap_seconds,
                    rng=self._rng,
                ),
            )
            log.warning("outbox destination %r unavailable (%s); %d rows back off %.1f s",
                        destination, items[0][1], len(items), delay)
            ids = [m.id for m, _ in items]
            self._backed_off.setdefault(destination, set()).update(ids)
            with self.store.begin() as conn:
                now = db_now(conn)
                for chunk, wait in ((ids[:1], min(delay, self.PROBE_SECONDS)), (ids[1:], delay)):
                    if not chunk:
                        continue
                    conn.execute(
                        update(outbox)
                        .where(outbox.c.id.in_(chunk), outbox.c.state == "pending",
                               outbox.c.claimed_by == self.owner)
                        .values(available_at=now + timedelta(seconds=wait), claimed_by=None,
                                attempts=outbox.c.attempts - 1,
                                last_error=_describe(items[0][1]))
                    )

    def _charge_repeat_returns(
        self, destination: str, items: list[tuple[OutboxMessage, BaseException]]
    ) -> list[tuple[OutboxMessage, BaseException]]:
        """The rows to hand back uncharged; the others are charged as ordinary failures.

        A row handed back :data:`MAX_UNCHARGED_RETURNS` times while the destination
        delivered other rows since its first return is not an outage: it is charged (and so
        dead-lettered after ``outbox_max_attempts``). A real outage delivers nothing, so it
        never charges anyone (at-least-once, never dead-letter on an outage).
        """
        now = time.monotonic()
        if len(self._uncharged) > 100_000:  # bounded memory
            self._uncharged.clear()
        keep: list[tuple[OutboxMessage, BaseException]] = []
        charge: list[tuple[OutboxMessage, BaseException]] = []
        delivered = self._delivered_at.get(destination, float("-inf"))
        for m, err in items:
            count, first = self._uncharged.get(m.id, (0, now))
            count += 1
            if count >= MAX_UNCHARGED_RETURNS and delivered > first:
                log.error("outbox row %d (%s) to %r handed back %d times as 'unavailable' "
                          "while the destination delivered other rows: charging it an "
                          "attempt (%s)", m.id, m.message_id, destination, count, _describe(err))
                self._uncharged.pop(m.id, None)
                charge.append((m, err))
            else:
                self._uncharged[m.id] = (count, first)
                keep.append((m, err))
        if charge:
            with self.store.begin() as conn:
                self._record_failures(conn, charge, db_now(conn))
        return keep

    def _record_failures(
        self, conn: Connection, failed: list[tuple[OutboxMessage, BaseException]], now: datetime
    ) -> None:
        retries: list[dict[str, Any]] = []
        for m, err in failed:
            permanent = isinstance(err, PermanentDeliveryError)
            if permanent or m.attempts >= self.settings.outbox_max_attempts:
                self._dead_letter(conn, m, err, now, "permanent" if permanent else "exhausted")
                continue
            delay = backoff_delay(
                m.attempts - 1,
                base=self.settings.outbox_retry_base_seconds,
                cap=self.settings.outbox_retry_cap_seconds,
                rng=self._rng,
            )
            log.warning("outbox row %d (%s) to %r failed (attempt %d), retry in %.1f s: %s",
                        m.id, m.message_id, m.destination, m.attempts, delay, _describe(err))
            retries.append({"b_id": m.id, "b_attempts": m.attempts, "b_err": _describe(err),
                            "b_at": now + timedelta(seconds=delay)})
        if retries:
            conn.execute(
                update(outbox)
                .where(outbox.c.id == bindparam("b_id"),
                       outbox.c.attempts == bindparam("b_attempts"),
                       outbox.c.state == "pending")
                .values(available_at=bindparam("b_at"), last_error=bindparam("b_err"),
                        claimed_by=None),
                retries,
            )

    def _dead_letter(
        self, conn: Connection, m: OutboxMessage, err: BaseException, now: datetime, reason: str
    ) -> None:
        error = _describe(err)
        changed = conn.execute(
            update(outbox)
            .where(outbox.c.id == m.id, outbox.c.attempts == m.attempts,
                   outbox.c.state == "pending")
            .values(state="dead", claimed_by=None, last_error=error)
        ).rowcount
        if not changed:  # someone else settled it after our lease expired
            return
        log.error("outbox row %d (%s) to %r dead-lettered (%s) after %d attempt(s): %s",
                  m.id, m.message_id, m.destination, reason, m.attempts, error)
        conn.execute(
            dead_letters.insert().values(
                kind="outbox",
                run_id=m.run_id,
                outbox_id=m.id,
                key=m.message_id,
                destination=m.destination,
                payload={
                    "message_id": m.message_id,
                    "destination": m.destination,
                    "payload": m.payload,
                    "headers": dict(m.headers),
                    "ordering_key": m.ordering_key,
                    "run_id": m.run_id,
                },
                reason=reason,
                error=error,
                attempts=m.attempts,
                created_at=now,
            )
        )
        _move_runs(conn, [m.id], frm="scheduled", to="dead", now=now,
                   reason=f"trigger undeliverable: {error}"[:_MAX_ERROR_CHARS])

    def maybe_purge(self) -> int:
        """Run one retention pass if the last one is older than ``purge_interval_seconds``.

        Off while :meth:`run_forever` runs: its :class:`~reliable_beat.retention.
        RetentionThread` purges every table in bounded batches until caught up.
        """
        if self._retention is not None or self.settings.outbox_retention_seconds is None:
            return 0
        if time.monotonic() - self._last_purge < self.purge_interval_seconds:
            return 0
        self._last_purge = time.monotonic()
        with self.store.begin() as conn:
            cutoff = db_now(conn) - timedelta(seconds=self.settings.outbox_retention_seconds)
            deleted = purge_sent(conn, older_than=cutoff)
        if deleted:
            log.info("outbox retention: purged %d sent rows older than %s", deleted, cutoff)
        return deleted

    # -- loop ----------------------------------------------------------------------------

    def run_forever(self, stop_event: threading.Event | None = None) -> None:
        """Run cycles until ``stop_event`` is set; never dies on one bad row or a DB outage.

        After a cycle that claimed rows the next starts at once (sending a row may unblock
        its ordering-key successor); otherwise it waits up to ``relay_poll_seconds`` for a
        PostgreSQL ``NOTIFY reliable_beat_outbox`` (or just sleeps on other dialects).
        """
        stop = stop_event or threading.Event()
        poll = self.settings.relay_poll_seconds
        from reliable_beat.retention import start_retention

        self._retention = start_retention(self.store, self.settings, role="relay")
        beating = threading.Event()  # set: the heartbeat thread stops
        heart = threading.Thread(target=self._heartbeat_loop, args=(beating,),
                                 name="reliable-beat-relay-heartbeat", daemon=True)
        heart.start()
        try:
            # LISTEN before the first claim: a row committed between that claim and a later
            # LISTEN would wake no one and wait a whole poll period.
            self._listen()
            while not stop.is_set():
                try:
                    claimed = self.run_once()
                except StoreUnavailableError as exc:
                    self._outage_log.log(logging.WARNING,
                                         "relay: store unavailable, retrying in %.1f s: %s",
                                         poll, exc)
                    self._triggers_after = time.monotonic() + TRIGGER_HOLD_AFTER_OUTAGE_SECONDS
                    stop.wait(poll)
                    continue
                except Exception:
                    log.exception("relay cycle failed; retrying in %.1f s", poll)
                    stop.wait(poll)
                    continue
                self._outage_log.reset()
                if claimed:
                    continue
                self._wait(stop, poll)
        finally:
            beating.set()
            heart.join(timeout=HEARTBEAT_SECONDS + 30.0)
            if self._retention is not None:
                self._retention.stop()
                self._retention = None
            self._mark_stopped()
            self.close()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        """The heartbeat thread: :meth:`heartbeat_from_thread` every second (it writes at
        most every :data:`HEARTBEAT_SECONDS`) until ``stop`` is set."""
        while not stop.wait(min(1.0, HEARTBEAT_SECONDS)):
            self.heartbeat_from_thread()

    def forget(self) -> None:
        """Delete this relay's heartbeat row (a one-shot run, ``relay --once``, at exit): a
        run that is over is not a relay that died, so it leaves no row to age into
        ``status``'s "last seen" (best effort: logged at DEBUG when the store is gone)."""
        if self._heartbeat_key is None:
            return
        try:
            relay_forget(self.store, self._heartbeat_key)
            self._heartbeat_key = None
        except Exception as exc:
            log.debug("relay: could not delete its heartbeat row: %s", exc)

    def _mark_stopped(self) -> None:
        """Graceful exit: mark the heartbeat row stopped (best effort: a relay that cannot
        reach the store just stops; its row ages out of the live window)."""
        if self._heartbeat_key is None:
            return
        try:
            relay_stopped(self.store, self._heartbeat_key)
        except Exception as exc:
            log.debug("relay: could not mark its heartbeat row stopped: %s", exc)

    def _listen(self) -> None:
        """On PostgreSQL: open the LISTEN connection now (no-op elsewhere, or when open)."""
        if self.store.dialect != "postgresql":
            return
        if self._listener is None:
            self._listener = _Listener(self.store)
        self._listener.listen()

    def _wait(self, stop: threading.Event, timeout: float) -> None:
        """Wait up to ``timeout`` s for a ``NOTIFY`` (PostgreSQL) or ``stop``.

        The LISTEN connection is read for the whole wait, in slices of at most 1 s so that
        ``stop`` is seen within a second. Without a LISTEN connection (it failed: logged,
        retried at the next wait) the rest of the wait is a plain sleep.
        """
        if self.store.dialect != "postgresql":
            stop.wait(timeout)
            return
        if self._listener is None:
            self._listener = _Listener(self.store)
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._listener.wait(min(left, 1.0)):
                return
            if self._listener.conn is None:  # the connection failed
                stop.wait(max(deadline - time.monotonic(), 0.0))
                return

    def close(self) -> None:
        """Close the LISTEN connection and handler resources."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None


#: Seconds between two heartbeats of a relay (``status`` counts one seen within 60 s live).
#: Written by a thread of its own while :meth:`Relay.run_forever` runs, so a long batch or
#: a slow broker does not make a busy relay look dead.
HEARTBEAT_SECONDS = 10.0
#: A delivery cycle running longer than this is stuck (a publish that never returns): the
#: heartbeat thread stops beating, so ``status`` shows the relay gone.
STALLED_CYCLE_SECONDS = 600.0
#: Seconds between two checks for due rows of destinations this relay has no handler for.
UNHANDLED_CHECK_SECONDS = 60.0
#: A row due this long and still unclaimed is reported (other relays had time to take it).
UNHANDLED_AFTER_SECONDS = 60.0


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


def _describe(err: BaseException) -> str:
    text = redact_text(f"{type(err).__name__}: {err}")  # webhook URLs, tokens: never stored
    return text[:_MAX_ERROR_CHARS]
