"""The advance: claim a workflow, replay its history through its code, record the frontier,
release it (or end it). Also the offline replay check (``reliable-beat workflows replay``).

The protocol (docs/workflows.md):

1. **claim**: ``UPDATE workflows SET fence_token = fence_token + 1, lease_expires_at = db now
   + lease, state = 'running', claimed_wake_seq = wake_seq WHERE workflow_id = :id AND state
   IN ('pending', 'waiting', 'running') AND (lease_expires_at IS NULL OR lease_expires_at <
   db now)``. No row: someone holds a live lease (it will see our ``wake_seq`` bump; a
   signal on PostgreSQL may have skipped its bump, so a busy advance that finds an
   unconsumed signal bumps it itself: :func:`_nudge_holder`) or the workflow is terminal /
   blocked.
2. **load** the run's events (the worker that answers its own activity's completion may
   take them from its cache: :mod:`reliable_beat.workflows.sticky`, and its claim is then a
   statement of its own, :func:`_claim_alone`), **run** the function from the top with a
   :class:`~reliable_beat.workflows.context.WorkflowContext`: recorded calls are answered from
   the history, the first unrecorded call (the frontier) is recorded in one transaction that
   starts with the fence check (``UPDATE ... WHERE fence_token = :mine``) and holds whatever it
   dispatches (activity run message, timer wake row).
3. **release**: ``UPDATE ... SET state = 'waiting', lease NULL WHERE fence_token = :mine AND
   wake_seq = :seen``; zero rows with our fence means something woke the workflow while we
   ran: run again (bounded), so no wake-up is lost.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from functools import cache
from typing import Any

from sqlalchemy import (
    Integer,
    Interval,
    Select,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection

from reliable_beat import handoff, tracing
from reliable_beat.db.dialects import Store, update_returning
from reliable_beat.db.driver import DriverStatement, uses_psycopg
from reliable_beat.db.tables import workflow_signals, workflows
from reliable_beat.outbox import db_now
from reliable_beat.redaction import get_logger
from reliable_beat.workflow_store import add_wake, now_sql
from reliable_beat.workflows import malformed, pg_statements, runaway, saga, sticky
from reliable_beat.workflows.context import WorkflowContext
from reliable_beat.workflows.crashes import crash_point
from reliable_beat.workflows.errors import WorkflowNotFound
from reliable_beat.workflows.history import ACTIVE_STATES, Claimed, first, load_history
from reliable_beat.workflows.lifecycle import block
from reliable_beat.workflows.registry import WorkflowDefinition, _registry, version_block_reason

__all__ = ["MAX_LOOPS", "advance", "record_first_version", "replay_check"]

log = get_logger("reliable_beat.workflows")

#: Advance loops (a wake arrived while running) before the advance hands over to a message.
MAX_LOOPS = 20


def _traced_advance(fn: Callable[..., str]) -> Callable[..., str]:
    """``advance`` in an ``advance workflow <name>`` span of the workflow's trace (the
    traceparent stored at start / continue-as-new), its outcome as ``reliable_beat.outcome``:
    activities, timers, signals and compensations it schedules are delivered under it."""
    @functools.wraps(fn)
    def traced(store: Store, workflow_id: str, **kwargs: Any) -> str:
        if tracing.tracer() is None:
            return fn(store, workflow_id, **kwargs)
        with store.connect() as conn:
            row = conn.execute(select(workflows.c.name, workflows.c.run_no,
                                      workflows.c.traceparent)
                               .where(workflows.c.workflow_id == workflow_id)).first()
        name = row.name if row is not None else "?"
        with tracing.span(f"advance workflow {name}", parent=row and row.traceparent,
                          root=True, attributes=tracing.attributes(
                              workflow_id=workflow_id,
                              workflow_run=row.run_no if row is not None else None)) as s:
            outcome = fn(store, workflow_id, **kwargs)
            s.set_attribute(tracing.OUTCOME, outcome)
            return outcome
    return traced



def _claim(store: Store, workflow_id: str, owner: str, lease: timedelta,
           max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS) -> Claimed | str:
    """The claim transaction; on success it also loads the run's history (same connection,
    same transaction: one checkout instead of two per advance). The advance that answers
    its own activity's completion with the history in this process's cache claims in one
    autocommit statement instead (:func:`_claim_alone`; psycopg).

    A row or history that is malformed (changed by SQL: a JSON column that does not decode,
    a value of the wrong shape, an unknown event kind or state) parks the workflow
    ``blocked`` with a reason naming the column (:mod:`reliable_beat.workflows.malformed`)
    and returns ``"blocked"``: its code never replays garbage.

    A ``running`` workflow whose advance's lease expired after ``max_takeovers`` takeovers
    is parked ``blocked`` instead (:func:`reliable_beat.workflows.runaway.park_expired`)."""
    try:
        return _claim_tx(store, workflow_id, owner, lease, max_takeovers)
    except ValueError:  # json.JSONDecodeError of a JSON column, raised while reading it
        with store.begin() as conn:
            found = malformed.block_undecodable(conn, workflow_id, ACTIVE_STATES)
        if found is None:
            raise
        return found[0]


@cache
def _pg_claim_statement() -> Select[Any]:
    """The claim of :func:`_claim_tx` (the same UPDATE, the clock inside it) as one
    select returning the whole row::

        WITH c AS (UPDATE workflows SET takeovers = ..., fence_token = fence_token + 1,
                          leased_by = :owner, lease_expires_at = clock_timestamp() + :lease,
                          state = 'running', claimed_wake_seq = wake_seq,
                          advances = advances + 1, updated_at = clock_timestamp()
                   WHERE workflow_id = :id AND state IN (active states)
                     AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
                     AND (state != 'running' OR takeovers < :max_takeovers)
                   RETURNING *)
        SELECT * FROM c
    """
    now = func.clock_timestamp()
    c = (
        update(workflows)
        .where(
            workflows.c.workflow_id == bindparam("p_workflow_id",
                                                 type_=workflows.c.workflow_id.type),
            # the states as literals: an expanding IN cannot be fixed SQL
            workflows.c.state.in_([literal_column(f"'{s}'") for s in ACTIVE_STATES]),
            or_(workflows.c.lease_expires_at.is_(None), workflows.c.lease_expires_at < now),
            runaway.may_take_over(bindparam("p_max_takeovers", type_=Integer())),
        )
        .ordered_values(
            (workflows.c.takeovers, runaway.takeovers_after_claim()),
            (workflows.c.fence_token, workflows.c.fence_token + 1),
            (workflows.c.leased_by, bindparam("p_owner", type_=workflows.c.leased_by.type)),
            (workflows.c.lease_expires_at, now + bindparam("p_lease", type_=Interval())),
            (workflows.c.state, literal_column("'running'")),
            (workflows.c.claimed_wake_seq, workflows.c.wake_seq),
            (workflows.c.advances, workflows.c.advances + 1), (workflows.c.updated_at, now),
        )
        .returning(*workflows.c)
        .cte("c")
    )
    return select(*c.c)


#: :func:`_pg_claim_statement` on the psycopg connection (reliable_beat.db.driver)
_PG_CLAIM = DriverStatement(_pg_claim_statement)


def _pg_claim(conn: Connection, workflow_id: str, owner: str, lease: Any,
              max_takeovers: int) -> Any:
    """The claim; the claimed row (all columns), or None when not claimed."""
    return _PG_CLAIM.first(conn, {"p_workflow_id": workflow_id, "p_owner": owner,
                                  "p_lease": lease, "p_max_takeovers": max_takeovers})


def _claim_statement(conn: Connection, workflow_id: str, owner: str, lease: timedelta,
                     max_takeovers: int, now: Any) -> tuple[Any, bool]:
    """The claim's UPDATE built per call (every dialect but psycopg's); (the row when the
    dialect returns it, claimed?)."""
    stmt = (
        update(workflows)
        .where(
            workflows.c.workflow_id == workflow_id,
            workflows.c.state.in_(ACTIVE_STATES),
            or_(workflows.c.lease_expires_at.is_(None), workflows.c.lease_expires_at < now),
            runaway.may_take_over(max_takeovers),
        )
        .ordered_values(  # takeovers first: MySQL sets left to right (its CASE reads state)
            (workflows.c.takeovers, runaway.takeovers_after_claim()),
            (workflows.c.fence_token, workflows.c.fence_token + 1),
            (workflows.c.leased_by, owner), (workflows.c.lease_expires_at, now + lease),
            (workflows.c.state, "running"),
            (workflows.c.claimed_wake_seq, workflows.c.wake_seq),
            (workflows.c.advances, workflows.c.advances + 1), (workflows.c.updated_at, now),
        )
    )
    if conn.dialect.update_returning:  # PostgreSQL, SQLite: the row in one statement
        row = conn.execute(stmt.returning(*workflows.c)).first()
        done = row is not None
    else:
        done = conn.execute(stmt).rowcount == 1
        row = None
    return row, done


def _claim_tx(store: Store, workflow_id: str, owner: str, lease: timedelta,
              max_takeovers: int) -> Claimed | str:
    # the completion this process committed right before, when this advance answers its wake
    wake = handoff.answering(workflow_id)
    known = (None if wake is None or wake.event is None
             else (wake.run_no, wake.wake_seq, wake.event))
    url = str(store.engine.url)
    if known is not None and sticky.expects(url, workflow_id, known):
        got = _claim_alone(store, workflow_id, owner, lease, max_takeovers, url, known)
        if got is not None:
            return got
    with store.begin() as conn:
        pg = conn.dialect.name == "postgresql"
        # PostgreSQL: the clock inside the claim statement (no round trip of its own)
        now: Any = func.clock_timestamp() if pg else db_now(conn)
        if uses_psycopg(conn):  # the same statement, fixed SQL on the driver connection
            row = _pg_claim(conn, workflow_id, owner, lease, max_takeovers)
            done = row is not None
        else:
            row, done = _claim_statement(conn, workflow_id, owner, lease, max_takeovers, now)
        if row is None:
            row = conn.execute(
                select(workflows).where(workflows.c.workflow_id == workflow_id)
            ).first()
        if row is None:
            return "missing"
        if pg:  # the clock the claim read (or, not claimed, read it now)
            now = row.updated_at if done else db_now(conn)
        if not done:
            if row.state == "running" and runaway.park_expired(conn, row, now, max_takeovers):
                return "blocked"
            return "busy" if row.state in ACTIVE_STATES else row.state  # type: ignore[no-any-return]
        return _claimed(conn, row, workflow_id, owner, lease, now, url, known)


def _claim_alone(store: Store, workflow_id: str, owner: str, lease: timedelta,
                 max_takeovers: int, url: str, known: tuple[Any, Any, Any],
                 ) -> Claimed | str | None:
    """psycopg, an advance answering the completion this process committed, whose history
    this process holds (:func:`reliable_beat.workflows.sticky.expects`): the claim as a
    statement of its own (autocommit, no BEGIN and COMMIT round trips), as the claim
    transaction would run it with nothing else to read. What the claimed row says decides
    (:func:`_claimed`): the history from the cache, or read now (after the claim's commit,
    under its lease, as an advance re-reads it after a wake); a malformed row is parked
    ``blocked`` under the claim's fence token. None: not claimed (busy, parked, ended: the
    claim transaction decides, as for any advance)."""
    with store.connect() as conn:
        if not uses_psycopg(conn):
            return None
        raw: Any = conn.connection.dbapi_connection
        raw.autocommit = True  # the driver's flag: no round trip either way
        try:
            row = _pg_claim(conn, workflow_id, owner, lease, max_takeovers)
        except BaseException:
            _leave_autocommit(conn, raw, failing=True)
            raise
        _leave_autocommit(conn, raw, failing=False)
        if row is None:
            return None
        with conn.begin():  # no statement, no round trip, unless the cache does not fit
            return _claimed(conn, row, workflow_id, owner, lease, row.updated_at, url, known)


def _leave_autocommit(conn: Connection, raw: Any, *, failing: bool) -> None:
    """Clear ``raw.autocommit``; when it cannot be cleared (a broken connection), invalidate
    ``conn`` so the pool discards it (never pooled in autocommit), and raise unless an error
    is already on its way (as :mod:`reliable_beat.runs.claim` does)."""
    try:
        raw.autocommit = False
    except Exception:
        if not conn.invalidated:
            conn.invalidate()
        if not failing:
            raise


def _claimed(conn: Connection, row: Any, workflow_id: str, owner: str, lease: timedelta,
             now: Any, url: str, known: tuple[Any, Any, Any] | None) -> Claimed | str:
    """The claimed ``row``'s history and shape check (in ``conn``'s transaction); the
    :class:`Claimed`, or ``"blocked"`` (a malformed row, parked under the claim's fence
    token), or ``"fenced"`` (a newer claim took it meanwhile)."""
    # this process's sticky cache and the events changed since, or the whole history
    cache_key = (url, int(row.id), workflow_id, row.created_at)
    history = sticky.read_history(
        conn, cache_key, int(row.run_no), int(row.fence_token), int(row.claimed_wake_seq),
        int(row.history_len), known=known)
    args = [] if row.args is None else row.args
    kwargs = {} if row.kwargs is None else row.kwargs
    problem = malformed.shape_problem(workflow_id, int(row.run_no), args, kwargs, history)
    if problem is not None:  # we hold the claim: block it (in this transaction)
        why = malformed.reason(workflow_id, problem)
        log.error("workflow %s blocked: %s", workflow_id, why)
        done = conn.execute(update(workflows).where(
            workflows.c.id == row.id, workflows.c.fence_token == row.fence_token).values(
            state="blocked", block_reason=why[:4000], leased_by=None,
            lease_expires_at=None, updated_at=now)).rowcount
        return "blocked" if done == 1 else "fenced"
    return Claimed(
        pk=row.id, workflow_id=workflow_id, name=row.name, run_no=row.run_no,
        args=list(args), kwargs=dict(kwargs), queue=row.queue,
        random_seed=int(row.random_seed), fence_token=int(row.fence_token),
        seen_wake_seq=int(row.claimed_wake_seq), history_len=int(row.history_len),
        history_bytes=int(row.history_bytes), owner=owner, lease=lease,
        version=row.version,
        extra={"cancel_requested": row.cancel_requested,
               "schedule_group": row.schedule_group},
        history=history, cache_key=cache_key,
    )



def _nudge_holder(store: Store, workflow_id: str) -> bool | None:
    """An advance found the workflow busy (another advance holds a live lease): make sure
    the holder sees the signals committed before this wake (PostgreSQL).

    :func:`signal` skips its ``wake_seq`` bump when the row is locked, so the holder's
    release (``WHERE wake_seq = :seen``) would not notice a signal that committed after it
    last read the inbox. If the workflow has an unconsumed signal, bump ``wake_seq`` here
    (this is a worker: it may wait for the holder's row lock), only while the lease is
    still live: the holder then runs its code again and reads the inbox.

    Returns:
        True: bumped; False: nothing to tell (no unconsumed signal, or not PostgreSQL,
        where every signal bumps); None: the lease is no longer live (released, ended or
        expired): claim again.
    """
    if store.dialect != "postgresql":
        return False
    with store.begin() as conn:
        now = db_now(conn)
        pk = conn.execute(select(workflows.c.id)
                          .where(workflows.c.workflow_id == workflow_id)).scalar()
        if pk is None:
            return False
        unread = conn.execute(
            select(workflow_signals.c.id).where(workflow_signals.c.workflow_pk == pk,
                                                workflow_signals.c.consumed_seq.is_(None))
            .limit(1)
        ).first()
        if unread is None:
            return False
        done = conn.execute(
            update(workflows)
            .where(workflows.c.id == pk, workflows.c.state == "running",
                   workflows.c.lease_expires_at >= now)
            .values(wake_seq=workflows.c.wake_seq + 1)
        ).rowcount
    return True if done == 1 else None



def _release_and_mark(conn: Connection, pk: int, fence_token: int, seen_wake_seq: int,
                      ids: list[int]) -> bool:
    """psycopg: the release and the marks of the rows ``ids`` in one statement (the release
    alone when there is nothing to mark)."""
    if ids:
        return pg_statements.release_and_mark(conn, pk, fence_token, seen_wake_seq, ids)
    return pg_statements.release(conn, pk, fence_token, seen_wake_seq)


def record_first_version(store: Store, claimed: Claimed, version: str) -> None:
    """Record ``version`` on a run that has none and no history yet (fenced; a run that has
    recorded events keeps its missing version: it was started by unversioned code)."""
    with store.begin() as conn:
        done = conn.execute(
            update(workflows)
            .where(workflows.c.id == claimed.pk,
                   workflows.c.fence_token == claimed.fence_token,
                   workflows.c.version.is_(None), workflows.c.history_len == 0,
                   workflows.c.run_no == 1)
            .values(version=version)
        ).rowcount
    if done == 1:
        claimed.version = version

@_traced_advance
def advance(
    store: Store,
    workflow_id: str,
    *,
    owner: str,
    lease: timedelta = timedelta(seconds=60),
    max_loops: int = MAX_LOOPS,
    code_timeout: timedelta | None = timedelta(seconds=runaway.DEFAULT_CODE_TIMEOUT_SECONDS),
    max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS,
) -> str:
    """Advance one workflow as far as it can go now; the body of the advance task.

    Claims the workflow (fence + lease on the store's clock), replays its history through
    the registered function, records the frontier, and releases it (``waiting``) or ends it
    (``completed`` / ``failed`` / ``blocked``). Safe to call any number of times, from any
    number of processes: a second caller finds the lease held and returns ``"busy"`` (the
    holder sees the ``wake_seq`` bump that sent the second message).

    Args:
        store: the store.
        workflow_id: the business id.
        owner: this process's name, written to ``leased_by``.
        lease: how long the claim lasts without a write (each record renews it).
        max_loops: re-runs within this advance when wakes arrive while it runs.
        code_timeout: the longest the workflow function may run between two durable calls
            (``reliable_beat_workflow_code_timeout_seconds``); past it the advance is
            interrupted and the workflow parked ``blocked``. None: never interrupted.
        max_takeovers: a ``running`` workflow whose advance's lease expired this many
            takeovers in a row is parked ``blocked`` instead of claimed
            (``reliable_beat_workflow_max_takeovers``; :mod:`reliable_beat.workflows.runaway`).

    Returns:
        ``waiting``, ``completed``, ``failed``, ``blocked``, ``busy`` (another advance holds
        a live lease), ``fenced`` (a newer advance took over mid-way; this one wrote nothing
        after that), ``missing``, or the terminal state found.
    """
    crash_point("advance.before_claim")
    claimed = _claim(store, workflow_id, owner, lease, max_takeovers)
    for _ in range(3):
        if claimed != "busy" or _nudge_holder(store, workflow_id) is not None:
            break
        claimed = _claim(store, workflow_id, owner, lease, max_takeovers)  # holder let go
    if isinstance(claimed, str):
        return claimed
    crash_point("advance.after_claim")
    definition = _registry.get(claimed.name)
    data_fn = saga.data_unwind_fn(claimed)  # `workflows compensate`: no code runs
    if data_fn is not None:
        definition = WorkflowDefinition(name=claimed.name, fn=data_fn)
    if definition is None:
        return block(
            store, claimed,
            f"unknown workflow {claimed.name!r}: no @workflow with that name is registered in "
            f"this process ({owner}); deploy the code, then `workflows resume`",
        )
    if claimed.version is None and definition.version is not None:
        # started by a process that does not register the workflow (start by name): the
        # first advance, before anything is recorded, records the version it runs under
        record_first_version(store, claimed, definition.version)
    too_old = version_block_reason(definition, claimed.version)
    if too_old:
        return block(store, claimed, too_old)
    for _ in range(max_loops):
        history, claimed.history = claimed.history, None
        if history is None:  # a wake arrived while the code ran: read what it brought
            with store.connect() as conn:
                history = load_history(conn, claimed.pk, claimed.run_no)
                # a `workflows cancel` is such a wake (it bumps wake_seq): read its request
                # on the same connection, so the code's cancel check needs no query of its own
                claimed.extra["cancel_requested"] = conn.execute(
                    select(workflows.c.cancel_requested).where(workflows.c.id == claimed.pk)
                ).scalar()
        loaded = dict(history)  # as read from the store (the code's runtime changes its own)
        ctx = WorkflowContext(store, claimed, history, definition, code_timeout=None
                              if code_timeout is None else code_timeout.total_seconds())
        outcome = ctx.run_code(definition.fn)
        if outcome != "suspended":
            return outcome
        crash_point("advance.before_release")
        released = False
        with store.begin() as conn:
            if uses_psycopg(conn):  # the same statements, one fixed SQL on the driver:
                # the release and the marks of the messages this advance published (and
                # of the wake it answers: reliable_beat.handoff)
                released = bool(handoff.mark_in(
                    conn, functools.partial(_release_and_mark, conn, claimed.pk,
                                            claimed.fence_token, claimed.seen_wake_seq)))
            else:
                released = conn.execute(
                    update(workflows)
                    .where(
                        workflows.c.id == claimed.pk,
                        workflows.c.fence_token == claimed.fence_token,
                        workflows.c.wake_seq == claimed.seen_wake_seq,
                    )
                    .values(state="waiting", leased_by=None, lease_expires_at=None,
                            updated_at=now_sql(conn))
                ).rowcount == 1
                # the messages this advance published (and the wake it answers) are
                # marked sent here, not in transactions of their own
                handoff.mark_in(conn)
            if not released:
                now = db_now(conn)
                row = first(update_returning(
                    conn,
                    update(workflows)
                    .where(workflows.c.id == claimed.pk,
                           workflows.c.fence_token == claimed.fence_token)
                    .values(claimed_wake_seq=workflows.c.wake_seq,
                            lease_expires_at=now + lease, updated_at=now),
                    workflows, [workflows.c.wake_seq],
                ))
                if row is None:
                    return "fenced"
                claimed.seen_wake_seq = int(row.wake_seq)
        if released:
            if claimed.cache_key is not None:  # committed: the next advance here reads less
                sticky.remember(claimed.cache_key, claimed.run_no, claimed.fence_token,
                                claimed.seen_wake_seq, loaded, history)
            return "waiting"
    # woken max_loops times in a row: hand over to a fresh message rather than spin here
    with store.begin() as conn:
        now = db_now(conn)
        done = conn.execute(
            update(workflows)
            .where(workflows.c.id == claimed.pk, workflows.c.fence_token == claimed.fence_token)
            .values(state="waiting", leased_by=None, lease_expires_at=None, updated_at=now)
        ).rowcount
        if done != 1:
            return "fenced"
        handoff.mark_in(conn)
        add_wake(conn, workflow_id, claimed.queue, f"loop{claimed.fence_token}")
    return "waiting"


def replay_check(store: Store, workflow_id: str) -> str | None:
    """Run this process's code of a workflow against its stored history, writing nothing.

    Returns:
        None when the code matches the history up to its frontier (and, for an ended
        workflow, to the end), else the first mismatch naming the position and both sides
        (also when the workflow's name is not registered here).
    """
    with store.connect() as conn:
        rows = malformed.lenient_select(
            conn, select(workflows).where(workflows.c.workflow_id == workflow_id))
        if not rows:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        row = rows[0]
        try:
            history = load_history(conn, row.id, row.run_no)
        except ValueError:
            history = None
        problem = malformed.decode_problem(conn, int(row.id), workflow_id, int(row.run_no))
    if problem is None and history is not None:
        problem = malformed.shape_problem(workflow_id, int(row.run_no),
                                          [] if row.args is None else row.args,
                                          {} if row.kwargs is None else row.kwargs, history)
    if problem is not None or history is None:
        return malformed.reason(workflow_id, problem or "a history event does not decode")
    definition = _registry.get(row.name)
    if definition is None:
        return f"workflow name {row.name!r} is not registered in this process"
    claimed = Claimed(
        pk=row.id, workflow_id=workflow_id, name=row.name, run_no=row.run_no,
        args=list(row.args or []), kwargs=dict(row.kwargs or {}), queue=row.queue,
        random_seed=int(row.random_seed), fence_token=int(row.fence_token),
        seen_wake_seq=int(row.wake_seq), history_len=int(row.history_len),
        history_bytes=int(row.history_bytes), owner="replay", lease=timedelta(0),
        version=row.version,
    )
    too_old = version_block_reason(definition, row.version)
    if too_old:
        return too_old
    ctx = WorkflowContext(store, claimed, history, definition, dry_run=True)
    return ctx.replay_code(definition.fn)

