"""Runs: the claim (find or create the run, take its lease, bump its fence token).

:func:`claim_run` and the :class:`Claim` it returns; the run store's package
(:mod:`reliable_beat.runs`) documents the life of a run and the fencing rule.
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
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError
from sqlalchemy.types import Interval

from reliable_beat import rows as rows_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.driver import DriverStatement, uses_psycopg
from reliable_beat.db.tables import MYSQL_DIALECTS, attempts, runs
from reliable_beat.errors import RunNotFound
from reliable_beat.redaction import get_logger

__all__ = [
    "ACQUIRED",
    "ALREADY_SUCCEEDED",
    "BUSY",
    "DEAD",
    "MYSQL_DEADLOCK_RETRIES",
    "UNFINISHED_STATES",
    "Claim",
    "claim_run",
    "db_now",
    "format_error",
]

log = get_logger("reliable_beat.runs")

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

#: :func:`_pg_claim_statement` run on the psycopg connection (reliable_beat.db.driver).
_PG_CLAIM = DriverStatement(_pg_claim_statement)


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


def _claim_in_one_statement(conn: Connection, params: dict[str, Any]) -> Any:
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
            if uses_psycopg(conn):
                row = _PG_CLAIM.first(conn, params)
            else:
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

