"""Sagas and cancellation: compensations recorded before the steps they undo, run in
reverse as ordinary keyed activities when the block fails; cooperative cancel, terminate,
and running a blocked workflow's recorded compensations from data alone.

::

    with ctx.saga() as saga:
        saga.compensate(cancel_authorization, order_id)   # recorded BEFORE the step
        ctx.activity(authorize, order_id, cents)
        saga.compensate(release_stock, order_id)
        ctx.activity(reserve_stock, order_id)

A compensation is a history event of kind ``compensation`` at the next position (its task
name and arguments are kept in the row: it is data). Its states: ``registered`` (recorded,
nothing sent) -> ``scheduled`` (its activity message is in the outbox, key
``wf:<id>/<run>#<seq of the compensation>``) -> ``completed`` | ``failed`` (dead-lettered);
``released`` when its block ended without an error (it will never run).

Once every compensation of a failed block completed, the failure was handled by design: the
dead letters of the block's failed activities are marked handled (``handled_at`` /
``handled_by``); they stay listed (``dead-letters list --handled``) but page no one.

When an ``Exception`` leaves the block (an :class:`ActivityError`, :class:`WorkflowCancelled`,
the workflow's own), ``Saga.__exit__``:

1. waits until every activity started inside the block has settled (completed or dead): a
   forward step still in flight (a cancel that interrupted its wait) must land before its
   compensation runs, so "cancel the authorization" can never run before a late
   "authorize" commits and leave the authorization standing;
2. runs the compensations registered in the block in reverse order, one at a time, each an
   ordinary ``IdempotentTask`` run (lease, fence, retries with full jitter, dead letter):
   dispatching one is a fenced transaction (event ``registered -> scheduled`` + its outbox
   message), its completion writes the event with its effect (the activity completion hook);
3. re-raises the original exception (the workflow ends ``failed`` with it, or ``cancelled``).

The compensations take no new positions, so a crash mid-undo replays to the same point and
goes on from the first compensation not ``completed``. A compensation that dead-letters
parks the workflow ``blocked`` (reason ``compensation_failed``), never silently ``failed``:
fix the cause, then ``reliable-beat workflows compensate ID`` (:func:`compensate`) requeues
it and runs the rest from the history alone, without the workflow's code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import select, update

from reliable_beat import outbox, runs, tracing, workflow_store
from reliable_beat.db.tables import dead_letters, workflow_events, workflows
from reliable_beat.db.tables import runs as runs_table
from reliable_beat.outbox import db_now
from reliable_beat.redaction import get_logger
from reliable_beat.workflows import _runtime, activities, crashes, history, lifecycle, tripwire
from reliable_beat.workflows._runtime import Event, Runtime
from reliable_beat.workflows.activities import ActivityHandle
from reliable_beat.workflows.errors import (
    EndWorkflow,
    FencedOut,
    WorkflowConflict,
    WorkflowNotFound,
    WorkflowUsageError,
)

if TYPE_CHECKING:
    from reliable_beat.db.dialects import Store

__all__ = ["Saga", "cancel", "cancel_requested", "compensate", "data_unwind_fn"]

log = get_logger("reliable_beat.workflows.saga")

#: ``cancel_requested`` values that make the advance run compensations from data (no code).
DATA_MODES = ("compensate", "cancel_data")


@contextmanager
def _engine_code() -> Iterator[None]:
    token = tripwire.in_workflow_code.set(False)
    try:
        yield
    finally:
        tripwire.in_workflow_code.reset(token)


def _task_name(task: Any) -> str:
    if not isinstance(task, str) and not callable(getattr(task, "returns", None)):
        raise WorkflowUsageError(
            f"compensation {getattr(task, 'name', task)!r} is not an IdempotentTask: a "
            "compensation runs as an activity whose completion writes the history with its "
            "effect; use @app.task(base=IdempotentTask, bind=True) (or give its name)"
        )
    return task if isinstance(task, str) else str(task.name)


class Saga:
    """A saga block (``with ctx.saga() as saga``); see the module docstring.

    Only ``Exception`` triggers the unwind; engine control flow (suspension, non-determinism,
    fencing: ``BaseException``) passes through untouched.
    """

    def __init__(self, rt: Runtime, *, parallel: bool = False,
                 continue_on_error: bool = False) -> None:
        self._rt = rt
        self._parallel = parallel
        self._continue_on_error = continue_on_error
        self._compensations: list[int] = []  # seqs of this block's compensation events
        self._start_seq = 0
        self._open = False

    def __enter__(self) -> Saga:
        self._start_seq = self._rt.seq
        self._open = True
        self._rt.open_sagas += 1
        return self

    def compensate(self, task: Any, *args: Any, queue: str | None = None,
                   **kwargs: Any) -> None:
        """Register ``task(*args, **kwargs)`` to undo the step that follows.

        Call it **before** the step it undoes: if the step's effect happened but the workflow
        never saw it complete (a crash, a cancel that interrupted the wait), the
        compensation still runs. So a compensation must be safe to repeat and must tolerate
        "nothing to undo" (e.g. cancel an authorization that was never made: a no-op).

        Args:
            task: an ``IdempotentTask`` or its registered name; it runs as an activity keyed
                ``wf:<id>/<run>#<seq of this registration>``.
            args / kwargs: JSON-serialisable arguments (stored in the history row).
            queue: the queue its message goes to (None: default routing).

        Raises:
            WorkflowUsageError: outside the ``with`` block, or ``task`` is a plain task.
            TypeError: arguments not JSON-serialisable.
            WorkflowValueError: arguments over the size limit as JSON (refused here, not
                when an unwind sends the compensation).
        """
        with _engine_code():
            if not self._open:
                raise WorkflowUsageError("saga.compensate(...) outside its `with ctx.saga()` "
                                         "block")
            self._register(_task_name(task), args, kwargs, queue)

    def _register(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  queue: str | None) -> None:
        rt = self._rt
        call = history.to_json([list(args), kwargs], f"compensation {name!r} arguments")
        # refused at registration: an unwind could not send it (a replayed registration
        # was checked when it was recorded)
        digest, recorded = rt.recorded_match("compensation", name, call)
        if not recorded:
            rt.check_size("compensation", name, call,
                          f"compensation {name!r} arguments (in their message)",
                          message=activities.activity_message(rt, name, call, queue))
        seq, digest, ev = rt.next("compensation", name, call, digest=digest)
        if ev is None:
            key = workflow_store.activity_key(rt.claimed.workflow_id, rt.claimed.run_no, seq)
            rt.record(seq, "compensation", name, digest, [*call, queue], state="registered",
                      run_key=key)
            rt.history[seq] = Event(seq, "compensation", name, digest, "registered", None,
                                    None, None, key)
        self._compensations.append(seq)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        self._open = False
        self._rt.open_sagas -= 1
        if exc is not None and not isinstance(exc, Exception):
            return False  # engine control flow: not a failure of the block
        with _engine_code():
            if exc is None:
                _release(self._rt, self._compensations)
                return False
            log.info("workflow %s: saga block failed (%s: %s); running %d compensations",
                     self._rt.claimed.workflow_id, type(exc).__name__, exc,
                     len(self._compensations))
            _unwind(self._rt, self._start_seq, self._compensations,
                    original=history.error_json(exc), parallel=self._parallel,
                    continue_on_error=self._continue_on_error)
        return False  # the original exception goes on


# ------------------------------------------------------------------ the unwind ----


def _fenced(rt: Runtime, write: Callable[[Any], None]) -> None:
    try:
        with rt.store.begin() as conn:
            history.fence_check(conn, rt.claimed)
            write(conn)
    except FencedOut as exc:
        raise rt.control(exc) from None


def _release(rt: Runtime, seqs: list[int]) -> None:
    """The block ended without an error: its compensations will never run."""
    open_ = [s for s in seqs if rt.history[s].state == "registered"]
    if not open_ or rt.dry_run:
        return

    def write(conn: Any) -> None:
        conn.execute(update(workflow_events)
                     .where(workflow_events.c.workflow_pk == rt.claimed.pk,
                            workflow_events.c.run_no == rt.claimed.run_no,
                            workflow_events.c.seq.in_(open_),
                            workflow_events.c.state == "registered")
                     .values(state="released", completed_at=db_now(conn)))

    _fenced(rt, write)
    for s in open_:
        ev = rt.history[s]
        rt.history[s] = Event(s, ev.kind, ev.name, ev.args_digest, "released", None, None,
                              None, ev.run_key)


def _unwind(rt: Runtime, start_seq: int, seqs: list[int],
            original: dict[str, str] | None, upto: int | None = None, *,
            parallel: bool = False, continue_on_error: bool = False) -> None:
    """Settle the block's in-flight activities, then run its compensations in reverse.
    Returns when all completed; raises Suspend (one is running) or EndWorkflow (blocked).

    ``parallel``: dispatch every compensation not yet sent at once (newest first), then wait
    for all of them to settle. ``continue_on_error``: a dead-lettered compensation does not
    stop the ones after it in the undo order. Either way, once every compensation that was
    to run has settled, any dead one blocks the workflow (``compensation_failed``, naming
    each): it never ends ``failed`` with an undo missing."""
    if rt.dry_run:
        raise rt.suspend("offline replay stops at a saga's compensations")
    rt.unwinding = True
    try:
        for s in range(start_seq + 1, (rt.seq if upto is None else upto) + 1):
            ev = rt.history.get(s)
            if ev is not None and ev.kind == "activity" and ev.state == "scheduled":
                done, _ = activities.resolve(rt, ActivityHandle(seq=s, name=str(ev.name),
                                                                key=str(ev.run_key)))
                if not done:
                    raise rt.suspend(f"saga: activity {ev.name} (seq {s}) must settle "
                                     "before its compensation runs")
        order = list(reversed(seqs))
        failed: list[int] = []
        if parallel:
            for c in order:
                ev = rt.history[c]
                if ev.state in ("registered", "released"):
                    _dispatch(rt, c, str(ev.name), str(ev.run_key))
            running = [c for c in order if _settle(rt, c) == "scheduled"]
            if running:
                names = ", ".join(f"{rt.history[c].name} (seq {c})" for c in running[:5])
                raise rt.suspend(f"saga: waiting for {len(running)} compensations running "
                                 f"in parallel: {names}")
            failed = [c for c in order if rt.history[c].state == "failed"]
        else:
            for i, c in enumerate(order):
                if _run_compensation(rt, c, between=i > 0) == "failed":
                    failed.append(c)
                    if not continue_on_error:
                        break
        if failed:
            _block_failed(rt, failed, original, stopped=not (parallel or continue_on_error))
        _mark_handled(rt, [s for s in range(start_seq + 1,
                                             (rt.seq if upto is None else upto) + 1)
                           if (ev := rt.history.get(s)) is not None
                           and ev.kind == "activity" and ev.state == "failed"])
    finally:
        rt.unwinding = False


def _mark_handled(rt: Runtime, seqs: list[int]) -> None:
    """Every compensation of the block completed: the dead letters of its failed activities
    (``seqs``) are failures the application handled by design. They stay dead letters
    (listed, requeueable) marked ``handled_at`` / ``handled_by``, so they page no one
    (``status --check``, the ``reliable_beat_dead_letters`` metric). A compensation that
    dead-lettered blocks the workflow before this: then nothing is marked, both page."""
    keys = [str(rt.history[s].run_key) for s in seqs if rt.history[s].run_key]
    if not keys:
        return
    by = (f"saga of workflow {rt.claimed.workflow_id} (run {rt.claimed.run_no}): "
          "its compensations completed")[:200]

    def write(conn: Any) -> None:
        dead_runs = select(runs_table.c.id).where(runs_table.c.idempotency_key.in_(keys),
                                                  runs_table.c.state == "dead")
        conn.execute(update(dead_letters)
                     .where(dead_letters.c.kind == "run",
                            dead_letters.c.run_id.in_(dead_runs),
                            dead_letters.c.handled_at.is_(None),
                            dead_letters.c.requeued_at.is_(None))
                     .values(handled_at=db_now(conn), handled_by=by))

    _fenced(rt, write)


def _settle(rt: Runtime, seq: int) -> str:
    """The state of a sent compensation, its completion read (and repaired) from its run
    when the event is still ``scheduled``; the history entry is updated."""
    ev = rt.history[seq]
    if ev.state == "scheduled":
        state, result, error = _settled(rt, seq, str(ev.run_key))
        if state != "scheduled":
            rt.history[seq] = Event(seq, ev.kind, ev.name, ev.args_digest, state, result,
                                    error, None, ev.run_key)
        return state
    return str(ev.state)


def _run_compensation(rt: Runtime, seq: int, *, between: bool) -> str:
    """Send the compensation at ``seq`` if not yet sent; its settled state (``completed``
    or ``failed``); raises Suspend while it runs."""
    ev = rt.history[seq]
    if ev.state == "completed":
        return "completed"
    if ev.state in ("registered", "released"):
        if between:
            crashes.crash_point("saga.between")
        _dispatch(rt, seq, str(ev.name), str(ev.run_key))
    state = _settle(rt, seq)
    if state == "scheduled":
        raise rt.suspend(f"saga: waiting for compensation {ev.name} (seq {seq})")
    return state


def _block_failed(rt: Runtime, failed: list[int], original: dict[str, str] | None,
                  *, stopped: bool) -> None:
    """Park the workflow ``blocked`` (``compensation_failed``) naming each dead-lettered
    compensation; ``stopped``: the ones after the (single) failed one have not run."""

    def one(seq: int) -> str:
        ev = rt.history[seq]
        err = ev.error or {}
        lines = [ln for ln in str(err.get("message") or "").strip().splitlines() if ln]
        cause = lines[-1] if lines else "no error text"  # the exception line, not the traceback
        return f"{ev.name} (seq {seq}, key {ev.run_key}) dead-lettered: {cause}"

    wid = rt.claimed.workflow_id
    if len(failed) == 1:
        head = f"compensation_failed: compensation {one(failed[0])}; "
    else:
        head = (f"compensation_failed: {len(failed)} compensations dead-lettered: "
                + "; ".join(one(s) for s in failed) + "; ")
    if stopped:
        tail = ("the compensations after it in the undo order have not run. Fix the cause, "
                f"then `reliable-beat workflows compensate {wid}` (requeues it and runs the "
                "rest from the history)")
    else:
        tail = ("the block's other compensations ran (parallel / continue_on_error). Fix the "
                f"cause, then `reliable-beat workflows compensate {wid}` (requeues the dead "
                "ones and runs them from the history)")
    reason = head + tail
    values: dict[str, Any] = {"state": "blocked", "block_reason": reason[:4000]}
    if original is not None:
        values["error"] = original  # what the workflow ends with once compensated
    raise rt.control(EndWorkflow(reason, **values))


def _dispatch(rt: Runtime, seq: int, name: str, key: str) -> None:
    """``registered -> scheduled`` + the compensation's activity message, one fenced txn."""
    def write(conn: Any) -> None:
        row = conn.execute(
            select(workflow_events.c.args, workflow_events.c.state)
            .where(workflow_events.c.workflow_pk == rt.claimed.pk,
                   workflow_events.c.run_no == rt.claimed.run_no,
                   workflow_events.c.seq == seq)
        ).one()
        if row.state not in ("registered", "released"):
            return  # already sent (another advance before us; we are fenced anyway)
        call = list(row.args or [[], {}, None])
        payload: dict[str, Any] = {"task": name, "args": call[0], "kwargs": call[1],
                                   "headers": {"reliable_beat_key": key, **tracing.carrier()}}
        if len(call) > 2 and call[2]:
            payload["options"] = {"queue": call[2]}
        conn.execute(update(workflow_events)
                     .where(workflow_events.c.workflow_pk == rt.claimed.pk,
                            workflow_events.c.run_no == rt.claimed.run_no,
                            workflow_events.c.seq == seq)
                     .values(state="scheduled", completed_at=None))
        outbox.add(conn, workflow_store.WAKE_DESTINATION, payload,
                   key=f"act:{key}:f{rt.claimed.fence_token}",
                   schedule_group=workflow_store.group_of(rt.claimed.workflow_id))
        crashes.crash_point("saga.dispatch.in")

    crashes.crash_point("saga.dispatch.before")
    with tracing.span(f"compensate {name}", kind="producer", attributes=tracing.attributes(
            seq=seq, key=key, outcome="scheduled")):  # its message carries this span
        _fenced(rt, write)
    crashes.crash_point("saga.dispatch.after")
    ev = rt.history[seq]
    rt.history[seq] = Event(seq, ev.kind, ev.name, ev.args_digest, "scheduled", None, None,
                            None, ev.run_key)


def _settled(rt: Runtime, seq: int, key: str) -> tuple[str, Any, Any]:
    """(state, result, error) of a dispatched compensation; repairs a missing completion
    from its run row (which committed with its effect), as activities do."""
    with rt.store.connect() as conn:
        event = conn.execute(
            select(workflow_events.c.state, workflow_events.c.result, workflow_events.c.error)
            .where(workflow_events.c.workflow_pk == rt.claimed.pk,
                   workflow_events.c.run_no == rt.claimed.run_no,
                   workflow_events.c.seq == seq)
        ).one()
        run = conn.execute(
            select(runs_table.c.state, runs_table.c.result, runs_table.c.error)
            .where(runs_table.c.idempotency_key == key)
        ).first()
    if event.state != "scheduled":
        return str(event.state), event.result, event.error
    if run is not None and run.state in ("succeeded", "dead"):
        state = "completed" if run.state == "succeeded" else "failed"
        error = None if state == "completed" else {"type": "dead",
                                                    "message": (run.error or "")[-2000:]}
        rt.complete(seq, state, run.result, error)
        return state, run.result, error
    return "scheduled", None, None


# ------------------------------------------------------------------ cancel ----


def cancel_requested(rt: Runtime) -> bool:
    """A cooperative cancel is pending for this run: asked for, not yet raised."""
    if any(ev.kind == "cancel" for ev in rt.history.values()):
        return False
    extra = rt.claimed.extra
    if "cancel_requested" in extra:
        # read by the claim, or again with the history after a wake during the advance (a
        # cancel bumps wake_seq, so one that arrives mid-advance is always read there)
        asked = extra["cancel_requested"]
    else:
        with rt.store.connect() as conn:
            asked = conn.execute(
                select(workflows.c.cancel_requested).where(workflows.c.id == rt.claimed.pk)
            ).scalar()
    return bool(asked == "cancel")


def data_unwind_fn(claimed: history.Claimed) -> Callable[..., Any] | None:
    """For the advance: the function to run instead of the workflow's code when a person
    asked for its compensations to run from data (``workflows compensate`` / ``cancel`` of a
    blocked workflow), else None."""
    mode = claimed.extra.get("cancel_requested")
    if mode not in DATA_MODES:
        return None

    def unwind_from_data(ctx: Any, *args: Any, **kwargs: Any) -> None:
        rt = _runtime.current()  # run as the workflow's code: its first argument is the ctx
        with _engine_code():
            comps = [s for s, ev in sorted(rt.history.items())
                     if ev.kind == "compensation" and ev.state != "released"]
            _unwind(rt, 0, comps, original=None, upto=max(rt.history, default=0))
            if mode == "cancel_data":
                raise rt.control(EndWorkflow(
                    "cancelled", state="cancelled",
                    error={"type": "WorkflowCancelled",
                           "message": "cancelled by a person while blocked; its recorded "
                                      f"compensations ran from data ({len(comps)})"}))
            with rt.store.connect() as conn:
                had = conn.execute(select(workflows.c.error)
                                   .where(workflows.c.id == rt.claimed.pk)).scalar()
            values: dict[str, Any] = {"state": "failed", "block_reason": None}
            if not had:
                values["error"] = {"type": "Compensated",
                                   "message": "a person ran its recorded compensations "
                                              f"from data ({len(comps)})"}
            raise rt.control(EndWorkflow("compensated", **values))

    return unwind_from_data


def cancel(store: Store, workflow_id: str, *, compensate: bool = True) -> dict[str, Any]:
    """Cancel a workflow (``reliable-beat workflows cancel ID [--no-compensate]``).

    * ``compensate=True`` (cooperative): the next advance raises
      :class:`~reliable_beat.workflows.errors.WorkflowCancelled` inside the workflow code at
      its next durable call (a wait in progress is interrupted), open sagas unwind, and the
      workflow ends ``cancelled``. A ``blocked`` workflow (its code cannot run) has its
      recorded compensations run from data instead, then ends ``cancelled``.
    * ``compensate=False`` (terminate): ``cancelled`` at once, in this transaction; the
      fence token is bumped so a running advance writes nothing more; no code and no
      compensation runs (activities already sent still run; their completions change
      nothing).

    Returns:
        ``{"workflow_id", "state", "changed", "message"}``; ``changed`` False (and a message
        saying so) when the workflow had already ended: cancelling it is a no-op.

    Raises:
        WorkflowNotFound: no such workflow.
    """
    with store.begin() as conn:
        now = db_now(conn)
        row = conn.execute(select(workflows.c.id, workflows.c.state, workflows.c.queue,
                                  workflows.c.cancel_requested)
                           .where(workflows.c.workflow_id == workflow_id)).first()
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r} (see `workflows list`)")
        live = workflows.c.state.not_in(history.TERMINAL_STATES)
        where = [workflows.c.id == row.id, live]
        if row.state in history.TERMINAL_STATES:
            return {"workflow_id": workflow_id, "state": row.state, "changed": False,
                    "message": f"workflow {workflow_id!r} already ended {row.state}: "
                               "nothing to cancel, nothing changed"}
        if not compensate:
            lifecycle.lock_for_end(conn, row.id)  # decides the race with a signal()
            done = conn.execute(update(workflows).where(*where).values(
                state="cancelled", cancel_requested="terminate",
                fence_token=workflows.c.fence_token + 1, leased_by=None,
                lease_expires_at=None, finished_at=now, updated_at=now,
                error={"type": "WorkflowTerminated",
                       "message": "terminated by a person (workflows cancel --no-compensate)"
                                  ": no code and no compensation ran"})).rowcount
            state, message = "cancelled", "terminated: cancelled, no compensation ran"
            if done:
                lifecycle.drop_wakes(conn, workflow_id)
            if done:  # a child's end wakes its parent in the same transaction, like finish
                lifecycle.notify_parent(conn, row.id, "cancelled", None,
                              {"type": "WorkflowTerminated", "message": message})
        elif row.state == "blocked" or row.cancel_requested in DATA_MODES:
            # its code cannot (or must not) run: the compensations run from data
            done = conn.execute(update(workflows).where(*where).values(
                state="waiting", cancel_requested="cancel_data", block_reason=None,
                wake_seq=workflows.c.wake_seq + 1, advances=0, updated_at=now)).rowcount
            workflow_store.add_wake(conn, workflow_id, row.queue, f"cancel{now.timestamp():.6f}")
            state = "waiting" if row.state == "blocked" else row.state
            message = ("cancel requested: its code cannot run (blocked, or compensating "
                       "from data), so its recorded compensations run from data, then it "
                       "ends cancelled")
        else:
            done = conn.execute(update(workflows).where(*where).values(
                cancel_requested="cancel", wake_seq=workflows.c.wake_seq + 1,
                updated_at=now)).rowcount
            workflow_store.add_wake(conn, workflow_id, row.queue, f"cancel{now.timestamp():.6f}")
            state = row.state
            message = ("cancel requested: the workflow sees WorkflowCancelled at its next "
                       "durable call, its sagas unwind, then it ends cancelled")
            if _compensating(conn, row.id):
                message = ("cancel requested, but the workflow is already compensating (a "
                           "saga unwinding after an error): its compensations go on and it "
                           "ends failed with that error; only if its code catches the error "
                           "does it see WorkflowCancelled at its next durable call and end "
                           "cancelled")
    if done != 1:  # it ended between our read and our write
        return cancel(store, workflow_id, compensate=compensate)
    return {"workflow_id": workflow_id, "state": state, "changed": True, "message": message}


def _compensating(conn: Any, pk: int) -> bool:
    """A saga of workflow ``pk``'s current run is unwinding in its code: a compensation has
    been dispatched and has not settled."""
    run_no = select(workflows.c.run_no).where(workflows.c.id == pk).scalar_subquery()
    return conn.execute(
        select(workflow_events.c.seq)
        .where(workflow_events.c.workflow_pk == pk, workflow_events.c.run_no == run_no,
               workflow_events.c.kind == "compensation",
               workflow_events.c.state == "scheduled").limit(1)).first() is not None


def compensate(store: Store, workflow_id: str, *, by: str = "workflows compensate"
               ) -> dict[str, Any]:
    """Run a ``blocked`` workflow's recorded, not yet completed compensations from data
    alone (``reliable-beat workflows compensate ID``), newest first, without its code.

    A compensation that dead-lettered is requeued first (its run reset under the same key,
    its dead letter marked requeued by ``by``; refused if its effect committed). The workflow
    goes to ``waiting`` with a wake; the advance runs the compensations one at a time as
    activities, then ends the workflow ``failed`` (keeping the error it failed with, if
    any). A compensation that dead-letters again blocks it again.

    Returns:
        ``{"workflow_id", "state", "pending": [{"seq", "name", "state"}], "requeued": [key]}``.

    Raises:
        WorkflowNotFound: no such workflow.
        WorkflowConflict: it is not ``blocked`` (a live workflow: use ``cancel``).
        ValueError: a dead compensation cannot be requeued (its effect committed).
    """
    with store.connect() as conn:
        row = conn.execute(select(workflows.c.id, workflows.c.state, workflows.c.run_no)
                           .where(workflows.c.workflow_id == workflow_id)).first()
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r} (see `workflows list`)")
        if row.state != "blocked":
            hint = ("it already ended: nothing to compensate" if row.state in
                    history.TERMINAL_STATES else "to stop a live workflow and unwind its "
                    "sagas use `workflows cancel ID`")
            raise WorkflowConflict(f"workflow {workflow_id!r} is {row.state}, not blocked: "
                                   f"`workflows compensate` runs a blocked workflow's "
                                   f"compensations; {hint}")
        comps = conn.execute(
            select(workflow_events.c.seq, workflow_events.c.name, workflow_events.c.state,
                   workflow_events.c.run_key)
            .where(workflow_events.c.workflow_pk == row.id,
                   workflow_events.c.run_no == row.run_no,
                   workflow_events.c.kind == "compensation",
                   workflow_events.c.state.not_in(("completed", "released")))
            .order_by(workflow_events.c.seq.desc())
        ).all()
    requeued = []
    for c in comps:
        if c.state != "failed":
            continue
        with store.connect() as conn:
            run = conn.execute(select(runs_table.c.id, runs_table.c.state,
                                      runs_table.c.result)
                               .where(runs_table.c.idempotency_key == c.run_key)).first()
        if run is not None and run.state == "succeeded":
            # requeued by hand (`dead-letters requeue`) and done since: record it, no rerun
            with store.begin() as conn:
                conn.execute(update(workflow_events)
                             .where(workflow_events.c.workflow_pk == row.id,
                                    workflow_events.c.run_no == row.run_no,
                                    workflow_events.c.seq == c.seq,
                                    workflow_events.c.state == "failed")
                             .values(state="completed", result=run.result, error=None,
                                     completed_at=db_now(conn)))
            continue
        with store.connect() as conn:
            dl = None if run is None else conn.execute(
                select(dead_letters.c.id).where(dead_letters.c.run_id == run.id)
                .order_by(dead_letters.c.id.desc()).limit(1)).scalar()
        if run is not None and run.state == "dead" and dl is not None:
            runs.requeue_dead_letter(store, int(dl), by=by, force=True)
            requeued.append(c.run_key)
        with store.begin() as conn:  # sent again by the advance (a new message id)
            conn.execute(update(workflow_events)
                         .where(workflow_events.c.workflow_pk == row.id,
                                workflow_events.c.run_no == row.run_no,
                                workflow_events.c.seq == c.seq,
                                workflow_events.c.state == "failed")
                         .values(state="registered", error=None, completed_at=None))
    with store.begin() as conn:
        now = db_now(conn)
        # no UPDATE ... RETURNING here: MariaDB has none
        changed = conn.execute(
            update(workflows)
            .where(workflows.c.id == row.id, workflows.c.state == "blocked")
            .values(state="waiting", cancel_requested="compensate", block_reason=None,
                    wake_seq=workflows.c.wake_seq + 1, advances=0, updated_at=now)
        ).rowcount
        if changed != 1:
            raise WorkflowConflict(f"workflow {workflow_id!r} changed state meanwhile; look "
                                   "again (`workflows show ID --events`)")
        done = conn.execute(select(workflows.c.queue, workflows.c.wake_seq)
                            .where(workflows.c.id == row.id)).one()
        workflow_store.add_wake(conn, workflow_id, done.queue, f"compensate{done.wake_seq}")
    return {"workflow_id": workflow_id, "state": "waiting",
            "pending": [{"seq": c.seq, "name": c.name, "state": c.state} for c in comps],
            "requeued": requeued}
