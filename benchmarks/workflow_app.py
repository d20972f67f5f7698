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
