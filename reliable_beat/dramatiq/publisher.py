"""The sending side: a trigger row as a ``dramatiq.Message`` (:func:`message_for_trigger`),
the core loop's publisher (:class:`DramatiqPublisher`), the ``dramatiq`` outbox destination
(:class:`DramatiqHandler`), a dead run sent again under its key (:func:`requeue_dead_letter`)
and the RabbitMQ URL pika reads (:func:`rabbitmq_url`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import dramatiq

from reliable_beat import runs, tracing
from reliable_beat.dramatiq import backlog
from reliable_beat.dramatiq.base import (
    OPTION,
    OUTBOX_MESSAGE_OPTION,
    TRIGGER_DESTINATION,
    _broker_errors,
    _parse_instant,
)
from reliable_beat.dramatiq.worker import IdempotentActor
from reliable_beat.handlers import DestinationUnavailableError, MessageExpiredError
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redaction import get_logger
from reliable_beat.triggers import trigger_identity

__all__ = ["DramatiqHandler", "DramatiqPublisher", "message_for_trigger", "rabbitmq_url",
           "requeue_dead_letter"]

log = get_logger("reliable_beat.dramatiq")


def message_for_trigger(broker: Any, payload: Mapping[str, Any]) -> Any:
    """The ``dramatiq.Message`` of a trigger payload
    (:func:`reliable_beat.beat.build_trigger_payload`, either shape: the neutral one with
    ``message_id`` and a ``reliable_beat`` object, or the Celery-shaped one of rows written
    before it, ``task_id`` and ``reliable_beat_*`` headers): ``message_id`` = the run's
    deterministic id, ``options["reliable_beat"]`` = key / entry / fire_at / trigger,
    ``queue_name`` from the actor (or ``options.queue``).

    Raises:
        KeyError: the actor is not registered on ``broker`` and no queue is given.
    """
    identity = trigger_identity(payload)
    options = dict(payload.get("options") or {})
    actor_name = str(payload["task"])
    queue = options.pop("queue_name", None) or options.pop("queue", None)
    if queue is None:
        queue = broker.get_actor(actor_name).queue_name
    message_options: dict[str, Any] = {OPTION: {
        "key": identity["key"], "entry": identity["entry"], "fire_at": identity["fire_at"],
        "trigger": identity["trigger"],
    }}
    traceparent = (payload.get("reliable_beat") or {}).get(tracing.TRACEPARENT)
    if isinstance(traceparent, str):  # the slot's trace (reliable_beat.tracing)
        message_options[tracing.TRACEPARENT] = traceparent
    extra: dict[str, Any] = {}
    fire_at = _parse_instant(identity["fire_at"])
    expires_at = _parse_instant(payload.get("expires_at"), "expires_at")
    if fire_at is not None and expires_at is not None:
        # ``expires`` counts from the slot, as for Celery entries: AgeLimit measures from
        # message_timestamp, so a delivery later than slot + expires is skipped (its run is
        # then retired as skipped/expired by the re-dispatch sweep, which will not re-send it).
        extra["message_timestamp"] = int(fire_at.timestamp() * 1000)
        message_options["max_age"] = max(1, int((expires_at - fire_at).total_seconds() * 1000))
    return dramatiq.Message(
        queue_name=queue, actor_name=actor_name, args=tuple(payload.get("args") or ()),
        kwargs=dict(payload.get("kwargs") or {}), options=message_options, **extra,
        message_id=str(payload.get("message_id") or payload.get("task_id") or uuid.uuid4()),
    )


def _publish_errors(exc: Exception) -> Exception:
    transient: tuple[type[BaseException], ...] = (*_broker_errors(), ConnectionError, OSError)
    try:
        import redis.exceptions

        transient += (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, transient):
        return DestinationUnavailableError(f"dramatiq broker unreachable: {exc!r}")
    return exc


@dataclass
class DramatiqPublisher:
    """The core loop's :class:`~reliable_beat.loop.HoldingPublisher` for a Dramatiq broker:
    one ``dramatiq.Message`` per trigger row (:func:`message_for_trigger`), enqueued on the
    broker; an expired trigger is :class:`~reliable_beat.handlers.MessageExpiredError`, an
    unreachable broker :class:`~reliable_beat.handlers.DestinationUnavailableError`."""

    broker: Any
    destination: str = TRIGGER_DESTINATION

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        """Enqueue trigger rows now (see :meth:`publish_at`)."""
        return self.publish_at(messages, now, lambda: None)

    def publish_at(self, messages: Sequence[OutboxMessage], now: datetime,
                   wait: Callable[[], None]) -> list[tuple[int, BaseException | None]]:
        """Build every message first, call ``wait()`` (the core loop sleeps there until the
        slot of triggers it claimed ahead), then enqueue them back to back. A ``wait`` that
        raises abandons the batch before anything was enqueued."""
        built: list[tuple[int, Any]] = []
        out: dict[int, BaseException | None] = {}
        for m in messages:
            try:
                payload = m.payload if isinstance(m.payload, Mapping) else {}
                expires_at = _parse_instant(payload.get("expires_at"), "expires_at")
                if expires_at is not None and now >= expires_at:
                    raise MessageExpiredError(f"{m.message_id}: expired at {expires_at}")
                built.append((m.id, message_for_trigger(self.broker, payload)))
            except Exception as exc:  # expired, or no such actor: this message only
                out[m.id] = _publish_errors(exc)
        wait()
        for outbox_id, message in built:
            try:
                self.broker.enqueue(message)
                out[outbox_id] = None
            except Exception as exc:
                out[outbox_id] = _publish_errors(exc)
        return [(m.id, out[m.id]) for m in messages]

    def tracked_tasks(self) -> Collection[str]:
        return sorted(n for n, a in self.broker.actors.items() if isinstance(a, IdempotentActor))

    def queue_depths(self, messages: Sequence[OutboxMessage]) -> list[tuple[str, int | None]]:
        """Ready messages in each trigger's queue, for the re-dispatch sweep's backlog check
        (:func:`reliable_beat.dramatiq.backlog.queue_depths`)."""
        return backlog.queue_depths(self.broker, messages)


class DramatiqHandler:
    """Outbox handler of destination ``dramatiq`` (application messages) and of the beat's
    Dramatiq triggers: payload ``{"actor", "args"?, "kwargs"?, "queue"?, "delay_ms"?,
    "options"?}`` or a trigger payload; ``message_id`` = uuid5 of the outbox message id, so a
    re-delivery by the relay carries the same id.
    """

    def __init__(self, broker: Any = None) -> None:
        self.broker = broker or dramatiq.get_broker()

    def __call__(self, message: OutboxMessage) -> None:
        payload = message.payload if isinstance(message.payload, Mapping) else {}
        try:
            if "actor" not in payload:  # a beat's trigger
                self.broker.enqueue(message_for_trigger(self.broker, payload))
                return
            actor = str(payload["actor"])
            queue = payload.get("queue") or self.broker.get_actor(actor).queue_name
            options = dict(payload.get("options") or {})
            options[OUTBOX_MESSAGE_OPTION] = message.message_id
            msg: Any = dramatiq.Message(
                queue_name=queue, actor_name=actor, args=tuple(payload.get("args") or ()),
                kwargs=dict(payload.get("kwargs") or {}), options=options,
                message_id=str(uuid.uuid5(uuid.NAMESPACE_URL,
                                          "reliable_beat:" + message.message_id)))
            self.broker.enqueue(msg, delay=payload.get("delay_ms"))
        except Exception as exc:
            raise _publish_errors(exc) from exc


def rabbitmq_url(url: str) -> str:
    """An ``amqp://`` URL as pika (Dramatiq's ``RabbitmqBroker``) reads it.

    Celery/kombu write the default vhost ``/`` as a trailing ``//``
    (``amqp://guest@host:5672//``); pika reads that path as the vhost ``""`` and RabbitMQ
    refuses the connection (``NOT_ALLOWED - vhost  not found``). This returns the same URL
    with the vhost spelled ``%2F``; any other URL is returned unchanged.
    """
    parts = urlsplit(url)
    if parts.scheme.startswith("amqp") and parts.path == "//":
        return urlunsplit(parts._replace(path="/%2F"))
    return url


def requeue_dead_letter(broker: Any, store: Any, dead_letter_id: int, *, by: str,
                        force: bool = False, queue: str | None = None) -> dict[str, Any]:
    """Run a dead Dramatiq run again under the SAME idempotency key, through ``broker``.

    :func:`reliable_beat.runs.requeue_dead_letter` resets the run (``scheduled``, a fresh
    attempt budget, the dead letter marked requeued by ``by``), then a new message is
    enqueued for the dead letter's actor with ``options["reliable_beat"]["key"]`` = the
    run's key (a fresh ``message_id``: Dramatiq's own dead letter of the old message stays
    in ``<queue>.XQ``), and the run is marked ``dispatched``. Sending fails -> the requeue
    is undone (the run stays ``dead``) and the error raised.

    Args:
        broker: the app's Dramatiq broker (the actor need not be declared on it when the
            dead letter names its queue).
        store: the store.
        dead_letter_id: ``reliable_beat_dead_letters.id`` of a run dead letter written by
            an :class:`IdempotentActor` (its payload has ``actor``).
        by: who decided (recorded in ``requeued_by``).
        force: requeue even if it was requeued before.
        queue: send to this queue (default: the queue the run died on).

    Returns:
        ``{"dead_letter", "actor", "key", "queue", "message_id", "by"}``.

    Raises:
        reliable_beat.runs.DeadLetterNotFound: no such run dead letter.
        ValueError: not a Dramatiq actor's dead letter, already requeued (without
            ``force``), the run is not dead, or its effect committed.
        Exception: the broker refused the message (the run stays dead).
    """
    dl = runs.get_dead_letter(store, dead_letter_id)
    payload = dl.get("payload") or {}
    if dl.get("kind") != "run" or not isinstance(payload, Mapping) or "actor" not in payload:
        raise ValueError(
            f"dead letter {dead_letter_id} is not a Dramatiq actor's run dead letter (kind "
            f"{dl.get('kind')!r}); Celery tasks: `reliable-beat -A APP dead-letters requeue`")
    runs.requeue_dead_letter(store, dead_letter_id, by=by, force=force)
    key = str(payload["key"])
    actor = str(payload["actor"])
    try:
        target = queue or payload.get("queue") or broker.get_actor(actor).queue_name
        options = dict(payload.get("options") or {})
        rb = dict(options.get(OPTION) or {})
        rb["key"] = key
        options[OPTION] = rb
        msg: Any = dramatiq.Message(
            queue_name=target, actor_name=actor, args=tuple(payload.get("args") or ()),
            kwargs=dict(payload.get("kwargs") or {}), options=options)
        broker.enqueue(msg)
    except Exception:
        runs.undo_requeue(store, dead_letter_id)
        raise
    runs.mark_dispatched(store, key)
    log.warning("dead letter %s requeued by %s: %s under key %s (message %s)", dead_letter_id,
                by, actor, key, msg.message_id)
    return {"dead_letter": dead_letter_id, "actor": actor, "key": key, "queue": target,
            "message_id": msg.message_id, "by": by}
