"""Celery app of the workflow round-trip benchmark (``-A benchmarks.workflow_app:app``).

``bench.wf_chain(k)``: a workflow of ``k`` sequential activities ``bench.act`` (an
``IdempotentTask`` returning its argument). ``bench.link``: a plain task; a Celery chain of
``k`` of them ends with ``bench.done``, which writes one row. Configured from ``WB_BROKER`` /
``WB_DB``.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.workflows import WorkflowContext, workflow

QUEUE = "wfb_q"
app = Celery("wfb", broker=os.environ.get("WB_BROKER", "memory://"))
app.conf.update(
    broker_connection_retry_on_startup=True, task_ignore_result=True,
    worker_hijack_root_logger=False, task_default_queue=QUEUE,
    reliable_beat_database_url=os.environ.get("WB_DB", "sqlite:///wfb.sqlite3"),
)
done_table = sa.Table("bench_chain_done", sa.MetaData(),
                      sa.Column("id", sa.Integer, primary_key=True),
                      sa.Column("tag", sa.String(100)))


@app.task(base=IdempotentTask, bind=True, name="bench.act")
def act(self: IdempotentTask, i: int) -> int:
    return i


@workflow(app, name="bench.wf_chain", queue=QUEUE)
def wf_chain(ctx: WorkflowContext, k: int) -> int:
    total = 0
    for i in range(k):
        total += ctx.activity(act, i, queue=QUEUE)
    return total


@app.task(name="bench.link")
def link(i: int) -> int:
    return i


_engines: dict[int, Any] = {}


@app.task(name="bench.done")
def done(tag: str) -> None:
    eng = _engines.setdefault(os.getpid(), sa.create_engine(os.environ["WB_DB"]))
    with eng.begin() as conn:
        conn.execute(done_table.insert().values(tag=tag))


# ---- optional instruments (never set by the default run) ------------------------------
# WFB_COUNT=<path prefix>: count this process's statements and commits and its CPU; written to
# <prefix>.<pid> at exit. WFB_TRACE=<path prefix>: a timeline of one process's round trips
# (task received / started / ended, transactions begun / committed, messages published).
# WFB_PROFILE=<path prefix>: cProfile of the worker's task executions, <prefix>.<pid>.prof.
if os.environ.get("WFB_COUNT") or os.environ.get("WFB_TRACE") or os.environ.get("WFB_PROFILE"):
    import atexit
    import json
    import time

    from celery import signals
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    _counts = {"statements": 0, "commits": 0, "rollbacks": 0}
    _trace: list[tuple[float, str]] = []
    _tracing = bool(os.environ.get("WFB_TRACE"))

    def _mark(what: str) -> None:
        if _tracing:
            _trace.append((time.perf_counter(), what))

    @event.listens_for(Engine, "before_cursor_execute")
    def _stmt(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        _counts["statements"] += 1
        _mark("sql " + " ".join(statement.split()[:3])[:40])

    @event.listens_for(Engine, "commit")
    def _commit(conn: Any) -> None:
        _counts["commits"] += 1
        _mark("commit")

    @event.listens_for(Engine, "rollback")
    def _rollback(conn: Any) -> None:
        _counts["rollbacks"] += 1

    @signals.task_prerun.connect
    def _pre(task: Any = None, **kw: Any) -> None:
        _mark(f"task start {task.name}")

    @signals.task_postrun.connect
    def _post(task: Any = None, **kw: Any) -> None:
        _mark(f"task end {task.name}")

    @signals.task_received.connect
    def _recv(request: Any = None, **kw: Any) -> None:
        _mark(f"received {request.name}")

    from reliable_beat import handoff as _handoff

    _send = _handoff.send

    def _traced_send(store: Any, messages: Any) -> None:
        _mark(f"handoff publish {len(messages)}")
        _send(store, messages)
        _mark("handoff published+marked")

    _handoff.send = _traced_send

    _profile = None
    if os.environ.get("WFB_PROFILE"):  # cProfile of the task executions (process CPU clock)
        import cProfile

        _profile = cProfile.Profile(time.process_time)

        @signals.task_prerun.connect
        def _prof_on(**kw: Any) -> None:
            _profile.enable()  # type: ignore[union-attr]

        @signals.task_postrun.connect
        def _prof_off(**kw: Any) -> None:
            _profile.disable()  # type: ignore[union-attr]

    def _dump() -> None:
        if _profile is not None:
            _profile.dump_stats(f"{os.environ['WFB_PROFILE']}.{os.getpid()}.prof")
        t = os.times()
        _counts["cpu_s"] = t.user + t.system  # type: ignore[assignment]
        prefix = (os.environ.get("WFB_COUNT") or os.environ.get("WFB_TRACE")
                  or os.environ["WFB_PROFILE"])
        with open(f"{prefix}.{os.getpid()}", "w") as f:
            json.dump({"counts": _counts, "trace": _trace}, f)

    atexit.register(_dump)
