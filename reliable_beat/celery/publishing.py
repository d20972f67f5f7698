"""Celery and kombu outbox publishing: the ``celery`` and ``kombu`` destinations.

Moved out of :mod:`reliable_beat.handlers` (the framework-neutral handler protocol, errors,
webhook, SMTP and the registry) into the Celery adapter. The relay gets these handlers
through the Celery adapter hook (:mod:`reliable_beat.adapters`) when it runs with a Celery
app; the beat's fast path, its sweep and the re-dispatch publish with
:func:`publish_celery_batch`.

Payload shapes:

* ``celery``: ``{"task", "args", "kwargs", "task_id"?, "headers"?, "options"?:
  {"queue", "routing_key", "priority", "exchange"}, "expires_at"?: ISO-8601 UTC or null}``;
  sent with ``send_task`` over one producer per batch; the task id is ``task_id`` or
  ``uuid5(message_id)``, so a re-delivery carries the same task id.
* ``kombu``: ``{"exchange": "" , "exchange_type"?: "direct", "routing_key", "body",
  "serializer"?: "json", "headers"?}``; raw publish with ``message_id`` set.

Celery protocol headers (:data:`~reliable_beat.handlers.CELERY_PROTOCOL_HEADERS`) in a
``celery`` row's ``headers`` are dropped (WARNING): they never override the message's own.

This module decides what a batch of rows becomes and what each publish result means (the
payload shapes, expiry, custom headers, a hung broker, the handlers);
:mod:`reliable_beat.celery.wire` holds how the batch reaches the broker (the Redis pipeline,
RabbitMQ's publisher confirms, the hand-built messages).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from reliable_beat import tracing
from reliable_beat.celery.reprs import shown_reprs

# The wire level (Redis pipeline, RabbitMQ confirms, hand-built messages) lives in
# reliable_beat.celery.wire; the names stay bound here, where tests and callers reach them
# (publish_celery_batch reads _publish_batch, _amqp_confirms and _send_one from this module).
from reliable_beat.celery.wire import (  # noqa: F401 (re-exported)
    CONFIRM_TIMEOUT_SECONDS,
    _amqp_confirms,
    _AmqpConfirms,
    _BoundQueueRouter,
    _CapturingProducer,
    _connection_errors,
    _is_connection_error,
    _MessageBuilder,
    _pipelined_send_options,
    _publish_batch,
)
from reliable_beat.errors import ConfigurationError, PermanentDeliveryError
from reliable_beat.handlers import (
    CELERY_PROTOCOL_HEADERS,
    DestinationUnavailableError,
    MessageExpiredError,
)
from reliable_beat.outbound.base import Result
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redaction import get_logger, redact_url

__all__ = [
    "CeleryHandler",
    "KombuHandler",
    "bound_broker_wait",
    "celery_task_id",
    "publish_celery_batch",
]

log = get_logger(__name__)


# --------------------------------------------------------------------------- celery / kombu


def celery_task_id(message: OutboxMessage) -> str:
    """The Celery task id of a trigger: ``payload["task_id"]`` or ``uuid5(URL, message_id)``."""
    payload = message.payload
    if payload.__class__ is not dict and not isinstance(payload, Mapping):
        payload = {}
    task_id = payload.get("task_id")
    if task_id:
        return str(task_id)
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "reliable_beat:" + message.message_id))


def _parse_instant(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    text = str(value)
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        raise ValueError(f"naive instant {value!r}: expected ISO-8601 with a UTC offset")
    return parsed.astimezone(timezone.utc)


def publish_celery_batch(
    app: Any,
    messages: Sequence[OutboxMessage],
    *,
    now: datetime | None = None,
    wait: Callable[[], None] | None = None,
) -> list[tuple[int, Result]]:
    """Publish Celery trigger rows with ``send_task``, all over ONE producer / connection.

    On a Redis broker the whole batch goes out in ONE pipeline (kombu's
    ``Producer.batch()``, see :func:`_publish_batch`), and after each message shape's first
    ``send_task`` the messages are built from its template (:class:`_MessageBuilder`:
    byte-for-byte the message ``send_task`` makes, at about a third of its cost). On
    RabbitMQ (kombu's ``pyamqp`` transport) the batch is published on a channel of its own
    in **publisher-confirm** mode and the broker's confirms for the whole batch are awaited
    once, after the last publish (:class:`_AmqpConfirms`; the publishes are built first and
    written back to back, like the Redis pipeline): a message counts as published (``None``
    below) only once the broker acked it; a nacked or unconfirmed one gets a
    :class:`DestinationUnavailableError` and its row stays pending; the messages of a
    confirmed batch are hand-built from each shape's template too (proven byte for byte on
    RabbitMQ as on Redis). Other transports publish per message, with ``send_task``.

    Used by the relay and by the beat's fast path right after its commit. Does not touch the
    database: the caller marks the results (:func:`reliable_beat.relay.mark_sent`,
    :func:`reliable_beat.relay.mark_expired`, or leaves failed rows pending for the relay).

    Args:
        app: the Celery app whose broker to publish to.
        messages: rows with ``destination == "celery"`` (payload shape: module docstring).
        now: the store's clock (UTC) for the ``expires_at`` check; default the host clock.
        wait: called once, right before the first message can reach the broker: after every
            message of the batch is built and buffered on a batching transport (the flush
            that follows is the publish), before the first ``send_task`` otherwise. The
            beat's claim-ahead sleeps there until the slot's instant, so the messages are
            built before it and leave together at it, never earlier.

    Returns:
        ``[(row id, None | exception)]`` in the order of ``messages``. A row whose
        ``expires_at`` is not after ``now`` is not published and gets a
        :class:`MessageExpiredError`; after a connection-level failure the rest of the batch
        gets the same :class:`DestinationUnavailableError` without being tried.
    """
    now = now or datetime.now(timezone.utc)
    results: list[tuple[int, Result]] = []
    if not messages:
        return results
    hung = _hung_broker(app)
    if hung is not None:  # a publish timed out: not tried again until the broker answers
        if wait is not None:
            wait()  # claimed ahead: never handed back (to a sweep) before the slot's instant
        return [(m.id, hung) for m in messages]
    conn_errors: tuple[type[BaseException], ...] = ()
    try:
        with app.producer_or_acquire() as pooled, _amqp_confirms(pooled) as confirms:
            producer = pooled if confirms is None else confirms.producer
            conn_errors = _connection_errors(producer)
            with _publish_batch(producer, len(messages)) as batch_error:
                send_options: dict[str, Any] = {}
                builder: _MessageBuilder | None = None
                if confirms is not None:  # the channel is open: no connect-retry needed
                    send_options = _pipelined_send_options(app, producer)
                    # hand-built messages, proven byte for byte on RabbitMQ too
                    # (tests/integration/test_publish_builder_amqp.py)
                    builder = _MessageBuilder.for_batch(app)
                elif wait is not None and not batch_error:
                    wait()  # no buffering: every send_task below reaches the broker at once
                for index, message in enumerate(messages):
                    try:
                        _send_one(app, producer, message, now, builder=builder,
                                  **send_options)
                        if confirms is not None:
                            confirms.sent(index)
                        results.append((message.id, None))
                        if (batch_error or confirms is not None) and not send_options:
                            send_options = _pipelined_send_options(app, producer)
                            if batch_error:  # the Redis pipeline: where the builder is proven
                                builder = _MessageBuilder.for_batch(app)
                    except MessageExpiredError as exc:
                        results.append((message.id, exc))
                    except conn_errors + batch_error as exc:
                        if not _is_connection_error(exc, conn_errors):
                            raise  # the broker refused a command: isolate the culprit below
                        down = _unavailable(app, exc)
                        results.extend((m.id, down) for m in messages[index:])
                        break
                    except Exception as exc:
                        if confirms is not None and confirms.closed_by(exc):
                            # RabbitMQ closed the batch's channel over this message (e.g.
                            # PRECONDITION_FAILED declaring its queue): nothing held was
                            # written; isolate the culprit one by one below.
                            raise
                        results.append((message.id, exc))
                if wait is not None and (batch_error or confirms is not None):
                    wait()  # buffered: leaving the batch flushes, i.e. publishes
            if confirms is not None:
                confirms.flush()  # every publish of the batch, back to back
                unconfirmed = confirms.wait()
                results = [(mid, unconfirmed.get(i, r)) for i, (mid, r) in enumerate(results)]
    except Exception as exc:  # flushing the batch, or acquiring / releasing the producer
        done = {i: r for i, r in results if r is not None}
        if conn_errors and not _is_connection_error(exc, conn_errors):
            # The broker answered, but refused something in the batch (e.g. Redis WRONGTYPE:
            # a queue name that is a key of another type). That error belongs to one
            # message: publish the batch's messages one by one, so the culprit fails alone
            # (and is charged an attempt) and the others go out. Messages of the batch the
            # broker did take are published again, under the same task id (at least once).
            log.warning("celery publish batch of %d refused by the broker (%r); publishing "
                        "its messages one by one to isolate the culprit", len(messages), exc)
            retry = [m for m in messages if m.id not in done]
            singles = dict(_publish_one_by_one(app, retry, now))
            return [(m.id, done[m.id] if m.id in done else singles[m.id]) for m in messages]
        down = _unavailable(app, exc)
        # Buffered messages were not (or not surely) written: none counts as published.
        # The rows stay pending and the relay re-publishes them under the same task id.
        results = [(m.id, done.get(m.id, down)) for m in messages]
    return results


def bound_broker_wait(app: Any, seconds: float) -> bool:
    """Bound how long a publish in this process waits on a broker that does not answer.

    A broker that *refuses* connections fails a publish at once; one that accepts them but
    answers nothing (Redis ``CLIENT PAUSE``, a stalled network, an overloaded server) would
    block a publish, and the beat's whole loop with it (no claims, no heartbeat), for as
    long as it hangs. On a Redis broker (kombu's ``redis`` / ``rediss`` / ``sentinel``
    transports) this sets kombu's ``socket_timeout`` transport option to ``seconds`` in
    ``app.conf.broker_transport_options``, unless the user set one there (theirs wins):
    a publish then fails within about ``seconds`` with a timeout, which
    :func:`publish_celery_batch` reports as "broker unavailable" (the rows stay pending; see
    there). Call it before the process opens its first broker connection (the beat does, in
    :class:`~reliable_beat.celery.scheduler.ReliableScheduler`; the relay when it builds its
    Celery handlers): connections opened earlier keep their options. RabbitMQ needs none:
    its publisher confirms are awaited at most :data:`CONFIRM_TIMEOUT_SECONDS`.

    Args:
        app: the Celery app whose broker settings to complete (this process only).
        seconds: the socket timeout (``reliable_beat_publish_timeout_seconds``), > 0.

    Returns:
        True when the option was set; False when the broker is not Redis or the user's
        ``broker_transport_options`` already had a ``socket_timeout``.
    """
    try:
        driver = app.connection_for_write().transport.driver_type
    except Exception:  # an unknown transport: sending will say so
        return False
    if driver != "redis":
        return False
    options = dict(app.conf.broker_transport_options or {})
    if options.get("socket_timeout") is not None:
        return False
    options["socket_timeout"] = float(seconds)
    app.conf.broker_transport_options = options
    return True


def _timed_out(exc: BaseException) -> bool:
    """True when a timeout is in ``exc``'s cause chain (socket or redis-py timeout)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TimeoutError) or type(current).__name__ == "TimeoutError" \
                or "timeout" in str(current).lower():
            return True
        current = current.__cause__ or current.__context__
    return False


def _unavailable(app: Any, exc: BaseException) -> DestinationUnavailableError:
    """The "broker unavailable" result of a publish that failed on the connection; names the
    broker (password masked) and, for a timeout, the bound that cut the wait short."""
    if _timed_out(exc):
        broker, within = _broker_name(app)
        down = DestinationUnavailableError(
            f"celery broker unavailable: {broker} did not answer{within} (a hung broker: "
            "paused, overloaded or a stalled network; bound: broker_transport_options"
            f"['socket_timeout'], default reliable_beat_publish_timeout_seconds): {exc!r}")
        down.__cause__ = exc
        _broker_hangs(app, down)
        return down
    down = DestinationUnavailableError(f"celery broker unavailable: {exc!r}")
    down.__cause__ = exc
    return down


def _broker_name(app: Any) -> tuple[str, str]:
    """The broker URL (password masked) and `` within N s`` (its socket timeout) or ``""``."""
    try:  # the password masked (and no mask when there is none)
        broker = redact_url(app.connection_for_write().as_uri(include_password=True))
    except Exception:  # pragma: no cover - the URL was usable a moment ago
        broker = "?"
    limit = (app.conf.broker_transport_options or {}).get("socket_timeout")
    return broker, (f" within {limit:g} s" if isinstance(limit, (int, float)) else "")


#: How often a hung broker is probed (seconds) until it answers again.
PROBE_SECONDS = 1.0
_hung_lock = threading.Lock()
#: id(app) -> the error every publish to that app's broker gets until a probe gets an answer
_hung: dict[int, DestinationUnavailableError] = {}


def _hung_broker(app: Any) -> DestinationUnavailableError | None:
    """The fail-fast error while ``app``'s broker is known to hang, else None."""
    return _hung.get(id(app))


def _broker_hangs(app: Any, down: DestinationUnavailableError) -> None:
    """A publish to ``app``'s broker timed out: from now on every publish in this process
    fails at once with ``down`` (rows stay pending, nothing waits on the broker, so the beat
    keeps claiming every slot on time) until a background probe (:func:`_probe_broker`, every
    :data:`PROBE_SECONDS`, bounded by the same socket timeout) gets an answer."""
    with _hung_lock:
        known = id(app) in _hung
        _hung[id(app)] = down
    if known:
        return
    broker, within = _broker_name(app)
    log.warning("celery broker %s did not answer%s: publishes fail at once (their rows stay "
                "pending in the outbox) until it answers again; probing it every %g s",
                broker, within, PROBE_SECONDS)
    threading.Thread(target=_probe_broker, args=(app,), name="reliable-beat-broker-probe",
                     daemon=True).start()


def _probe_broker(app: Any) -> None:
    """Until ``app``'s broker answers (a fresh connection; on Redis a ``PING``), then lift
    the fail-fast state of :func:`_broker_hangs`."""
    started = time.monotonic()
    while True:
        time.sleep(PROBE_SECONDS)
        try:
            with app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1)
                channel = conn.channel()  # kombu's Redis channel PINGs on creation
                try:
                    client = getattr(channel, "client", None)
                    if client is not None and hasattr(client, "ping"):
                        client.ping()
                finally:
                    channel.close()
        except Exception as exc:  # still hung (or down): keep probing
            log.debug("celery broker probe: %r", exc)
            continue
        with _hung_lock:
            _hung.pop(id(app), None)
        broker, _ = _broker_name(app)
        log.warning("celery broker %s answers again after %.0f s: publishing resumes (the "
                    "triggers kept pending go out with the next sweep, same task ids)",
                    broker, time.monotonic() - started)
        return


def _send_one_confirmed(app: Any, producer: Any, message: OutboxMessage, now: datetime) -> None:
    """``send_task`` of one message; on RabbitMQ on a confirm-mode channel of its own, and
    raises unless the broker confirmed it (see :class:`_AmqpConfirms`)."""
    with _amqp_confirms(producer) as confirms:
        if confirms is None:
            _send_one(app, producer, message, now)
            return
        _send_one(app, confirms.producer, message, now, retry=False)
        confirms.sent(0)
        confirms.flush()
        error = confirms.wait().get(0)
    if error is not None:
        raise error


def _publish_one_by_one(
    app: Any, messages: Sequence[OutboxMessage], now: datetime
) -> list[tuple[int, Result]]:
    """Publish each message with its own ``send_task`` (no pipeline; on RabbitMQ each one
    confirmed by the broker): an error then belongs to that message; a connection-level
    error fails the rest as unavailable."""
    results: list[tuple[int, Result]] = []
    try:
        with app.producer_or_acquire() as producer:
            conn_errors = _connection_errors(producer)
            for index, message in enumerate(messages):
                try:
                    _send_one_confirmed(app, producer, message, now)
                    results.append((message.id, None))
                except MessageExpiredError as exc:
                    results.append((message.id, exc))
                except Exception as exc:
                    if _is_connection_error(exc, conn_errors):
                        down = _unavailable(app, exc)
                        results.extend((m.id, down) for m in messages[index:])
                        break
                    log.warning("celery trigger %s (outbox row %d) refused by the broker: %r",
                                message.message_id, message.id, exc)
                    results.append((message.id, exc))
    except Exception as exc:  # acquiring / releasing the producer
        down = _unavailable(app, exc)
        got = dict(results)
        results = [(m.id, got.get(m.id, down)) for m in messages]
    return results


#: the payload options a trigger message is routed with (the others are not Celery's)
_ROUTING_OPTIONS = frozenset(("queue", "routing_key", "priority", "exchange"))


def _send_one(app: Any, producer: Any, message: OutboxMessage, now: datetime,
              builder: _MessageBuilder | None = None, **send_options: Any) -> None:
    payload = message.payload
    if (payload.__class__ is not dict and not isinstance(payload, Mapping)) \
            or "task" not in payload:
        raise PermanentDeliveryError(
            f"outbox row {message.id} ({message.message_id}): celery payload needs a 'task' key"
        )
    expires_at = _parse_instant(payload.get("expires_at"))
    if expires_at is not None and expires_at <= now:
        raise MessageExpiredError("expired before publish")
    raw_options = payload.get("options") or {}
    if raw_options.__class__ is not dict:
        raw_options = dict(raw_options)
    options = {
        k: v
        for k, v in raw_options.items()
        if k in _ROUTING_OPTIONS and v is not None
    } if raw_options else {}
    headers = _custom_headers(payload.get("headers"), message)
    headers.setdefault("reliable_beat_message_id", message.message_id)
    if message.traceparent:  # the row's trace (reliable_beat.tracing): the worker joins it
        headers.setdefault("traceparent", message.traceparent)
    args = list(payload.get("args") or [])
    kwargs = dict(payload.get("kwargs") or {})
    task_id = celery_task_id(message)
    if builder is not None:
        if builder.publish(producer, payload["task"], args, kwargs, task_id, headers,
                           expires_at, options):
            return
        builder.captured = None
    argsrepr, kwargsrepr = shown_reprs(app, args, kwargs)  # what logs and events show
    # in the row's trace: Celery's instrumentation rewrites the traceparent header from it
    with tracing.attached(headers.get("traceparent")):
        app.send_task(
            payload["task"],
            args=args,
            kwargs=kwargs,
            task_id=task_id,
            headers=headers,
            expires=expires_at,
            producer=_CapturingProducer(producer, builder) if builder is not None else producer,
            argsrepr=argsrepr,
            kwargsrepr=kwargsrepr,
            **options,
            **send_options,
        )
    if builder is not None:
        builder.learn(payload["task"], args, kwargs, task_id, headers, expires_at, options)


#: custom header name -> whether it names a Celery protocol header (any case)
_PROTOCOL_NAME: dict[str, bool] = {}


def _custom_headers(raw: Any, message: OutboxMessage) -> dict[str, Any]:
    """A row's custom headers without Celery's protocol headers (``task``, ``id``, ...).

    A custom header with a protocol name would override the message's own (an entry for
    task A sent with ``task=B`` ran B): such keys are dropped and logged at WARNING.
    """
    if raw.__class__ is not dict and not isinstance(raw, Mapping):
        if raw:
            log.warning("outbox row %d (%s): 'headers' is not an object; ignored",
                        message.id, message.message_id)
        return {}
    headers = {}
    dropped = []
    known = _PROTOCOL_NAME
    for key, value in raw.items():
        protocol = known.get(key) if key.__class__ is str else None
        if protocol is None:
            protocol = str(key).lower() in CELERY_PROTOCOL_HEADERS
            if key.__class__ is str and len(known) < 4096:  # bounded: a batch's few names
                known[key] = protocol
        if protocol:
            dropped.append(str(key))
        else:
            headers[key if key.__class__ is str else str(key)] = value
    if dropped:
        log.warning("outbox row %d (%s): Celery protocol header(s) %s ignored (a custom "
                    "header may not override the message's own)", message.id,
                    message.message_id, ", ".join(sorted(dropped)))
    return headers


class CeleryHandler:
    """Destination ``celery``: ``send_task`` with a task id derived from the message id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, message: OutboxMessage) -> None:
        error = self.deliver_batch([message])[0]
        if error is not None:
            raise error

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[Result]:
        """Publish over one producer; see :func:`publish_celery_batch`."""
        return [err for _, err in publish_celery_batch(self.app, messages)]


class KombuHandler:
    """Destination ``kombu``: a raw publish (``message_id`` property = the message id).

    Args:
        app: a Celery app whose broker connection to use, or None.
        url: a kombu broker URL, used when ``app`` is None.
    """

    def __init__(self, app: Any = None, url: str | None = None) -> None:
        if app is None and url is None:
            raise ConfigurationError("KombuHandler needs a Celery app or a broker url")
        self.app = app
        self.url = url

    def __call__(self, message: OutboxMessage) -> None:
        error = self.deliver_batch([message])[0]
        if error is not None:
            raise error

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[Result]:
        """Publish every message over one connection, in order.

        On RabbitMQ the batch is confirmed like a ``celery`` batch (:class:`_AmqpConfirms`)
        and published ``mandatory``: a message no queue is bound for comes back
        (``basic.return``) and fails with a :class:`DeliveryError` (charged an attempt,
        dead-lettered in the end) instead of being confirmed and dropped by the broker.
        """
        import kombu

        results: list[Result] = []
        confirmed = False
        try:
            if self.app is not None:
                conn = self.app.connection_for_write()
            else:
                conn = kombu.Connection(self.url)  # type: ignore[attr-defined,no-untyped-call]
            with conn, conn.Producer() as plain, _amqp_confirms(plain) as confirms:
                producer = plain if confirms is None else confirms.producer
                confirmed = confirms is not None
                conn_errors = _connection_errors(producer)
                for index, message in enumerate(messages):
                    try:
                        self._publish(kombu, producer, message,
                                      mandatory=confirms is not None)
                        if confirms is not None:
                            confirms.sent(index, message.message_id)
                        results.append(None)
                    except conn_errors as exc:
                        down = DestinationUnavailableError(f"kombu broker unavailable: {exc!r}")
                        down.__cause__ = exc
                        results.extend([down] * (len(messages) - index))
                        break
                    except Exception as exc:
                        if confirms is not None and confirms.closed_by(exc):
                            raise  # the channel is gone: the rest of the batch with it
                        results.append(exc)
                if confirms is not None:
                    confirms.flush()
                    unconfirmed = confirms.wait()
                    results = [unconfirmed.get(i, r) for i, r in enumerate(results)]
        except Exception as exc:
            down = DestinationUnavailableError(f"kombu broker unavailable: {exc!r}")
            down.__cause__ = exc
            if confirmed:  # nothing counts as published before the broker's confirm
                results = [down if r is None else r for r in results]
            results.extend([down] * (len(messages) - len(results)))
        return results

    @staticmethod
    def _publish(kombu: Any, producer: Any, message: OutboxMessage, *,
                 mandatory: bool = False) -> None:
        p = message.payload
        if not isinstance(p, Mapping) or "routing_key" not in p or "body" not in p:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: kombu payload needs 'routing_key' and 'body'"
            )
        name = p.get("exchange", "") or ""
        exchange = kombu.Exchange(name, type=p.get("exchange_type", "direct"))
        headers = dict(p.get("headers") or {})
        headers.setdefault("reliable_beat_message_id", message.message_id)
        producer.publish(
            p["body"],
            exchange=exchange,
            routing_key=p["routing_key"],
            serializer=p.get("serializer", "json"),
            headers=headers,
            message_id=message.message_id,
            declare=[exchange] if name else [],
            retry=False,
            mandatory=mandatory,
        )
