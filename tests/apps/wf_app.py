"""Celery app of the workflow acceptance tests (real workers, relay, PostgreSQL, Redis).

Environment: ``RB_BROKER_URL``, ``RB_DATABASE_URL``, ``RB_LEASE_SECONDS`` (default 2),
``RB_WF_QUEUE`` (the per-test queue of advances and activities), ``RB_WF_CODE_TIMEOUT`` /
``RB_WF_MAX_TAKEOVERS`` / ``RB_WF_PENDING_ALARM`` (the runaway guards), and for crash tests
``RB_WF_KILL_AT`` / ``RB_WF_KILL_FILE`` (see :func:`reliable_beat.workflows.engine.crash_point`).

Four workflow shapes, each touching every kind of durable call it can:

* ``wfa.linear``: transaction -> activity -> step -> sleep 1 s -> activity;
* ``wfa.fanout``: three activities started together, ``wait_all``, then a transaction;
* ``wfa.signal``: activity -> ``wait_signal("go")`` -> transaction -> ``now``;
* ``wfa.race``: two activities started together, ``wait_any``, ``wait_all``, a transaction.

Effects: ``wf_effects`` rows (kind, key, pid) with no unique constraint: only the engine's
fencing and the activities' keys keep transaction and activity effects single.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from celery import Celery

from reliable_beat import handoff
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.workflows import WorkflowContext, engine, workflow

meta = sa.MetaData()
wf_effects = sa.Table(
    "wf_effects", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("key", sa.String(400), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)

QUEUE = os.environ.get("RB_WF_QUEUE", "workflows")

app = Celery("wf_app", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.update(
    broker_transport_options={
        "visibility_timeout": 5, "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1, "unacked_mutex_expire": 3,
    },
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    task_default_queue=QUEUE,
    reliable_beat_database_url=os.environ.get("RB_DATABASE_URL", "sqlite:///wf.sqlite3"),
    reliable_beat_lease_seconds=float(os.environ.get("RB_LEASE_SECONDS", "2")),
    reliable_beat_redispatch_seconds=float(os.environ.get("RB_REDISPATCH_SECONDS", "8")),
    reliable_beat_retry_max_attempts=6,
    reliable_beat_retry_base_seconds=0.5,
    reliable_beat_retry_cap_seconds=2.0,
    # the runaway guards (tests/acceptance/test_workflow_runaway.py sets them short)
    reliable_beat_workflow_code_timeout_seconds=float(
        os.environ.get("RB_WF_CODE_TIMEOUT", "30")),
    # a crash grid that kills one advance RB_WF_KILLS times in a row is not a runaway
    reliable_beat_workflow_max_takeovers=int(os.environ.get(
        "RB_WF_MAX_TAKEOVERS", max(3, int(os.environ.get("RB_WF_KILLS", "3"))))),
    reliable_beat_workflow_pending_alarm_seconds=float(
        os.environ.get("RB_WF_PENDING_ALARM", "300")),
)


@app.task(base=IdempotentTask, bind=True, name="wfa.charge")
def charge(self: IdempotentTask, order: str, cents: int) -> dict[str, Any]:
    """An activity with an effect; its result is declared inside the transaction."""
    with self.transaction() as tx:
        tx.execute(wf_effects.insert().values(kind="activity", key=self.idempotency_key,
                                              pid=os.getpid()))
        self.returns({"charged": cents, "order": order})
    engine.crash_point("activity.after_commit")  # effect committed, message not acked
    return {"ignored": True}


@app.task(base=IdempotentTask, bind=True, name="wfa.label")
def label(self: IdempotentTask, order: str, n: int) -> str:
    """An activity without an explicit transaction: its return value is the result."""
    engine.crash_point("activity.before_return")
    return f"label-{order}-{n}"


def _tx_effect(conn: sa.Connection, key: str) -> str:
    conn.execute(wf_effects.insert().values(kind="transaction", key=key, pid=os.getpid()))
    return key


def _step_effect(key: str) -> str:
    with sa.create_engine(app.conf.reliable_beat_database_url).begin() as conn:
        conn.execute(wf_effects.insert().values(kind="step", key=key, pid=os.getpid()))
    return key


@workflow(app, name="wfa.linear", queue=QUEUE)
def linear(ctx: WorkflowContext, order: str) -> Any:
    a = ctx.transaction(_tx_effect, f"{order}:reserve", name="reserve")
    b = ctx.activity(charge, order, 500, queue=QUEUE)
    c = ctx.step(_step_effect, ctx.info.workflow_id + ":mail", name="mail")
    ctx.sleep(timedelta(seconds=1))
    d = ctx.activity(label, order, 1, queue=QUEUE)
    return [a, b, c, d]


@workflow(app, name="wfa.fanout", queue=QUEUE)
def fanout(ctx: WorkflowContext, order: str) -> Any:
    handles = [ctx.start_activity(charge, order, n, queue=QUEUE) for n in (1, 2, 3)]
    results = ctx.wait_all(*handles)
    done = ctx.transaction(_tx_effect, f"{order}:total", name="total")
    return [results, done]


@workflow(app, name="wfa.signal", queue=QUEUE)
def signalled(ctx: WorkflowContext, order: str) -> Any:
    if os.environ.get("RB_WF_V2"):  # a reordered "v2" deploy: the label comes second
        approval = ctx.wait_signal("go")
        first = ctx.activity(label, order, 7, queue=QUEUE)
    else:
        first = ctx.activity(label, order, 7, queue=QUEUE)
        approval = ctx.wait_signal("go")
    done = ctx.transaction(_tx_effect, f"{order}:approved", name="approved")
    ctx.now()
    return [first, approval, done]


@workflow(app, name="wfa.race", queue=QUEUE)
def race(ctx: WorkflowContext, order: str) -> Any:
    """The ``wait_any`` shape: which activity was seen first is recorded (0 or 1, by timing);
    the result does not depend on it."""
    a = ctx.start_activity(label, order, 3, queue=QUEUE)
    b = ctx.start_activity(charge, order, 9, queue=QUEUE)
    ctx.wait_any(a, b)
    both = ctx.wait_all(a, b)
    done = ctx.transaction(_tx_effect, f"{order}:raced", name="raced")
    return [both, done]


def _slow(i: int) -> int:
    time.sleep(0.3)  # widens the window in which a worker is mid-advance
    return i


@workflow(app, name="wfa.ticks", queue=QUEUE)
def ticks(ctx: WorkflowContext, n: int) -> Any:
    """Consumes ``n`` signals ``tick``, one inline step after each (the signal race)."""
    got = []
    for i in range(n):
        got.append(ctx.wait_signal("tick"))
        ctx.step(_slow, i, name="slow")
    return got


def _held_tx(conn: sa.Connection, marker: str, seconds: float) -> str:
    """Inside the record transaction (its fence check holds the workflow row): write this
    process's pid to ``marker`` for the test, then hold the transaction open."""
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return "held"


@workflow(app, name="wfa.held", queue=QUEUE)
def held(ctx: WorkflowContext, marker: str, seconds: float) -> Any:
    """A transaction that holds the workflow row ``seconds`` (a test freezes the worker
    there), then ``wait_signal("go")`` (the signal sent meanwhile)."""
    done = ctx.transaction(_held_tx, marker, seconds, name="held")
    return [done, ctx.wait_signal("go")]


@workflow(app, name="wfa.sleeper", queue=QUEUE)
def sleeper(ctx: WorkflowContext, order: str, seconds: float) -> Any:
    """Sleeps, then one transaction (the timer across a full restart)."""
    ctx.sleep(timedelta(seconds=seconds))
    return ctx.transaction(_tx_effect, f"{order}:woke", name="woke")


# ------------------------------------------------------------------ versioning roll ----
# RB_WF_VERSION selects the deploy: "1" (default), "2" (reordered: the labels swap places
# around the timer, no patch: every parked v1 run must block), "2p" (the same change behind
# ctx.patched: parked v1 runs keep the old path, new runs take the new one).
ROLL = os.environ.get("RB_WF_VERSION", "1")


def _roll_v1(ctx: WorkflowContext, order: str, seconds: float) -> Any:
    a = ctx.activity(label, order, 1, queue=QUEUE)
    ctx.sleep(timedelta(seconds=seconds))
    b = ctx.activity(label, order, 2, queue=QUEUE)
    return ["v1", a, b]


def _roll_v2(ctx: WorkflowContext, order: str, seconds: float) -> Any:
    b = ctx.activity(label, order, 2, queue=QUEUE)
    ctx.sleep(timedelta(seconds=seconds))
    a = ctx.activity(label, order, 1, queue=QUEUE)
    return ["v2", b, a]


@workflow(app, name="wfa.roll", queue=QUEUE)
def roll(ctx: WorkflowContext, order: str, seconds: float) -> Any:
    """Label, sleep, label; the labels' order is what the deploys change."""
    if ROLL == "2":
        return _roll_v2(ctx, order, seconds)
    if ROLL == "2p":
        if ctx.patched("labels-swapped"):
            return _roll_v2(ctx, order, seconds)
        return _roll_v1(ctx, order, seconds)
    return _roll_v1(ctx, order, seconds)


# ------------------------------------------------------------------ sagas ----


@app.task(base=IdempotentTask, bind=True, name="wfa.forward")
def forward(self: IdempotentTask, order: str, step: str, fail: bool = False) -> str:
    """A forward saga step with an effect; ``fail`` refuses permanently (dead letter)."""
    if fail:
        raise ValueError(f"{order}: step {step} refused (permanent)")
    with self.transaction() as tx:
        tx.execute(wf_effects.insert().values(kind="forward", key=f"{order}:{step}",
                                              pid=os.getpid()))
        self.returns(step)
    return step


@app.task(base=IdempotentTask, bind=True, name="wfa.undo")
def undo(self: IdempotentTask, order: str, step: str) -> str:
    """A compensation: its effect, then a crash point before the message is acked.
    ``RB_WF_UNDO_FAIL=<step>`` makes that step's undo fail permanently (a dead letter)."""
    if os.environ.get("RB_WF_UNDO_FAIL") == step:
        raise ValueError(f"{order}: undo {step} refused (permanent)")
    with self.transaction() as tx:
        tx.execute(wf_effects.insert().values(kind="undo", key=f"{order}:{step}",
                                              pid=os.getpid()))
        self.returns(f"undone {step}")
    engine.crash_point(f"undo.after_commit.{step}")  # effect committed, message not acked
    return "ignored"


@workflow(app, name="wfa.saga", queue=QUEUE)
def saga3(ctx: WorkflowContext, order: str) -> Any:
    """Three forward activities in a saga; the third fails permanently: undo c, b, a."""
    with ctx.saga() as saga:
        for step in ("a", "b", "c"):
            saga.compensate(undo, order, step, queue=QUEUE)
            ctx.activity(forward, order, step, step == "c", queue=QUEUE)
    return "unreachable"


@workflow(app, name="wfa.saga_hold", queue=QUEUE)
def saga_hold(ctx: WorkflowContext, order: str) -> Any:
    """A saga parked on a long timer (what `workflows cancel` interrupts)."""
    with ctx.saga() as saga:
        saga.compensate(undo, order, "a", queue=QUEUE)
        ctx.activity(forward, order, "a", queue=QUEUE)
        ctx.sleep(timedelta(hours=24))
        saga.compensate(undo, order, "b", queue=QUEUE)
        ctx.activity(forward, order, "b", queue=QUEUE)
    return "held"


# ------------------------------------------------------------------ runaway code ----


@workflow(app, name="wfa.forever", queue=QUEUE)
def forever(ctx: WorkflowContext, order: str) -> Any:
    """A loop that never reaches a durable call (pure Python: the code deadline stops it)."""
    ctx.transaction(_tx_effect, f"{order}:before", name="before")
    while True:
        pass


def _hang() -> str:
    threading.Event().wait(3600)  # a call without a timeout that never returns
    return "unreachable"


@workflow(app, name="wfa.hung", queue=QUEUE)
def hung(ctx: WorkflowContext, order: str) -> Any:
    """A step that never returns: step bodies run inside a durable call, which the code
    deadline does not time, so the takeover count parks it."""
    ctx.transaction(_tx_effect, f"{order}:before", name="before")
    return ctx.step(_hang, name="hang")


# ------------------------------------------------------------------ handoff seam ----
# A worker publishes a workflow's next message itself right after its commit, then marks
# it sent (reliable_beat.handoff). The crash point ``handoff.before_mark`` sits between the
# publish and the mark; RB_WF_HANDOFF_UNMARKED=1 skips every mark, as if the process died
# there each time: the relay then sends every such message a second time.
_handoff_mark = handoff.mark


def _mark_after_crash_point(store: Any, sent: list[int], failed: list[int]) -> None:
    engine.crash_point("handoff.before_mark")
    if os.environ.get("RB_WF_HANDOFF_UNMARKED"):
        return
    _handoff_mark(store, sent, failed)


handoff.mark = _mark_after_crash_point

# Inside an advance the marks are made by its release transaction (handoff.mark_in): the
# same crash point, and the same skip, sit there.
_handoff_mark_in = handoff.mark_in


def _mark_in_after_crash_point(conn: Any, *args: Any) -> Any:
    engine.crash_point("handoff.before_mark")
    if os.environ.get("RB_WF_HANDOFF_UNMARKED"):
        deferred = handoff._deferred.get()
        if deferred:
            deferred.clear()  # nothing to mark; a release written with the marks still runs
    return _handoff_mark_in(conn, *args)


handoff.mark_in = _mark_in_after_crash_point
