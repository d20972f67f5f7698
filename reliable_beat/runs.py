"""Runs: claim (lease + fence), fenced completion, attempts, failures and dead letters.

Framework-neutral: the Celery adapter (:mod:`reliable_beat.celery.task`) and a future
Dramatiq adapter call these functions; nothing here imports Celery.

Life of a run (``reliable_beat_runs.state``)::

    scheduled -> dispatched -> running -> succeeded
                                 |  \\-> retrying -> running ...
                                 \\-> dead  (dead-letter row; requeue -> scheduled -> dispatched)

Every try is a row in ``reliable_beat_attempts``. ``runs.attempts`` counts the tries that
*ran the body* (claims that took the lease), the first included; it is reset to 0 when a
person requeues a dead letter, so the requeued run gets a fresh retry budget. Attempt rows
that did not run the body (``deduplicated``, ``busy``) carry the run's current count.

Fencing (design.md invariant 6): every claim that takes the lease increments
``fence_token``. Every later write of the runner (renewal, completion, failure) has
``WHERE fence_token = :mine``; zero rows means a newer claim superseded it.

All instants come from the database clock (:meth:`Store.now`), never the local clock.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cache
from typing import Any

from sqlalchemy import (
    Select,
    bindparam,
    case,
    false,
    func,
    literal_column,
    null,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import OperationalError
from sqlalchemy.types import Interval

from reliable_beat import rows as rows_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import MYSQL_DIALECTS, attempts, dead_letters, runs
from reliable_beat.errors import DeadLetterNotFound, RunNotFound, StaleFenceToken
from reliable_beat.redaction import get_logger
from reliable_beat.triggers import TRIGGER_DESTINATIONS, trigger_message_id

__all__ = [
    "UNFINISHED_STATES",
    "Claim",
    "DeadLetterNotFound",
    "LeaseCleared",
    "RunNotFound",
    "claim_run",
    "clear_lease",
    "complete",
    "db_now",
    "format_error",
    "get_dead_letter",
    "get_run",
    "list_attempts",
    "list_dead_letters",
    "list_runs",
    "mark_dispatched",
    "record_failure",
    "record_fenced_out",
    "record_refused_message",
    "release_lease",
    "renew_lease",
    "requeue_dead_letter",
    "set_result",
    "undo_requeue",
]

log = get_logger(__name__)

#: States the scheduler's overlap policy treats as "still running".
UNFINISHED_STATES = ("scheduled", "dispatched", "running", "retrying")

ACQUIRED = "acquired"
ALREADY_SUCCEEDED = "already_succeeded"
BUSY = "busy"
DEAD = "dead"


@dataclass(frozen=True)
class Claim:
    """The outcome of :func:`claim_run`.

    Attributes:
        outcome: ``acquired`` (run the body), ``already_succeeded`` (return :attr:`result`,
            do not run), ``busy`` (another runner holds a live lease; try again after
            :attr:`retry_after`), ``dead`` (the run was dead-lettered; do not run).
        key: the idempotency key.
        run_id: ``reliable_beat_runs.id``; stamp it on rows the body writes.
        fence_token: the run's fence token (this runner's token when ``acquired``).
        attempt: the run's attempt count; for ``acquired``, this try's number (1 = first).
        attempt_id: ``reliable_beat_attempts.id`` of the row recorded for this try.
        fresh: True when this call created the run row (an ad-hoc key seen for the first
            time, or a message that arrived before / without the scheduler's row).
        result: the stored JSON result, for ``already_succeeded``.
        lease_expires_at: UTC, end of the lease (ours when ``acquired``, theirs when busy).
        retry_after: for ``busy``: the lease's remaining time (>= 0).
        task / args / kwargs / entry_name / fire_at: the run's stored call, for replay.
        malformed: for ``dead``: set when this claim found the run row malformed (a stored
            call, instant or state of the wrong shape; :func:`reliable_beat.rows.check_run_row`)
            and dead-lettered it (reason ``malformed``): the problems, one line.
    """

    outcome: str
    key: str
    run_id: int
    fence_token: int
    attempt: int
    attempt_id: int
    fresh: bool = False
    result: Any = None
    lease_expires_at: datetime | None = None
    retry_after: timedelta | None = None
    task: str = ""
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] | None = None
    entry_name: str | None = None
    fire_at: datetime | None = None
    malformed: str | None = None

    @property
    def acquired(self) -> bool:
        """True when this runner holds the lease and must run the body."""
        return self.outcome == ACQUIRED


def db_now(conn: Connection) -> datetime:
    """The database clock for ``conn`` (UTC-aware); see :meth:`Store.now`."""
    return Store(engine=conn.engine, url="").now(conn)


def format_error(exc: BaseException, *, limit: int = 8000) -> str:
    """``Type: message`` plus the traceback, truncated to ``limit`` characters."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text[-limit:]


def _insert_attempt(conn: Connection, **values: Any) -> int:
    result = conn.execute(attempts.insert().values(**values).returning(attempts.c.id))
    return int(result.scalar_one())


#: States a claim takes without looking at a lease: nobody holds one.
_FREE_STATES = ("scheduled", "dispatched", "retrying")


@cache
def _pg_claim_statement() -> Select[Any]:
    """PostgreSQL: the common claims in one statement (one round trip, run in autocommit).

    ::

        WITH clock AS (SELECT clock_timestamp() AS now),
        ins AS (INSERT INTO runs (...) SELECT :key, ..., 'running', 1, 1, :owner,
                clock.now + :lease, ... FROM clock ON CONFLICT DO NOTHING RETURNING ...),
        cur AS MATERIALIZED (SELECT id, state FROM runs WHERE idempotency_key = :key),
        upd AS (UPDATE runs SET fence_token = fence_token + 1, attempts = attempts + 1,
                state = 'running', leased_by = :owner,
                lease_expires_at = (SELECT now FROM clock) + :lease, ...
                WHERE id = (SELECT id FROM cur)
                AND state IN ('scheduled', 'dispatched', 'retrying') RETURNING ...),
        got AS (SELECT ..., 'acquired' AS outcome FROM ins UNION ALL
                SELECT ..., 'acquired' FROM upd UNION ALL
                SELECT ..., 'already_succeeded' FROM runs
                WHERE id = (SELECT id FROM cur WHERE state = 'succeeded')),
        att AS (INSERT INTO attempts (...) SELECT ..., CASE got.outcome WHEN 'acquired'
                THEN 'running' ELSE 'deduplicated' END FROM got RETURNING id, run_id)
        SELECT got.*, att.id AS attempt_id FROM got JOIN att ON att.run_id = got.id

    At most one branch of ``got`` yields a row: every sub-statement reads the same
    snapshot, so a row ``upd`` or the ``succeeded`` branch can see already existed and
    makes ``ins`` a no-op, and a row ``ins`` creates (or one committed by someone else
    while it waited on the unique index) is invisible to both. A concurrent claim of the
    same row makes ``upd`` wait on the row lock and re-check its ``WHERE`` against the new
    version (READ COMMITTED), which is then ``running``: no row. ``succeeded`` is final
    (nothing moves a run out of it), so it is read without a lock. No row at all means
    "not one of the easy cases" (dead, leased, a lease to take over, a slot held by
    another key, or a row committed during the statement): the caller then decides under
    ``SELECT ... FOR UPDATE``.
    """
    clock = select(func.clock_timestamp().label("now")).cte("clock")
    # Parameter names are never column names: SQLAlchemy would turn an execute() parameter
    # named like a column into an extra SET of the UPDATE.
    lease = bindparam("p_lease", type_=Interval())
    owner = bindparam("p_owner", type_=runs.c.leased_by.type)
    key = bindparam("p_key", type_=runs.c.idempotency_key.type)
    now = select(clock.c.now).scalar_subquery()  # no FROM list to join (or lint)

    def returned(outcome: str, fresh: Any) -> list[Any]:
        return [runs.c.id, runs.c.fence_token, runs.c.attempts, runs.c.lease_expires_at,
                runs.c.result, runs.c.task, runs.c.args, runs.c.kwargs, runs.c.entry_name,
                runs.c.fire_at, fresh.label("fresh"), literal_column(f"'{outcome}'").label(
                    "outcome")]

    new_run = {
        "idempotency_key": key,
        "entry_name": bindparam("p_entry", type_=runs.c.entry_name.type),
        "fire_at": bindparam("p_fire_at", type_=runs.c.fire_at.type),
        "trigger": bindparam("p_trigger", type_=runs.c.trigger.type),
        "task": bindparam("p_task", type_=runs.c.task.type),
        "args": bindparam("p_args", type_=runs.c.args.type),
        "kwargs": bindparam("p_kwargs", type_=runs.c.kwargs.type),
        "state": literal_column("'running'"),
        "fence_token": literal_column("1"),
        "attempts": literal_column("1"),
        "leased_by": owner,
        "lease_expires_at": clock.c.now + lease,
        "created_at": clock.c.now,
        "updated_at": clock.c.now,
        "started_at": clock.c.now,
    }
    ins = (
        postgresql.insert(runs)
        .from_select(list(new_run), select(*new_run.values()).select_from(clock))
        .on_conflict_do_nothing()
        .returning(*returned(ACQUIRED, true()))
        .cte("ins")
    )
    # The run of this key, found through the unique key index only. Materialised, so the
    # planner cannot push a state test down into it and pick the state index instead (it
    # did, with stale statistics: a scan of every succeeded run per claim).
    cur = (
        select(runs.c.id, runs.c.state)
        .where(runs.c.idempotency_key == key)
        .cte("cur")
        .prefix_with("MATERIALIZED")
    )
    upd = (
        update(runs)
        .where(
            runs.c.id == select(cur.c.id).scalar_subquery(),
            runs.c.state.in_([literal_column(f"'{s}'") for s in _FREE_STATES]),
        )
        .values(
            fence_token=runs.c.fence_token + 1,
            attempts=runs.c.attempts + 1,
            state=literal_column("'running'"),
            leased_by=owner,
            lease_expires_at=now + lease,
            started_at=now,
            updated_at=now,
        )
        .returning(*returned(ACQUIRED, false()))
        .cte("upd")
    )
    done = select(*returned(ALREADY_SUCCEEDED, false())).where(
        runs.c.id == select(cur.c.id)
        .where(cur.c.state == literal_column("'succeeded'"))
        .scalar_subquery()
    )
    got = union_all(select(ins), select(upd), done).cte("got")
    acquired = got.c.outcome == literal_column(f"'{ACQUIRED}'")
    att = (
        attempts.insert()
        .from_select(
            ["run_id", "attempt", "fence_token", "worker", "task_id", "started_at",
             "finished_at", "outcome"],
            select(
                got.c.id, got.c.attempts, got.c.fence_token, owner,
                bindparam("p_task_id", type_=attempts.c.task_id.type), now,
                case((acquired, null()), else_=now),
                case((acquired, literal_column("'running'")),
                     else_=literal_column("'deduplicated'")),
            ),
        )
        .returning(attempts.c.id, attempts.c.run_id)
        .cte("att")
    )
    return select(got, att.c.id.label("attempt_id")).join_from(
        got, att, att.c.run_id == got.c.id
    )


#: Drivers whose DBAPI connection has a plain ``autocommit`` flag (see below).
_FLAG_DRIVERS = ("psycopg", "psycopg2")


def _leave_autocommit(conn: Connection, raw: Any, *, failing: bool) -> None:
    """Clear ``raw.autocommit``; when it cannot be cleared (a broken connection), invalidate
    ``conn`` so the pool discards it, and raise unless an error is already on its way."""
    try:
        raw.autocommit = False
    except Exception:
        if not conn.invalidated:
            conn.invalidate()
        if not failing:
            raise


def _claim_in_one_statement(conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
    """Run :func:`_pg_claim_statement` in autocommit on ``conn``; its row or None.

    A single statement is its own transaction: it holds the run row's lock only while it
    executes, on the server, so a client paused right after it holds nothing.

    With psycopg (3 or 2) the driver connection's ``autocommit`` flag is set and cleared
    around the statement directly (no server round trip either way): SQLAlchemy's
    ``isolation_level`` execution option did the same through its connection
    characteristics, set, restore and a second restore at check-in, about a tenth of a
    claim's client CPU (issue 20). The flag is always cleared before the connection goes
    back to the pool; a connection on which it cannot be cleared is invalidated (never
    pooled in autocommit, where the next body's effect would commit statement by statement).
    """
    raw = conn.connection.dbapi_connection if conn.dialect.driver in _FLAG_DRIVERS else None
    if raw is not None:
        raw.autocommit = True
        try:
            row = conn.execute(_pg_claim_statement(), params).first()
            conn.commit()  # ends SQLAlchemy's logical transaction; no round trip
        except BaseException:
            _leave_autocommit(conn, raw, failing=True)
            raise
        _leave_autocommit(conn, raw, failing=False)
        return row
    default = conn.default_isolation_level
    conn.execution_options(isolation_level="AUTOCOMMIT")
    row = conn.execute(_pg_claim_statement(), params).first()
    conn.commit()  # ends SQLAlchemy's logical transaction; no round trip in autocommit
    # Back to transactions for the locked path. (On an error the connection goes back to
    # the pool instead, which restores its isolation level; resetting it here would hide
    # the error behind "transaction in progress".)
    conn.execution_options(isolation_level=default)
    return row


def claim_run(
    store: Store,
    key: str,
    *,
    owner: str,
    lease: timedelta,
    task: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    entry: str | None = None,
    fire_at: datetime | None = None,
    task_id: str | None = None,
    trigger: str | None = None,
) -> Claim:
    """Find or create the run for ``key`` and try to take its lease, in one short transaction.

    A new key's run row is created with ``INSERT ... ON CONFLICT DO NOTHING`` already
    ``acquired`` by this caller (``trigger`` ``adhoc`` unless given / an entry is named; the
    same row the path below would make of a ``scheduled`` one, in one statement). An
    existing row is locked (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite serialises
    writers with ``BEGIN IMMEDIATE``); a concurrent insert of the same key waits on the
    first one's commit. So two claims of one key are ordered: exactly one acquires, the
    other sees its lease (``busy``) or its result (``already_succeeded``). Safe from any
    number of processes.

    On PostgreSQL the common cases (a new key; a ``scheduled`` / ``dispatched`` /
    ``retrying`` row; a ``succeeded`` one) are decided and recorded by one statement in
    autocommit (one round trip; see :func:`_pg_claim_statement`); the others fall through
    to the locked decision below, in a transaction on the same connection.

    Decision on the locked row, using the database clock ``now``:

    * ``succeeded`` -> ``already_succeeded`` + a ``deduplicated`` attempt row.
    * ``dead`` -> ``dead`` + a ``deduplicated`` attempt row whose error says so; the body
      must not run (only a person's requeue brings a dead run back).
    * ``running`` with ``lease_expires_at > now`` -> ``busy`` + a ``busy`` attempt row.
      (Any live lease counts, also one held under the same owner id: two threads of one
      worker process share it.)
    * otherwise (``scheduled``, ``dispatched``, ``retrying``, or ``running`` with an expired
      lease, e.g. after a worker crash; the old holder's ``running`` attempt row then
      becomes ``failed``) -> ``acquired``: ``fence_token += 1``,
      ``attempts += 1``, state ``running``, ``leased_by = owner``,
      ``lease_expires_at = now + lease``, and a ``running`` attempt row.

    Args:
        store: the reliable_beat store.
        key: the idempotency key (``entry@2026-01-10T12:00:00Z`` or an ad-hoc key).
        owner: who takes the lease (``host:pid``); recorded as the attempt's worker.
        lease: how long the claim lasts without renewal.
        task: the task name, stored on a new run (for replay from a dead letter).
        args / kwargs: the call's JSON-serialisable arguments, stored on a new run.
        entry / fire_at: the entry and slot (UTC) of a scheduled run, when known.
        task_id: the broker message's task id, recorded on the attempt row.
        trigger: stored on a new run; default ``schedule`` when ``entry`` is given, else
            ``adhoc``.

    Returns:
        The :class:`Claim`. Committed before returning.

    Raises:
        RunNotFound: the row could not be created because another key already holds the
            same ``(entry, fire_at)`` slot (a key not derived from the slot).
        StoreUnavailableError: the database cannot be reached.
    """
    kwargs = dict(kwargs or {})
    trigger = trigger or ("schedule" if entry else "adhoc")
    pg = store.dialect == "postgresql"
    with store.connect() as conn:
        if pg:
            got = _claim_in_one_statement(conn, {
                "p_key": key, "p_entry": entry, "p_fire_at": fire_at, "p_trigger": trigger,
                "p_task": task, "p_args": list(args), "p_kwargs": kwargs, "p_owner": owner,
                "p_lease": lease, "p_task_id": task_id,
            })
            if got is not None:
                acquired = got.outcome == ACQUIRED
                problems = rows_mod.check_run_call(got.task, got.args, got.kwargs)
                if acquired and problems:
                    # A stored call of the wrong shape (written by SQL, another version): the
                    # statement has taken the lease; dead-letter the run under our fence
                    # before anything runs, instead of failing here after the commit.
                    with conn.begin():
                        return _dead_letter_claimed(
                            store, conn, key, got.id, problems, task_id=task_id,
                            owner=owner, fence_token=got.fence_token,
                            attempt_id=got.attempt_id,
                        )
                return Claim(
                    got.outcome, key=key, run_id=got.id, fence_token=got.fence_token,
                    attempt=got.attempts, attempt_id=got.attempt_id,
                    result=None if acquired else got.result,
                    lease_expires_at=got.lease_expires_at if acquired else None,
                    fresh=got.fresh, task=got.task,
                    args=_as_args(got.args), kwargs=_as_kwargs(got.kwargs),
                    entry_name=got.entry_name, fire_at=got.fire_at,
                )
        if store.dialect in MYSQL_DIALECTS:
            return _claim_mysql(
                store, conn, key, owner=owner, lease=lease, task=task, args=args,
                kwargs=kwargs, entry=entry, fire_at=fire_at, task_id=task_id,
                trigger=trigger,
            )
        with conn.begin():
            return _claim_locked(
                store, conn, key, owner=owner, lease=lease, task=task, args=args,
                kwargs=kwargs, entry=entry, fire_at=fire_at, task_id=task_id,
                trigger=trigger, insert_first=not pg,
            )


def _as_args(value: Any) -> tuple[Any, ...]:
    """A stored ``args`` as a tuple; a value of another shape (a finished run's, which is
    never run again) reads as empty."""
    return tuple(value) if isinstance(value, list) else ()


def _as_kwargs(value: Any) -> dict[str, Any]:
    """A stored ``kwargs`` as a dict; a value of another shape reads as empty."""
    return dict(value) if isinstance(value, Mapping) else {}


def _dead_letter_claimed(
    store: Store,
    conn: Connection,
    key: str,
    run_id: int,
    problems: list[str],
    *,
    task_id: str | None,
    owner: str,
    values: Mapping[str, Any] | None = None,
    now: datetime | None = None,
    fence_token: int | None = None,
    attempt_id: int | None = None,
) -> Claim:
    """Dead-letter a malformed run a claim found (reason ``malformed``), inside ``conn``'s
    open transaction, and return the ``dead`` claim: the body never runs, the message is
    acked (no crash, no retry loop). The problems are logged at ERROR with the key and the
    fix (:func:`reliable_beat.rows.dead_letter_run`); the dead letter is counted by
    ``reliable-beat status`` (``quarantined_rows.runs``) and alarms ``status --check``.

    ``fence_token`` / ``attempt_id``: the PostgreSQL one-statement claim has already taken
    the lease and recorded a ``running`` attempt; the run is moved only while that fence
    holds, and that attempt is closed ``dead``. Otherwise (the locked path) the caller holds
    the row's lock and ``values`` is the decoded row; a ``dead`` attempt row is recorded.
    Any ``running`` attempt of an earlier holder is closed ``failed``.
    """
    if now is None:
        now = store.now(conn)
    if values is None:
        values = dict(conn.execute(select(runs).where(runs.c.id == run_id)).mappings().one())
    guard = (runs.c.fence_token == fence_token if fence_token is not None
             else runs.c.state.not_in(("succeeded", "dead", "skipped")))
    state_bad = any(rows_mod.column_of(p) == "state" for p in problems)
    moved = rows_mod.dead_letter_run(
        conn, values, problems, now, guard=guard,
        fix=rows_mod.STATE_FIX if state_bad else rows_mod.RUN_FIX,
    )
    error = f"malformed run row, dead-lettered: {rows_mod.describe_problems(problems)}"
    if not moved:
        error = f"malformed run row, settled by another runner: {error}"
    conn.execute(
        update(attempts)
        .where(attempts.c.run_id == run_id, attempts.c.outcome == "running",
               *([attempts.c.id != attempt_id] if attempt_id is not None else []))
        .values(outcome="failed", finished_at=now, error=error[:8000])
    )
    fence = values.get("fence_token")
    number = values.get("attempts")
    fence = fence if isinstance(fence, int) else 0
    number = number if isinstance(number, int) else 0
    if attempt_id is not None:
        conn.execute(
            update(attempts).where(attempts.c.id == attempt_id)
            .values(outcome="dead", finished_at=now, error=error[:8000])
        )
    else:
        attempt_id = _insert_attempt(
            conn, run_id=run_id, fence_token=fence, attempt=number, worker=owner,
            task_id=task_id, started_at=now, finished_at=now, outcome="dead",
            error=error[:8000],
        )
    task = values.get("task")
    entry_name = values.get("entry_name")
    fire_at = values.get("fire_at")
    return Claim(
        DEAD, key=key, run_id=run_id, fence_token=fence, attempt=number,
        attempt_id=attempt_id, task=task if isinstance(task, str) else "",
        entry_name=entry_name if isinstance(entry_name, str) else None,
        fire_at=fire_at if isinstance(fire_at, datetime) else None,
        malformed=rows_mod.describe_problems(problems),
    )


#: MySQL/MariaDB: how many times a claim transaction the server chose as a deadlock victim
#: (error 1213: rolled back whole) is tried again.
MYSQL_DEADLOCK_RETRIES = 5
_MYSQL_DEADLOCK = 1213


def _claim_mysql(store: Store, conn: Connection, key: str, **kw: Any) -> Claim:
    """The claim on MySQL/MariaDB: lock an existing row first (``SELECT ... FOR UPDATE``),
    insert only when there is none.

    InnoDB's ``INSERT IGNORE`` of an existing key takes a *shared* lock on it; racers that
    all hold it and then ask ``FOR UPDATE`` deadlock. Locking first takes the exclusive
    lock at once. Racing creators of a new key can still deadlock (the losers' ignored
    inserts share the lock after the winner commits); the server then rolls one
    transaction back whole, and it is tried again (it finds the row and locks it).
    """
    retries = 0
    while True:
        try:
            with conn.begin():
                exists = conn.execute(
                    select(runs.c.id).where(runs.c.idempotency_key == key).with_for_update()
                ).first()
                return _claim_locked(store, conn, key, insert_first=exists is None, **kw)
        except OperationalError as exc:
            code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
            if code != _MYSQL_DEADLOCK or retries >= MYSQL_DEADLOCK_RETRIES:
                raise
            retries += 1
            log.info("claim of %s chosen as deadlock victim; trying again (%d)", key, retries)


def _claim_locked(
    store: Store,
    conn: Connection,
    key: str,
    *,
    owner: str,
    lease: timedelta,
    task: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    entry: str | None,
    fire_at: datetime | None,
    task_id: str | None,
    trigger: str,
    insert_first: bool,
) -> Claim:
    """The claim decision on the locked row, inside ``conn``'s open transaction.

    ``insert_first``: create a new key's row first (SQLite; on PostgreSQL
    :func:`_claim_in_one_statement` has just tried).
    """
    if insert_first:
        now = store.now(conn)
        lease_end = now + lease
        # A new run is inserted already acquired by us (fence 1, attempt 1, leased): exactly
        # the state the "scheduled" -> "acquired" path below would give it, in two
        # statements fewer. The row is invisible to others until the commit; a concurrent
        # claim of the same key waits on its unique-index entry, then finds it leased.
        inserted = conn.execute(
            store.insert_ignore(runs).values(
                idempotency_key=key,
                entry_name=entry,
                fire_at=fire_at,
                trigger=trigger,
                task=task,
                args=list(args),
                kwargs=kwargs,
                state="running",
                fence_token=1,
                attempts=1,
                leased_by=owner,
                lease_expires_at=lease_end,
                created_at=now,
                updated_at=now,
                started_at=now,
            )
            .returning(runs.c.id, runs.c.args, runs.c.kwargs, runs.c.fire_at)
        ).first()
        if inserted is not None:
            aid = _insert_attempt(
                conn, run_id=inserted.id, fence_token=1, attempt=1, worker=owner,
                task_id=task_id, started_at=now, finished_at=None, outcome="running",
            )
            return Claim(
                ACQUIRED, key=key, run_id=inserted.id, fence_token=1, attempt=1,
                attempt_id=aid, lease_expires_at=lease_end, fresh=True, task=task,
                args=tuple(inserted.args or ()), kwargs=dict(inserted.kwargs or {}),
                entry_name=entry, fire_at=inserted.fire_at,
            )
    fresh = False
    # Read value by value (reliable_beat.rows): on SQLite a column may hold anything, and
    # an undecodable value must become a problem of this row, not a crash of the claim.
    columns = rows_mod.raw_columns(runs, conn.dialect)
    if store.dialect == "postgresql":
        # The clock read with the row: one round trip instead of two.
        stmt = select(*columns, func.clock_timestamp().label("rb_db_now"))
    else:
        stmt = select(*columns)
    stmt = stmt.where(runs.c.idempotency_key == key)
    if store.dialect != "sqlite":
        stmt = stmt.with_for_update()
    raw = conn.execute(stmt).mappings().one_or_none()
    if raw is None:
        raise RunNotFound(
            f"no run for key {key!r}: slot ({entry!r}, {fire_at}) is held by another key"
        )
    row, problems = rows_mod.decode_row(runs, dict(raw), conn.dialect)
    if "rb_db_now" in raw:
        now = raw["rb_db_now"].astimezone(timezone.utc)
    elif not insert_first:
        now = store.now(conn)
    lease_end = now + lease
    state = row["state"]
    if state not in ("succeeded", "dead", "skipped"):
        # A run this claim would take: the state, the stored call and every value the
        # decision reads must have their shape, or the run is dead-lettered unrun.
        unreadable = {rows_mod.column_of(p) for p in problems}
        problems += [p for p in rows_mod.check_run_row(row)
                     if rows_mod.column_of(p) not in unreadable]
        held = row["lease_expires_at"]
        live = state == "running" and isinstance(held, datetime) and held > now
        if problems and not live:  # a live holder: busy below; the next claim checks again
            return _dead_letter_claimed(store, conn, key, row["id"], problems,
                                        task_id=task_id, owner=owner, values=row, now=now)
    common: dict[str, Any] = {
        "key": key,
        "run_id": row["id"],
        "fresh": fresh,
        "task": row["task"],
        "args": _as_args(row["args"]),
        "kwargs": _as_kwargs(row["kwargs"]),
        "entry_name": row["entry_name"],
        "fire_at": row["fire_at"],
    }
    attempt_base = {
        "run_id": row["id"],
        "fence_token": row["fence_token"],
        "attempt": row["attempts"],
        "worker": owner,
        "task_id": task_id,
        "started_at": now,
        "finished_at": now,
    }
    if state == "succeeded":
        aid = _insert_attempt(conn, outcome="deduplicated", **attempt_base)
        return Claim(
            ALREADY_SUCCEEDED, fence_token=row["fence_token"], attempt=row["attempts"],
            attempt_id=aid, result=row["result"], **common,
        )
    if state in ("dead", "skipped"):
        aid = _insert_attempt(
            conn,
            outcome="deduplicated",
            error=f"run is {state}; not run (requeue its dead letter to run it again)",
            **attempt_base,
        )
        return Claim(
            DEAD, fence_token=row["fence_token"], attempt=row["attempts"],
            attempt_id=aid, **common,
        )
    expires = row["lease_expires_at"]
    if state == "running" and expires is not None and expires > now:
        aid = _insert_attempt(
            conn,
            outcome="busy",
            error=f"lease held by {row['leased_by']} until {expires.isoformat()}",
            **attempt_base,
        )
        return Claim(
            BUSY, fence_token=row["fence_token"], attempt=row["attempts"],
            attempt_id=aid, lease_expires_at=expires, retry_after=expires - now, **common,
        )
    fence = row["fence_token"] + 1
    number = row["attempts"] + 1
    if state == "running":
        # Taking over an expired lease: the holder crashed or is paused. Close its
        # attempt row; if it wakes up, its commit is fenced out (and says so).
        conn.execute(
            update(attempts)
            .where(attempts.c.run_id == row["id"], attempts.c.outcome == "running")
            .values(
                outcome="failed",
                finished_at=now,
                error=f"lease of {row['leased_by']} expired at {expires}; "
                f"taken over with fence {fence}",
            )
        )
    conn.execute(
        update(runs)
        .where(runs.c.id == row["id"])
        .values(
            fence_token=fence,
            attempts=number,
            state="running",
            leased_by=owner,
            lease_expires_at=lease_end,
            started_at=now,
            updated_at=now,
        )
    )
    aid = _insert_attempt(
        conn,
        outcome="running",
        **{**attempt_base, "fence_token": fence, "attempt": number, "finished_at": None},
    )
    return Claim(
        ACQUIRED, fence_token=fence, attempt=number, attempt_id=aid,
        lease_expires_at=lease_end, **common,
    )


@cache
def _pg_complete_statement() -> Select[Any]:
    """PostgreSQL: the fenced completion in one statement (one round trip).

    ::

        WITH clock AS (SELECT clock_timestamp() AS now),
        done AS (UPDATE runs SET state = 'succeeded', result = :result, ...,
                 finished_at = (SELECT now FROM clock)
                 WHERE id = :run_id AND fence_token = :fence RETURNING id, finished_at),
        att AS (UPDATE attempts SET outcome = 'succeeded', finished_at = done.finished_at
                FROM done WHERE attempts.id = :attempt_id AND attempts.run_id = done.id
                RETURNING attempts.id)
        SELECT done.id FROM done

    No row: the fence moved; ``att`` then updated nothing either.
    """
    clock = select(func.clock_timestamp().label("now")).cte("clock")
    now = select(clock.c.now).scalar_subquery()
    # p_ names: see _pg_claim_statement (a parameter named "result" would become a SET).
    done = (
        update(runs)
        .where(
            runs.c.id == bindparam("p_run_id", type_=runs.c.id.type),
            runs.c.fence_token == bindparam("p_fence", type_=runs.c.fence_token.type),
        )
        .values(
            state=literal_column("'succeeded'"),
            result=bindparam("p_result", type_=runs.c.result.type),
            error=null(),
            reason=null(),
            leased_by=null(),
            lease_expires_at=null(),
            finished_at=now,
            updated_at=now,
        )
        .returning(runs.c.id, runs.c.finished_at)
        .cte("done")
    )
    att = (
        update(attempts)
        .where(
            attempts.c.id == bindparam("p_attempt_id", type_=attempts.c.id.type),
            attempts.c.run_id == done.c.id,
        )
        .values(outcome=literal_column("'succeeded'"), finished_at=done.c.finished_at)
        .returning(attempts.c.id)
        .cte("att")
    )
    # the run's state before this statement (every CTE reads the statement's snapshot): an
    # unknown one (set by SQL) is logged by complete()
    prev = (select(runs.c.state.label("prev_state"))
            .where(runs.c.id == bindparam("p_run_id", type_=runs.c.id.type)).cte("prev"))
    # ``att`` is data-modifying: PostgreSQL runs it to completion though nothing reads it.
    return (select(done.c.id, prev.c.prev_state)
            .select_from(done.outerjoin(prev, true())).add_cte(att))


def complete(conn: Connection, claim: Claim, result: Any) -> None:
    """Record the run as ``succeeded`` with ``result``, fenced, inside the caller's transaction.

    Joins the caller's transaction: the effect the body wrote, the outbox rows, the key's
    ``succeeded`` state and the result commit together or not at all (invariant 5). Runs
    ``UPDATE runs SET state='succeeded' ... WHERE id = :id AND fence_token = :mine``; on
    PostgreSQL this locks the run row until the caller commits, so a concurrent claim waits
    and then sees ``succeeded``. On PostgreSQL the run and attempt updates and the clock
    read are one statement (:func:`_pg_complete_statement`).

    Args:
        conn: a connection inside the caller's open transaction on the store's database.
        claim: an ``acquired`` claim.
        result: JSON-serialisable return value of the body (``None`` is fine).

    Raises:
        StaleFenceToken: zero rows matched: a newer claim bumped the fence. The caller must
            roll back (everything the body wrote is then undone) and call
            :func:`record_fenced_out` in a separate transaction.
    """
    if conn.dialect.name == "postgresql":
        row = conn.execute(_pg_complete_statement(), {
            "p_run_id": claim.run_id, "p_fence": claim.fence_token,
            "p_attempt_id": claim.attempt_id, "p_result": result,
        }).first()
        if row is None:
            raise StaleFenceToken(claim.key, claim.fence_token)
        if row.prev_state not in rows_mod.KNOWN_RUN_STATES:
            _log_unknown_state(claim, row.prev_state)
        _workflow_hook(conn, claim.key, "succeeded", result)
        return
    now = db_now(conn)
    known = runs.c.state.in_(sorted(rows_mod.KNOWN_RUN_STATES))
    # first only a known state: an unknown one (set by SQL) costs a second statement, logged
    for guard in (known, ~known):
        was = None if guard is known else conn.execute(
            select(runs.c.state).where(runs.c.id == claim.run_id)).scalar()
        done = conn.execute(
            update(runs)
            .where(runs.c.id == claim.run_id, runs.c.fence_token == claim.fence_token, guard)
            .values(
                state="succeeded",
                result=result,
                error=None,
                reason=None,
                leased_by=None,
                lease_expires_at=None,
                finished_at=now,
                updated_at=now,
            )
        )
        if done.rowcount == 1:
            if guard is not known:
                _log_unknown_state(claim, was)
            break
    else:
        raise StaleFenceToken(claim.key, claim.fence_token)
    conn.execute(
        update(attempts)
        .where(attempts.c.id == claim.attempt_id)
        .values(outcome="succeeded", finished_at=now)
    )
    _workflow_hook(conn, claim.key, "succeeded", result)


def _log_unknown_state(claim: Claim, state: Any) -> None:
    """complete() found the run in a state the library never writes (set by SQL while it
    ran): it records the truth (``succeeded``: this runner holds the fence and its effect
    commits now) and says so, loudly."""
    was = f" {rows_mod.raw_repr(state)}"
    log.error(
        "run %s (id %s): its state was%s, none the library writes (changed by SQL while "
        "fence %s ran it?), when its runner completed it: recorded 'succeeded' with the "
        "result, effect committed once. Fix: find who writes run states by hand; "
        "`reliable-beat runs show %s` shows the run", claim.key, claim.run_id,
        was, claim.fence_token, claim.key)


def _workflow_hook(conn: Connection, key: str, state: str, result: Any = None,
                   error: str | None = None) -> None:
    """An activity of a durable workflow (key ``wf:...``): write its outcome into the
    workflow's history in this same transaction (reliable_beat.workflows.engine)."""
    if key.startswith("wf:"):
        from reliable_beat.workflows.engine import on_run_finished

        on_run_finished(conn, key, state, result, error)


def set_result(store: Store, claim: Claim, result: Any) -> bool:
    """Store ``result`` on a run this runner already completed (short fenced transaction).

    Used when the body completed the run inside its own ``with self.transaction()`` block
    and returned a value afterwards. Best effort: the effect is committed already.

    Returns:
        True when the row was updated (fence unchanged, state ``succeeded``).
    """
    with store.begin() as conn:
        done = conn.execute(
            update(runs)
            .where(
                runs.c.id == claim.run_id,
                runs.c.fence_token == claim.fence_token,
                runs.c.state == "succeeded",
            )
            .values(result=result)
        )
        return done.rowcount == 1


def record_fenced_out(store: Store, claim: Claim, error: str | None = None) -> None:
    """Mark this runner's attempt ``fenced_out`` (separate short transaction).

    Call after the transaction that raised :class:`StaleFenceToken` was rolled back.
    """
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(
            update(attempts)
            .where(attempts.c.id == claim.attempt_id)
            .values(
                outcome="fenced_out",
                finished_at=now,
                error=error or f"fence token {claim.fence_token} is stale; writes rolled back",
            )
        )


def renew_lease(store: Store, claim: Claim, lease: timedelta) -> bool:
    """Extend this runner's lease to ``db now + lease`` (short fenced transaction).

    On PostgreSQL the renewal waits at most a sixth of the lease (50 ms .. 5 s) for the run
    row's lock (``SET LOCAL lock_timeout``), not the role's 30 s: one process renews the
    leases of all its executions in turn, so a row held by someone else (a claimer frozen
    inside its transaction) must not hold up the others. The lease is still valid then;
    the caller tries again at its next interval. On MySQL/MariaDB the same bound in whole
    seconds (1 .. 5 s; ``innodb_lock_wait_timeout`` for this statement, then the role's
    value again).

    Returns:
        True when renewed; False when the fence moved (another runner claimed the run, or
        ``lease clear`` was used) or the run is no longer ``running``: the caller has lost
        the lease and its completion will be rejected.

    Raises:
        StoreUnavailableError: the database cannot be reached (the lease is not lost yet).
        sqlalchemy.exc.OperationalError: the row lock was not granted in time (PostgreSQL
            ``lock_not_available``, MySQL 1205; the lease is not lost yet).
    """
    mysql = store.dialect in MYSQL_DIALECTS
    role_wait: Any = None
    with store.begin() as conn:
        if store.dialect == "postgresql":
            wait_ms = int(min(max(lease.total_seconds() * 1000 / 6, 50), 5000))
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = {wait_ms}")
            now: Any = func.clock_timestamp()
        else:
            now = store.now(conn)
        if mysql:
            role_wait = conn.exec_driver_sql("SELECT @@innodb_lock_wait_timeout").scalar_one()
            wait_s = int(min(max(lease.total_seconds() / 6, 1), 5))
            conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {wait_s}")
        try:
            done = conn.execute(
                update(runs)
                .where(
                    runs.c.id == claim.run_id,
                    runs.c.fence_token == claim.fence_token,
                    runs.c.state == "running",
                )
                .values(lease_expires_at=now + lease, updated_at=now)
            )
        finally:
            if mysql:
                conn.exec_driver_sql(
                    f"SET SESSION innodb_lock_wait_timeout = {int(role_wait)}")
        return done.rowcount == 1


def record_failure(
    store: Store,
    claim: Claim,
    error: str,
    *,
    retry_in_seconds: float | None = None,
    dead_reason: str | None = None,
    payload: Mapping[str, Any] | None = None,
    from_states: Sequence[str] = ("running",),
    ran_body: bool = True,
) -> str:
    """Record a failed try: ``retrying`` (a retry follows) or ``dead`` (+ dead letter).

    One short transaction, fenced on the run row (``WHERE fence_token = :mine AND state =
    'running'``). With ``dead_reason`` the run becomes ``dead`` and a
    ``reliable_beat_dead_letters`` row is inserted with ``payload`` (what a replay needs:
    ``{"task", "args", "kwargs", "key", "headers"}``); otherwise the run becomes
    ``retrying`` with its lease released and ``retry_at`` = now + ``retry_in_seconds``
    (when its retry is due: the re-dispatch sweep re-sends the run ``redispatch_seconds``
    after it if no worker took it up; ``redispatches``, its re-sends of this wait, starts
    at 0), and the attempt row records ``retry_in_seconds``.

    Args:
        store: the store.
        claim: the ``acquired`` claim that failed.
        error: the error text (type, message, traceback).
        retry_in_seconds: the countdown of the retry about to be sent.
        dead_reason: ``permanent`` or ``exhausted`` to dead-letter instead of retrying.
        payload: replay payload for the dead letter; defaults to the claim's call.
        from_states: states the run may be in (``running``; ``retrying`` to dead-letter a
            run whose retry message could not be published).
        ran_body: False when this claim did not run the body (it only found the budget
            spent, or refused the call): the claim's increment of ``runs.attempts`` is taken
            back, so ``runs.attempts``, the attempt row's number and
            ``dead_letters.attempts`` count the tries that ran the body.

    Returns:
        ``retrying``, ``dead``, or ``fenced_out`` when the fence moved (then nothing else is
        written: the newer runner owns the run; do not retry and do not dead-letter).
    """
    with store.begin() as conn:
        now = store.now(conn)
        state = "dead" if dead_reason else "retrying"
        values: dict[str, Any] = {
            "state": state,
            "error": error,
            "leased_by": None,
            "lease_expires_at": None,
            "updated_at": now,
        }
        if dead_reason:
            values.update(reason=dead_reason, finished_at=now)
        else:  # the retry is due then; the re-dispatch sweep re-sends it if nothing came,
            # its re-sends of this wait counted from 0 (a worker took the last message)
            values["retry_at"] = now + timedelta(seconds=max(float(retry_in_seconds or 0), 0))
            values["redispatches"] = 0
        tries = claim.attempt if ran_body else claim.attempt - 1
        if not ran_body:
            values["attempts"] = tries
        done = conn.execute(
            update(runs)
            .where(
                runs.c.id == claim.run_id,
                runs.c.fence_token == claim.fence_token,
                runs.c.state.in_(list(from_states)),
            )
            .values(**values)
        )
        if done.rowcount != 1:
            conn.execute(
                update(attempts)
                .where(attempts.c.id == claim.attempt_id)
                .values(outcome="fenced_out", finished_at=now, error=error)
            )
            return "fenced_out"
        conn.execute(
            update(attempts)
            .where(attempts.c.id == claim.attempt_id)
            .values(
                outcome=state,
                attempt=tries,
                finished_at=now,
                error=error,
                retry_in_seconds=None if dead_reason else retry_in_seconds,
            )
        )
        if dead_reason:
            conn.execute(
                dead_letters.insert().values(
                    kind="run",
                    run_id=claim.run_id,
                    key=claim.key,
                    entry_name=claim.entry_name,
                    task=claim.task,
                    payload=dict(payload) if payload is not None else {
                        "task": claim.task,
                        "args": list(claim.args),
                        "kwargs": dict(claim.kwargs or {}),
                        "key": claim.key,
                    },
                    reason=dead_reason,
                    error=error,
                    attempts=tries,
                    created_at=now,
                )
            )
            _workflow_hook(conn, claim.key, "dead", error=error)
        return state


def record_refused_message(
    store: Store, *, key: str, task: str, payload: Mapping[str, Any], error: str
) -> int:
    """Record a message the store can never take as a ``message`` dead letter.

    For a call whose key, entry name, task id or arguments the store refuses (too long,
    not storable): no run row can exist, so no attempt limit would ever apply and a retry
    could never succeed. The dead letter makes it visible (``dead-letters list``) and is
    not requeueable (fix the call and send it again). Long values are cut to the column
    sizes in the row; ``payload`` (JSON) keeps them whole. One short transaction.

    Returns:
        The dead letter's id.
    """
    from reliable_beat.values import MAX_IDEMPOTENCY_KEY, MAX_TASK_NAME, to_json_value

    def cut(value: str, limit: int) -> str:
        return value if len(value) <= limit else value[: limit - 14] + "...(truncated)"

    try:
        body = to_json_value(dict(payload), "payload")
    except ValueError:
        body = {"repr": repr(dict(payload))[:20000]}
    with store.begin() as conn:
        now = store.now(conn)
        result = conn.execute(
            dead_letters.insert().values(
                kind="message",
                key=cut(key.replace("\x00", ""), MAX_IDEMPOTENCY_KEY),
                task=cut(task, MAX_TASK_NAME),
                payload=body,
                reason="invalid",
                error=error.replace("\x00", ""),
                attempts=0,
                created_at=now,
            ).returning(dead_letters.c.id)
        )
        return int(result.scalar_one())


#: ``LeaseCleared.resend`` values: what :func:`release_lease` did about the run's message.
RESENT = "resent"
NOT_RESENT = "not_resent"
RESEND_SKIPPED = "skipped"


@dataclass(frozen=True)
class LeaseCleared:
    """The outcome of :func:`release_lease` (what ``reliable-beat lease clear`` prints).

    Attributes:
        key: the run's idempotency key.
        fence_token: the run's fence token after the clear (the old holder's + 1).
        previous_state: the run's state before (``running`` when a lease was held).
        state: the run's state after (``retrying`` for a run that was ``running``;
            otherwise unchanged).
        holder: ``leased_by`` before the clear (None: nobody held a lease).
        lease_expires_at: the cleared lease's end (UTC), or None.
        fenced_out_attempts: the holder's ``running`` attempt rows closed ``fenced_out``.
        resend: ``resent`` (the run's trigger outbox row is ``pending`` again, due now, in
            the clear's transaction: a relay or beat publishes it), ``not_resent`` (it
            could not be: :attr:`note` says why and what to do) or ``skipped`` (asked not
            to, or the run was not ``running``: nothing to re-send).
        message_id: the outbox message re-sent (``trigger:<key>``), when ``resent``.
        destination: its outbox destination (``celery``, ``dramatiq``), when ``resent``.
        note: one sentence on what happened to the run's message.
    """

    key: str
    fence_token: int
    previous_state: str
    state: str
    holder: str | None
    lease_expires_at: datetime | None
    fenced_out_attempts: int
    resend: str
    message_id: str | None
    destination: str | None
    note: str

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (instants stay datetimes)."""
        return {
            "key": self.key, "fence_token": self.fence_token,
            "previous_state": self.previous_state, "state": self.state,
            "holder": self.holder, "lease_expires_at": self.lease_expires_at,
            "fenced_out_attempts": self.fenced_out_attempts, "resend": self.resend,
            "message_id": self.message_id, "destination": self.destination,
            "note": self.note,
        }


def clear_lease(store: Store, key: str) -> int:
    """Free a lease and fence its holder out, re-sending nothing.

    :func:`release_lease` with ``resend=False`` (the testing kit's "the lease expired").

    Returns:
        The new fence token.

    Raises:
        RunNotFound: no run has ``key``.
    """
    return release_lease(store, key, resend=False).fence_token


def release_lease(store: Store, key: str, *, resend: bool = True) -> LeaseCleared:
    """Free a stuck lease: bump the fence so the old holder is fenced out, and re-send.

    The documented way out when a worker holds a lease it will never finish (a process
    frozen for hours with a long lease; ``reliable-beat lease clear``). In **one**
    transaction:

    * ``fence_token += 1``, ``leased_by`` / ``lease_expires_at`` cleared; a ``running`` run
      becomes ``retrying`` (other states are kept). The old holder's renewal then returns
      False and its commit raises :class:`StaleFenceToken` (everything it wrote rolls
      back), so the re-sent message's runner is the only one that can commit.
    * the holder's ``running`` attempt rows become ``fenced_out`` (``finished_at`` = now,
      the error names the clear), so the attempt history does not show a try running
      forever. (A holder that comes back records the same outcome again.)
    * with ``resend`` and a run that was ``running``: its trigger outbox row
      (``trigger:<key>``, destination ``celery`` / ``dramatiq``) is made ``pending`` again,
      due now (``available_at`` = the database's now, unclaimed; PostgreSQL: a ``NOTIFY``
      wakes the relays). A relay, or a beat's sweep of unsent triggers, publishes it: the
      same message (task id, idempotency key) as the first delivery, so a duplicate is
      deduplicated by the key. A crash after the commit loses nothing: the row is in the
      store. Not re-sent (``resend = not_resent``, :attr:`LeaseCleared.note` says why): a
      run with no trigger row (an ad-hoc call: its sender holds the message; a workflow
      activity: the workflow sweep re-sends it) and a trigger whose ``expires_at`` passed.

    Idempotent in effect (a second clear bumps the fence again and re-sends nothing: the
    run is no longer ``running``). Safe from several processes (the run row is locked on
    PostgreSQL and MySQL/MariaDB; SQLite serialises writers).

    Args:
        store: the store.
        key: the run's idempotency key.
        resend: re-send the run's trigger (default); False: only fence and free.

    Returns:
        The :class:`LeaseCleared` outcome (committed).

    Raises:
        RunNotFound: no run has ``key``.
        StoreUnavailableError: the database cannot be reached (nothing was changed).
    """
    from reliable_beat.db.tables import outbox

    with store.begin() as conn:
        now = store.now(conn)
        stmt = select(runs.c.id, runs.c.state, runs.c.fence_token, runs.c.leased_by,
                      runs.c.lease_expires_at).where(runs.c.idempotency_key == key)
        if store.dialect != "sqlite":
            stmt = stmt.with_for_update()
        row = conn.execute(stmt).one_or_none()
        if row is None:
            raise RunNotFound(f"no run with key {key!r}")
        fence = int(row.fence_token) + 1
        was_running = row.state == "running"
        new_state = "retrying" if was_running else row.state
        conn.execute(
            update(runs)
            .where(runs.c.id == row.id)
            .values(
                fence_token=fence,
                leased_by=None,
                lease_expires_at=None,
                state=new_state,
                updated_at=now,
                # a cleared run is due at once: the sweep re-sends it if nothing else does
                **({"retry_at": now, "redispatches": 0} if was_running else {}),
            )
        )
        holder = row.leased_by
        closed = conn.execute(
            update(attempts)
            .where(attempts.c.run_id == row.id, attempts.c.outcome == "running")
            .values(
                outcome="fenced_out",
                finished_at=now,
                error=f"lease of {holder or 'nobody'} cleared (`reliable-beat lease clear`): "
                f"fence token {row.fence_token} -> {fence}; this try can no longer commit "
                "(its writes roll back)",
            )
        ).rowcount or 0
        outcome: dict[str, Any] = {"resend": RESEND_SKIPPED, "message_id": None,
                                   "destination": None}
        if not was_running:
            note = (f"run was {row.state}, not running: nothing re-sent"
                    + (" (no worker holds it)" if row.state in _FREE_STATES else ""))
        elif not resend:
            note = ("not re-sent (--no-resend): the next delivery of its message (broker "
                    "redelivery, a retry) or the re-dispatch sweep runs it")
        else:
            mid = trigger_message_id(key)
            trig = conn.execute(
                select(outbox.c.id, outbox.c.destination, outbox.c.payload).where(
                    outbox.c.message_id == mid,
                    outbox.c.destination.in_(sorted(TRIGGER_DESTINATIONS)))
            ).first()
            expires = _trigger_expires_at(trig.payload) if trig is not None else None
            if trig is None:
                outcome["resend"] = NOT_RESENT
                note = ("not re-sent: the run has no trigger row to re-send ("
                        + ("a workflow activity: the workflow sweep re-sends it"
                           if key.startswith("wf:") else
                           "an ad-hoc call: its sender holds the message; call the task "
                           "again with the same idempotency key")
                        + ", or the broker redelivers it)")
            elif expires is not None and expires <= now:
                outcome["resend"] = NOT_RESENT
                note = (f"not re-sent: its trigger expired at {expires.isoformat()} (the "
                        "entry's `expires` option); the run stays retrying")
            else:
                conn.execute(
                    update(outbox).where(outbox.c.id == trig.id).values(
                        state="pending", available_at=now, claimed_by=None, sent_at=None,
                        last_error=None)
                )
                if store.dialect == "postgresql":
                    from reliable_beat.outbox import _notify_once

                    _notify_once(conn, trig.destination)
                outcome = {"resend": RESENT, "message_id": mid,
                           "destination": trig.destination}
                note = (f"re-sent: outbox row {mid!r} ({trig.destination}) is pending again, "
                        "due now; a relay or beat publishes it")
        return LeaseCleared(
            key=key, fence_token=fence, previous_state=str(row.state), state=str(new_state),
            holder=holder, lease_expires_at=row.lease_expires_at if was_running else None,
            fenced_out_attempts=int(closed), note=note, **outcome,
        )


def _trigger_expires_at(payload: Any) -> datetime | None:
    """A trigger payload's ``expires_at`` (ISO 8601 UTC text) as a datetime, or None."""
    text_value = payload.get("expires_at") if isinstance(payload, Mapping) else None
    if not isinstance(text_value, str):
        return None
    try:
        parsed = datetime.fromisoformat(text_value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def requeue_dead_letter(
    store: Store, dead_letter_id: int, *, by: str, force: bool = False
) -> dict[str, Any]:
    """Reset a dead run so it can run again under the same key (one short transaction).

    The run goes back to ``scheduled`` with ``attempts = 0`` (a fresh retry budget; fence
    tokens keep increasing, so old and new attempt rows stay distinguishable), its lease,
    error and reason cleared; the dead letter gets ``requeued_at`` / ``requeued_by`` and is
    kept (history is never deleted). The caller then sends the task again (the payload says
    how) and calls :func:`mark_dispatched`; if sending fails, :func:`undo_requeue`.

    Args:
        store: the store.
        dead_letter_id: ``reliable_beat_dead_letters.id``.
        by: who decided (recorded in ``requeued_by``).
        force: requeue even if this dead letter was requeued before.

    Returns:
        The dead letter as a dict (``payload`` holds ``task``, ``args``, ``kwargs``, ``key``).

    Raises:
        DeadLetterNotFound: no such id, or it is not a run dead letter.
        ValueError: already requeued (without ``force``), the run is not ``dead``, or
            its effect committed (a try completed, or outbox rows were written with it):
            running it again would repeat the effect, ``force`` or not.
    """
    with store.begin() as conn:
        now = store.now(conn)
        dl = conn.execute(
            select(dead_letters).where(dead_letters.c.id == dead_letter_id)
        ).mappings().one_or_none()
        if dl is None or dl["kind"] != "run":
            raise DeadLetterNotFound(f"no run dead letter with id {dead_letter_id}")
        committed = _committed_effect(conn, dl["run_id"])
        if committed:
            raise ValueError(
                f"dead letter {dead_letter_id}: the run's effect committed ({committed}); "
                "running it again would repeat the effect, so it is not requeued"
            )
        if dl["requeued_at"] is not None and not force:
            raise ValueError(
                f"dead letter {dead_letter_id} was requeued at {dl['requeued_at']} by "
                f"{dl['requeued_by']}; pass force to requeue again"
            )
        done = conn.execute(
            update(runs)
            .where(runs.c.id == dl["run_id"], runs.c.state == "dead")
            .values(
                state="scheduled",
                attempts=0,
                error=None,
                reason=None,
                leased_by=None,
                lease_expires_at=None,
                finished_at=None,
                updated_at=now,
            )
        )
        if done.rowcount != 1:
            raise ValueError(f"run of dead letter {dead_letter_id} is not dead; not requeued")
        conn.execute(
            update(dead_letters)
            .where(dead_letters.c.id == dead_letter_id)
            .values(requeued_at=now, requeued_by=by)
        )
        return dict(dl)


def _committed_effect(conn: Connection, run_id: int) -> str | None:
    """Evidence that run ``run_id``'s effect committed, or None.

    A try that completed (attempt outcome ``succeeded``) committed the effect with the key;
    an outbox row stamped with the run was written in the effect's transaction. Either
    means the body's work is done: repeating it would do it twice.
    """
    from reliable_beat.db.tables import outbox

    done = conn.execute(
        select(attempts.c.attempt).where(
            attempts.c.run_id == run_id, attempts.c.outcome == "succeeded"
        ).limit(1)
    ).first()
    if done is not None:
        return f"try {done.attempt} completed"
    sent = conn.execute(
        select(func.count()).select_from(outbox).where(outbox.c.run_id == run_id)
    ).scalar_one()
    if sent:
        return f"{sent} outbox row(s) were written with it"
    return None


def undo_requeue(store: Store, dead_letter_id: int) -> None:
    """Put a requeued run back to ``dead`` after the re-send failed (short transaction)."""
    with store.begin() as conn:
        dl = conn.execute(
            select(dead_letters.c.run_id).where(dead_letters.c.id == dead_letter_id)
        ).one()
        conn.execute(
            update(runs)
            .where(runs.c.id == dl.run_id, runs.c.state == "scheduled")
            .values(state="dead", reason="requeue_failed")
        )
        conn.execute(
            update(dead_letters)
            .where(dead_letters.c.id == dead_letter_id)
            .values(requeued_at=None, requeued_by=None)
        )


def mark_dispatched(store: Store, key: str) -> bool:
    """``scheduled -> dispatched`` after the task message was published (short transaction).

    Returns:
        True when the state changed (False if a worker already picked the run up).
    """
    with store.begin() as conn:
        now = store.now(conn)
        done = conn.execute(
            update(runs)
            .where(runs.c.idempotency_key == key, runs.c.state == "scheduled")
            .values(state="dispatched", dispatched_at=now, updated_at=now)
        )
        return done.rowcount == 1


# ---------------------------------------------------------------- queries (CLI) ----


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
