"""Worker side: a task message the worker drops is recorded as a ``message`` dead letter.

Celery's consumer drops some messages with only a log line: one naming a task the worker
does not register ("Received unregistered task": rejected without requeue, the effect is
lost), one that is not a task message it can read ("Received invalid task message" /
"unknown message"), and an ``IdempotentTask`` message without an idempotency key (refused
at the claim, the task fails with ``IdempotencyKeyError`` and is not retried). Importing this
module in the worker connects Celery's ``task_unknown``, ``task_rejected`` and
``task_failure`` signals: each such message becomes a dead letter of kind ``message`` with
the task's name, task id, arguments, headers and the queue it came from, and a reason:

* ``unregistered``: no task of that name in this worker. ``reliable-beat -A APP
  dead-letters requeue ID`` sends the same message again (same task id, arguments and
  headers, to the queue it came from) once a worker registers the task.
* ``no_key``: an ``IdempotentTask`` message with no ``reliable_beat_key`` header, no
  key from ``idempotency_key_for()`` and no outbox row's message id
  (``reliable_beat_message_id``); not requeueable (the caller sends it again with a key).
* ``rejected``: a message Celery could not read as a task; not requeueable.

``reliable-beat dead-letters list`` shows them and ``status --check`` fails on them, as on
every dead letter not requeued. It is connected wherever :mod:`reliable_beat.celery.acks`
is imported (every app with an ``IdempotentTask``, and apps that add the acks module to
their ``imports``). A dead letter that cannot be written (database down) is logged at ERROR
with the whole message; the message itself is already gone from the broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import signals

from reliable_beat import execution, runs
from reliable_beat.errors import IdempotencyKeyError
from reliable_beat.redaction import get_logger, redact_text
from reliable_beat.settings import Settings
from reliable_beat.values import to_json_value

__all__ = ["PROTOCOL_HEADERS", "record_dropped_message"]

log = get_logger("reliable_beat.lost_messages")

#: Headers Celery's message protocol 2 sets itself; the others are the caller's (ours:
#: ``reliable_beat_key``, the entry, the slot, the trace) and go with a requeued message.
PROTOCOL_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps",
})

_UNREGISTERED_FIX = (
    "Fix: register the task in the workers that consume this queue (import its module: "
    "`imports` / `include` / autodiscover_tasks), or route it to a queue whose workers have "
    "it (`task_routes`, the outbox payload's `queue`); then `reliable-beat -A APP "
    "dead-letters requeue ID` sends the same message again")


def _jsonable(value: Any, what: str) -> Any:
    try:
        return to_json_value(value, what)
    except ValueError:
        return {runs.UNSTORABLE: repr(value)[:2000]}


def _decoded(message: Any) -> tuple[list[Any], dict[str, Any], Mapping[str, Any]]:
    """(args, kwargs, headers) of a Celery task message (protocol 2, or 1's body dict)."""
    headers = dict(getattr(message, "headers", None) or {})
    try:
        body = message.decode()
    except Exception:
        return [], {}, headers
    if isinstance(body, (list, tuple)) and len(body) >= 2:  # protocol 2: (args, kwargs, embed)
        return list(body[0] or []), dict(body[1] or {}), headers
    if isinstance(body, Mapping):  # protocol 1: everything in the body
        merged = {**headers, **{k: v for k, v in body.items() if k not in ("args", "kwargs")}}
        return list(body.get("args") or []), dict(body.get("kwargs") or {}), merged
    return [], {}, headers


def record_dropped_message(
    app: Any, *, reason: str, task: str, task_id: str | None, args: Any, kwargs: Any,
    headers: Mapping[str, Any], queue: str | None, error: str,
) -> int | None:
    """Record a task message the worker dropped as a ``message`` dead letter in ``app``'s
    store (:func:`reliable_beat.runs.record_refused_message`). Never raises: a dead letter
    that cannot be written is logged at ERROR with the message. Returns its id, or None."""
    key = str(headers.get("reliable_beat_key") or task_id or "")
    payload = {
        "task": task, "task_id": task_id, "key": key,
        "args": _jsonable(list(args or []), "args"),
        "kwargs": _jsonable(dict(kwargs or {}), "kwargs"),
        "headers": _jsonable({str(k): v for k, v in headers.items()
                              if k not in PROTOCOL_HEADERS}, "headers"),
        "queue": queue,
    }
    try:
        store = execution._store_for(Settings.from_celery(app).database_url)
        return runs.record_refused_message(store, key=key or "?", task=task or "?",
                                           payload=payload, error=error, reason=reason)
    except Exception as exc:
        log.error("reliable_beat: could not record the dropped message %s[%s] as a dead "
                  "letter (%s): %s; the message is lost: %s", task, task_id,
                  redact_text(str(exc)), error, redact_text(repr(payload))[:4000])
        return None


def _queue_of(message: Any) -> str | None:
    info = getattr(message, "delivery_info", None) or {}
    queue = info.get("routing_key") if isinstance(info, Mapping) else None
    return str(queue) if queue else None


def on_task_unknown(sender: Any = None, message: Any = None, name: Any = None,
                    id: Any = None, **_: Any) -> None:
    """``task_unknown``: a message naming a task this worker does not register."""
    app = getattr(sender, "app", None)
    if app is None or message is None:
        return
    args, kwargs, headers = _decoded(message)
    queue = _queue_of(message)
    error = (f"task {name!r} is not registered in the worker that received it "
             f"({getattr(sender, 'hostname', None) or '?'}, queue {queue or '?'}): Celery "
             "dropped the message. " + _UNREGISTERED_FIX)
    dl = record_dropped_message(app, reason="unregistered", task=str(name), task_id=id,
                                args=args, kwargs=kwargs, headers=headers, queue=queue,
                                error=error)
    if dl is not None:
        log.error("reliable_beat: task %r is not registered here; its message %s is dead "
                  "letter %s (`reliable-beat dead-letters show %s`)", name, id, dl, dl)


def on_task_rejected(sender: Any = None, message: Any = None, exc: Any = None,
                     **_: Any) -> None:
    """``task_rejected``: a message Celery could not read as a task (dropped)."""
    app = getattr(sender, "app", None)
    if app is None or message is None:
        return
    args, kwargs, headers = _decoded(message)
    task = str(headers.get("task") or "?")
    why = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown message format"
    record_dropped_message(
        app, reason="rejected", task=task, task_id=headers.get("id"), args=args,
        kwargs=kwargs, headers=headers, queue=_queue_of(message),
        error=(f"the worker could not read this message as a task ({why}): Celery dropped "
               "it. Fix the sender (its serializer, protocol, eta/expires) and send it "
               "again"))


def on_task_failure(sender: Any = None, task_id: Any = None, exception: Any = None,
                    args: Any = None, kwargs: Any = None, **_: Any) -> None:
    """``task_failure``: an ``IdempotentTask`` refused its message for want of a key."""
    if not isinstance(exception, IdempotencyKeyError) or sender is None:
        return
    request = getattr(sender, "request", None)
    if request is None or getattr(request, "is_eager", False):
        return  # an eager call raises to its caller
    headers = dict(getattr(request, "headers", None) or {})
    name = str(getattr(sender, "name", "?"))
    record_dropped_message(
        sender.app, reason="no_key", task=name, task_id=task_id, args=args, kwargs=kwargs,
        headers=headers, queue=(getattr(request, "delivery_info", None) or {}).get(
            "routing_key"),
        error=(f"{exception}. The message was not run and is not retried. Fix: send it with "
               f"a key (`{name}.delay_with_key(key, ...)`, headers={{'reliable_beat_key': "
               "key}} in send_task, or override idempotency_key_for()), then send the work "
               "again"))


signals.task_unknown.connect(on_task_unknown, weak=False,
                             dispatch_uid="reliable_beat.lost_messages.unknown")
signals.task_rejected.connect(on_task_rejected, weak=False,
                              dispatch_uid="reliable_beat.lost_messages.rejected")
signals.task_failure.connect(on_task_failure, weak=False,
                             dispatch_uid="reliable_beat.lost_messages.no_key")
