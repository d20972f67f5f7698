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

Importing it also connects :mod:`reliable_beat.celery.lost_messages`: a message the worker
drops (a task it does not register, an ``IdempotentTask`` message without a key, a message
it cannot read) becomes a ``message`` dead letter instead of only a log line.

A failure to write is logged at WARNING and never fails the task. The start is kept in the
worker process (at most :data:`UNRECORDED_MAX` of them) and written when the database answers
again: at this task's end (``task_postrun``) or at the next trigger's start in the same process,
with the time the worker saw it start. So a database outage at that moment does not leave a
trigger looking unstarted (``status``: UNSTARTED BETWEEN STARTED), unless the worker stops
first.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any

from celery import signals
from sqlalchemy import update

from reliable_beat import execution
from reliable_beat.celery import lost_messages
from reliable_beat.celery.headers import KEY_HEADER
from reliable_beat.db.tables import runs
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings

__all__ = ["UNRECORDED_MAX", "lost_messages", "record_start", "record_unrecorded_starts"]

log = get_logger("reliable_beat.acks")

#: Most starts kept per worker process while the database is unreachable (newer ones are
#: dropped, with a WARNING naming them).
UNRECORDED_MAX = 1000

#: Starts not written yet: idempotency key -> (the worker's clock at the start, store URL).
_unrecorded: dict[str, tuple[datetime, str]] = {}
_unrecorded_lock = threading.Lock()

#: Task classes whose tasks record their own start (an ``IdempotentTask``'s claim sets
#: ``started_at``): :func:`record_start` leaves them alone. :mod:`reliable_beat.celery.task`
#: adds ``IdempotentTask`` when it is imported (it imports this module, not the reverse).
_self_recording: tuple[type, ...] = ()


def _records_own_start(cls: type) -> None:
    """Let :func:`record_start` leave the tasks of ``cls`` and its subclasses alone."""
    global _self_recording
    if cls not in _self_recording:
        _self_recording = (*_self_recording, cls)


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
    if isinstance(task, _self_recording):
        return  # its claim records the start
    key = _key(task)
    if key is None or getattr(task.request, "is_eager", False):
        return
    started = datetime.now(timezone.utc)
    url = ""
    try:
        url = Settings.from_celery(task.app).database_url
        store = execution._store_for(url)
        with store.begin() as conn:
            now = store.now(conn)
            conn.execute(
                update(runs)
                .where(runs.c.idempotency_key == key, runs.c.started_at.is_(None))
                .values(started_at=now)
            )
    except Exception as exc:
        kept = False
        if url:
            with _unrecorded_lock:
                if len(_unrecorded) < UNRECORDED_MAX:
                    _unrecorded[key] = (started, url)
                    kept = True
        log.warning("reliable_beat: could not record the start of %s (%s): %s; %s",
                    getattr(task, "name", "?"), key, exc,
                    "kept, written when the database answers again" if kept
                    else "not kept (too many unwritten starts): status will report it "
                    "as unstarted")
        return
    record_unrecorded_starts()


def record_unrecorded_starts(**_: Any) -> int:
    """Write the starts :func:`record_start` could not (database down); also a
    ``task_postrun`` handler. Returns how many were written; a failure keeps them for the
    next call and is not logged again (the first failure was)."""
    with _unrecorded_lock:
        todo = dict(_unrecorded)
    if not todo:
        return 0
    written = 0
    for url in sorted({u for _, u in todo.values()}):
        keys = {k: at for k, (at, u) in todo.items() if u == url}
        try:
            store = execution._store_for(url)
            with store.begin() as conn:
                for k, at in keys.items():
                    conn.execute(
                        update(runs)
                        .where(runs.c.idempotency_key == k, runs.c.started_at.is_(None))
                        .values(started_at=at)
                    )
        except Exception:
            continue
        with _unrecorded_lock:
            for k in keys:
                _unrecorded.pop(k, None)
        written += len(keys)
        log.info("reliable_beat: recorded %d trigger starts the database missed earlier: %s",
                 len(keys), ", ".join(sorted(keys)[:5]))
    return written


signals.task_prerun.connect(record_start, weak=False, dispatch_uid="reliable_beat.acks")
signals.task_postrun.connect(record_unrecorded_starts, weak=False,
                             dispatch_uid="reliable_beat.acks.unrecorded")
