"""Worker side: record that a worker started a scheduled trigger of a **plain** Celery task.

An ``IdempotentTask`` records every attempt (its claim sets the run's ``started_at``). A plain
task keeps no run state, so without this hook "a worker ran it" cannot be told from "no
worker knows this task name and every trigger is dropped". Importing this module in the
worker connects Celery's ``task_prerun`` signal: when a task whose message carries a
``reliable_beat_key`` header (a trigger from a beat, ``entries trigger`` or ``backfill``)
starts, its run row gets ``started_at`` (one short ``UPDATE``, only the first start counts).
``reliable-beat status`` then flags entries whose triggers no worker started within
``reliable_beat_redispatch_seconds`` (see :func:`reliable_beat.cli.status.collect_status`).

It is connected automatically wherever :mod:`reliable_beat.celery.task` is imported (any app
with an ``IdempotentTask``). An app of plain tasks only adds it to its imports::

    app.conf.imports = [*app.conf.imports, "reliable_beat.celery.acks"]

A failure to write is logged at WARNING and never fails the task.
"""

from __future__ import annotations

from typing import Any

from celery import signals
from sqlalchemy import update

from reliable_beat.db.tables import runs
from reliable_beat.redaction import get_logger

__all__ = ["record_start"]

log = get_logger("reliable_beat.acks")

KEY_HEADER = "reliable_beat_key"


def _key(task: Any) -> str | None:
    request = getattr(task, "request", None)
    if request is None:
        return None
    headers = getattr(request, "headers", None) or {}
    value = headers.get(KEY_HEADER) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, KEY_HEADER, None)
    return value if isinstance(value, str) else None


def record_start(sender: Any = None, task: Any = None, **_: Any) -> None:
    """``task_prerun`` handler: set ``started_at`` of a plain task's trigger run."""
    task = task or sender
    if task is None or getattr(task, "request", None) is None:
        return
    try:
        from reliable_beat.celery.task import IdempotentTask
        from reliable_beat.execution import _store_for
    except ImportError:  # pragma: no cover - ships together
        return
    if isinstance(task, IdempotentTask):
        return  # its claim records the start
    key = _key(task)
    if key is None or getattr(task.request, "is_eager", False):
        return
    try:
        from reliable_beat.settings import Settings

        store = _store_for(Settings.from_celery(task.app).database_url)
        with store.begin() as conn:
            now = store.now(conn)
            conn.execute(
                update(runs)
                .where(runs.c.idempotency_key == key, runs.c.started_at.is_(None))
                .values(started_at=now)
            )
    except Exception as exc:
        log.warning("reliable_beat: could not record the start of %s (%s): %s",
                    getattr(task, "name", "?"), key, exc)


signals.task_prerun.connect(record_start, weak=False, dispatch_uid="reliable_beat.acks")
