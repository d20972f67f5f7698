"""Runs: what the runner writes after its claim: fenced completion, lease renewal, failures.

Every write is fenced (``WHERE fence_token = :mine``); see :mod:`reliable_beat.runs`. An
activity of a durable workflow (key ``wf:...``) also writes its outcome into the workflow's
history in the same transaction (:func:`reliable_beat.workflow_store.on_run_finished`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cache
from typing import Any

from sqlalchemy import Select, bindparam, func, literal_column, null, select, true, update
from sqlalchemy.engine import Connection

from reliable_beat import rows as rows_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.driver import DriverStatement, uses_psycopg
from reliable_beat.db.tables import MYSQL_DIALECTS, attempts, dead_letters, runs
from reliable_beat.errors import StaleFenceToken
from reliable_beat.redaction import get_logger
from reliable_beat.runs.claim import Claim, db_now
from reliable_beat.values import MAX_IDEMPOTENCY_KEY, MAX_TASK_NAME, to_json_value
from reliable_beat.workflow_store import on_run_finished

__all__ = [
    "complete",
    "record_failure",
    "record_fenced_out",
    "record_refused_message",
    "renew_lease",
    "set_result",
]

log = get_logger("reliable_beat.runs")


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


#: :func:`_pg_complete_statement` run on the psycopg connection (reliable_beat.db.driver).
_PG_COMPLETE = DriverStatement(_pg_complete_statement)


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
        params = {"p_run_id": claim.run_id, "p_fence": claim.fence_token,
                  "p_attempt_id": claim.attempt_id, "p_result": result}
        row = (_PG_COMPLETE.first(conn, params) if uses_psycopg(conn)
               else conn.execute(_pg_complete_statement(), params).first())
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
    workflow's history in this same transaction (reliable_beat.workflow_store)."""
    if key.startswith("wf:"):
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
    store: Store, *, key: str, task: str, payload: Mapping[str, Any], error: str,
    reason: str = "invalid",
) -> int:
    """Record a message the store can never take as a ``message`` dead letter.

    For a call whose key, entry name, task id or arguments the store refuses (too long,
    not storable): no run row can exist, so no attempt limit would ever apply and a retry
    could never succeed. The dead letter makes it visible (``dead-letters list``) and is
    not requeueable (fix the call and send it again). Long values are cut to the column
    sizes in the row; ``payload`` (JSON) keeps them whole. One short transaction.

    ``reason``: ``invalid`` (above); a worker's hook also records a message it had to drop
    (:mod:`reliable_beat.celery.lost_messages`): ``unregistered`` (no task of that name in
    the worker: requeueable once it is registered), ``no_key`` (an ``IdempotentTask``
    or ``IdempotentActor`` message without an idempotency key), ``rejected`` (not a task
    message Celery can read).

    Returns:
        The dead letter's id.
    """

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
                reason=reason,
                error=error.replace("\x00", ""),
                attempts=0,
                created_at=now,
            ).returning(dead_letters.c.id)
        )
        return int(result.scalar_one())
