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
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from reliable_beat.celery.reprs import shown_reprs
from reliable_beat.errors import ConfigurationError, DeliveryError, PermanentDeliveryError
from reliable_beat.handlers import (
    CELERY_PROTOCOL_HEADERS,
    DestinationUnavailableError,
    MessageExpiredError,
)
from reliable_beat.outbound.base import Result
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redaction import get_logger

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
    payload = message.payload if isinstance(message.payload, Mapping) else {}
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


def _connection_errors(producer: Any) -> tuple[type[BaseException], ...]:
    from kombu.exceptions import OperationalError

    errors: tuple[type[BaseException], ...] = (OperationalError, OSError, ConnectionError)
    with contextlib.suppress(Exception):  # a transport without the attribute
        errors += tuple(producer.connection.connection_errors)
    return errors


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
    from reliable_beat.redaction import redact_url

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


#: How long a batch published to RabbitMQ waits for the broker's publisher confirms
#: (seconds); messages still unconfirmed then count as not published (rows stay pending).
CONFIRM_TIMEOUT_SECONDS = 30.0


class _AmqpConfirms:
    """Publisher confirms for one batch, awaited together (RabbitMQ, kombu ``pyamqp``).

    The batch gets a channel of its own in confirm mode (``confirm.select``), so the
    broker's delivery tags are exactly this batch's publishes, numbered 1, 2, ... in order.
    ``send_task`` builds each message as usual, but its ``basic.publish`` is held in memory
    until :meth:`flush` writes them all back to back (so the beat's claim-ahead builds a
    slot's messages before its instant and flushes at it, as with the Redis pipeline).
    Every publish is written without waiting; :meth:`wait` then reads the acks / nacks
    (``multiple`` covers every tag up to it) until all are in, or
    :data:`CONFIRM_TIMEOUT_SECONDS` pass. That is one wait per batch instead of one round
    trip per message (``confirm_publish`` in ``broker_transport_options``), with the same
    guarantee: an ack means the broker has the message (a persistent message to a durable
    queue is on disk, or on a quorum of a quorum queue's replicas).
    """

    def __init__(self, producer: Any, channel: Any) -> None:
        self.channel = channel
        self.connection = producer.connection
        self.producer = type(producer)(
            channel, exchange=producer.exchange, routing_key=producer.routing_key,
            serializer=producer.serializer, compression=producer.compression,
            auto_declare=False)
        self._published = 0
        self._closed = False
        self._tags: dict[int, int] = {}  # delivery tag -> index in the batch
        self._failed: dict[int, Result] = {}
        self._settled: set[int] = set()
        self._by_message_id: dict[str, int] = {}
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        self._publish = channel._basic_publish
        self._held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def held_publish(*args: Any, **kwargs: Any) -> None:
            self._published += 1  # its delivery tag once flushed (flushed in this order)
            self._held.append((args, kwargs))

        channel.basic_publish = held_publish

    def flush(self) -> None:
        """Write every held publish, in order. Raises on a connection error (the caller then
        counts the whole batch unpublished: nothing was confirmed yet)."""
        held, self._held = self._held, []
        if held and self._closed:
            raise ConnectionError("the batch's confirm channel was closed by the broker")
        for args, kwargs in held:
            self._publish(*args, **kwargs)

    def closed_by(self, exc: BaseException) -> bool:
        """True when ``exc`` is an AMQP channel exception: the broker closed this batch's
        channel (py-amqp then reopens it, without confirm mode), so the batch cannot go on.
        """
        from amqp.exceptions import ChannelError

        if isinstance(exc, ChannelError):
            self._closed = True
        return self._closed

    def sent(self, index: int, message_id: str | None = None) -> None:
        """Record that message ``index`` of the batch was just published (one publish);
        ``message_id``: its AMQP ``message_id`` property, for a mandatory publish whose
        ``basic.return`` must be told apart."""
        self._tags[self._published] = index
        if message_id is not None:
            self._by_message_id[message_id] = index

    def _on_return(self, exc: BaseException, exchange: str, routing_key: str,
                   message: Any) -> None:
        # RabbitMQ sends basic.return before the basic.ack of the same message: the ack
        # below then settles its tag without clearing this error.
        index = self._by_message_id.get(str(message.properties.get("message_id")))
        if index is not None:
            self._failed[index] = DeliveryError(
                f"unroutable: no queue is bound to exchange {exchange!r} with routing key "
                f"{routing_key!r} ({exc}); bind one, or fix the row's exchange/routing_key")

    def _settle(self, tag: int, multiple: bool, error: Result) -> None:
        tags = [t for t in self._tags if t <= tag and t not in self._settled] if multiple \
            else [tag]
        for t in tags:
            self._settled.add(t)
            if error is not None and t in self._tags:
                self._failed[self._tags[t]] = error

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, None)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, DestinationUnavailableError(
            "celery broker nacked the publish (e.g. a queue at x-max-length with "
            "x-overflow=reject-publish, or a resource alarm): not published"))

    def wait(self) -> dict[int, Result]:
        """Await the confirms; returns ``{index: error}`` for every message of the batch
        that is not confirmed (nacked, timed out, or the connection failed meanwhile)."""
        deadline = time.monotonic() + CONFIRM_TIMEOUT_SECONDS
        try:
            while len(self._settled & self._tags.keys()) < len(self._tags):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"no publisher confirm within {CONFIRM_TIMEOUT_SECONDS:.0f} s")
                try:
                    self.connection.drain_events(timeout=min(remaining, 1.0))
                except TimeoutError:
                    continue
        except Exception as exc:
            down = DestinationUnavailableError(f"celery broker did not confirm: {exc!r}")
            down.__cause__ = exc
            for tag, index in self._tags.items():
                if tag not in self._settled:
                    self._failed[index] = down
        return dict(self._failed)


def _open_channel(connection: Any) -> Any:
    """A new channel on ``connection``, (re)connecting once if the pooled connection is
    closed or turns out dead (the broker restarted since its last use)."""
    errors = tuple(connection.connection_errors) + tuple(
        connection.recoverable_connection_errors) + (OSError,)
    # One quick retry (Celery's publish retry policy starts at 0 s, steps 0.2 s): a broker
    # that is down fails the batch at once and its rows stay pending for the relay.
    retry = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}
    try:
        if not connection.connected:
            connection.ensure_connection(**retry)
        return connection.channel()
    except errors:
        connection.collect()  # drop the dead socket without talking to the broker
        connection.ensure_connection(**retry)
        return connection.channel()


@contextlib.contextmanager
def _amqp_confirms(producer: Any) -> Iterator[_AmqpConfirms | None]:
    """A confirm-mode channel for one batch on a ``pyamqp`` connection, else None.

    Opening, ``confirm.select`` and closing the channel are three round trips per batch.
    The channel is closed afterwards; if closing fails the connection is left to kombu's
    pool (a broken one is replaced on its next use).
    """
    connection = getattr(producer, "connection", None)
    transport = getattr(connection, "transport", None)
    if getattr(transport, "driver_type", None) != "amqp":
        yield None
        return
    try:
        import amqp
    except ImportError:  # librabbitmq or another AMQP client: no batch confirms
        yield None
        return
    channel = _open_channel(connection)
    if not isinstance(channel, amqp.Channel):
        channel.close()
        yield None
        return
    try:
        channel.confirm_select()
        yield _AmqpConfirms(producer, channel)
    finally:
        with contextlib.suppress(Exception):
            channel.close()

def _is_connection_error(exc: BaseException, conn_errors: tuple[type[BaseException], ...]) -> bool:
    """True when ``exc`` or an exception in its cause chain is a connection-level error (the
    broker as a whole is unreachable), as opposed to the broker refusing one command."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, conn_errors):
            from kombu.exceptions import OperationalError

            # kombu wraps any transport error as OperationalError; look under it
            if type(current) is not OperationalError or current.__cause__ is None:
                return True
        current = current.__cause__ or current.__context__
    return False


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


@contextlib.contextmanager
def _publish_batch(
    producer: Any, size: int
) -> Iterator[tuple[type[BaseException], ...]]:
    """Buffer the publishes of one batch in ONE Redis pipeline, flushed on exit.

    kombu (5.7+) ``Producer.batch()``: ``send_task`` builds and routes every message exactly
    as without it (same body, headers, properties, queue / priority list), only the final
    ``LPUSH`` commands are buffered in a non-transactional pipeline and executed once on
    exit, instead of one client and one round trip per message. The buffer is sized so that
    it never flushes before the exit: a failure then means no message of the batch counts as
    published (the caller's rows stay pending). Transports without batch support (and a
    Redis connection configured to retry writes) publish at once, as before.

    Yields:
        The exception types that mean "the batch is unusable" (kombu's
        ``BatchPublishError``), to treat like a connection error.
    """
    batch = getattr(producer, "batch", None)
    if batch is None or not getattr(producer, "supports_batch_publish", False):
        yield ()
        return
    from kombu.exceptions import BatchPublishError

    # Each message is one LPUSH, plus one PEXPIRE per priority step for a queue with
    # x-expires: size the buffer so that it only flushes on exit.
    with batch(max_size=max(1000, size * 16)):
        yield (BatchPublishError,)


def _pipelined_send_options(app: Any, producer: Any) -> dict[str, Any]:
    """``send_task`` options for the rest of a pipelined (Redis) or confirmed (RabbitMQ)
    batch, once one message went out.

    On RabbitMQ the same reasoning holds with confirms in place of the flush: a publish
    error mid-batch fails the rest as unavailable, and nothing counts as published before
    the broker's confirm (:class:`_AmqpConfirms`).

    The first message of a batch is sent exactly as ``send_task`` would (Celery's publish
    retry policy connects the producer, so a broker that is down fails as fast as without
    the batch). After it, the producer's channel exists and every publish only appends to
    the pipeline, so: no per-message publish retry (a buffered ``LPUSH`` cannot fail before
    the flush, and a failed flush fails the whole batch, see :func:`publish_celery_batch`;
    a queue first seen mid-batch is declared without retry: an error there fails the rest of
    the batch as unavailable, and those rows stay pending for the relay), and the routed
    queue bound once per batch (:class:`_BoundQueueRouter`).
    """
    return {"retry": False, "router": _BoundQueueRouter(app.amqp.router, producer)}


class _BoundQueueRouter:
    """Celery's router, with the routed queue bound to the producer's channel once per batch.

    ``send_task`` declares the routed queue before each publish (``maybe_declare``, cached
    per connection); kombu binds an unbound queue to the channel first, copying the
    :class:`kombu.Queue` on every message (about a fifth of a pipelined ``send_task``).
    This wrapper asks the app's own router for every message (so ``task_routes``, custom
    routers and ``task_create_missing_queues`` decide exactly as in ``send_task``) and only
    swaps the routed queue for a copy bound to the producer's channel, made once per queue
    per batch. The copy has the queue's exchange, routing key, arguments and delivery mode,
    so the message and the declaration are the ones ``send_task`` makes
    (``tests/integration/test_publish_batch.py``).
    """

    def __init__(self, router: Any, producer: Any) -> None:
        self.router = router
        self.producer = producer
        self._bound: dict[int, tuple[Any, Any]] = {}

    def route(self, options: dict[str, Any], name: str, args: Any = (), kwargs: Any = None,
              task_type: Any = None) -> dict[str, Any]:
        routed: dict[str, Any] = self.router.route(options, name, args, kwargs, task_type)
        queue = routed.get("queue")
        if queue is not None and not isinstance(queue, str) and not queue.is_bound:
            cached = self._bound.get(id(queue))
            if cached is None or cached[0] is not queue:
                cached = self._bound[id(queue)] = (queue, queue.bind(self.producer.channel))
            routed["queue"] = cached[1]
        return routed


def _send_one(app: Any, producer: Any, message: OutboxMessage, now: datetime,
              builder: _MessageBuilder | None = None, **send_options: Any) -> None:
    payload = message.payload
    if not isinstance(payload, Mapping) or "task" not in payload:
        raise PermanentDeliveryError(
            f"outbox row {message.id} ({message.message_id}): celery payload needs a 'task' key"
        )
    expires_at = _parse_instant(payload.get("expires_at"))
    if expires_at is not None and expires_at <= now:
        raise MessageExpiredError("expired before publish")
    options = {
        k: v
        for k, v in dict(payload.get("options") or {}).items()
        if k in ("queue", "routing_key", "priority", "exchange") and v is not None
    }
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


#: Header keys of a Celery protocol-2 message that differ per message of one shape (the
#: rest of a shape's headers is the same for every message: see :class:`_MessageBuilder`).
_PER_MESSAGE_HEADERS = frozenset({"id", "root_id", "argsrepr", "kwargsrepr", "expires"})


class _CapturingProducer:
    """The batch's producer as ``send_task`` sees it, recording the one ``publish`` call
    ``send_task`` ends in (body, headers and every keyword), for :class:`_MessageBuilder`.
    Everything else is the real producer's."""

    def __init__(self, producer: Any, builder: _MessageBuilder) -> None:
        self._producer = producer
        self._builder = builder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        # kombu may add to the headers while publishing (``compression``): copy them first
        self._builder.captured = (body, dict(kwargs, headers=dict(kwargs.get("headers") or {})))
        return self._producer.publish(body, **kwargs)


class _MessageBuilder:
    """Builds Celery protocol-2 trigger messages without ``send_task``, for one pipelined
    Redis batch or one publisher-confirmed RabbitMQ (``pyamqp``) batch
    (:func:`publish_celery_batch`; the byte-for-byte proof below is on both brokers).

    ``send_task`` costs about three times the kombu publish it ends in (settings lookups,
    routing, ``as_task_v2``, signals, the result object). Within one batch, every message
    of one *shape* (task name, ``queue`` / ``routing_key`` / ``exchange`` / ``priority``
    options, whether it has an ``expires``) gets the same routing, exchange, serializer,
    compression, delivery mode, declarations and the same protocol headers, except the
    per-message ones: ``id``, ``root_id``, ``argsrepr``, ``kwargsrepr``, ``expires`` (and
    the properties ``correlation_id``, ``expiration``). So the first message of a shape is
    sent by the real ``send_task`` and its ``Producer.publish`` call is recorded (the
    *template*, made by the installed Celery version); the next messages of that shape are
    built from the template with only those fields replaced, the custom headers appended
    as ``send_task`` appends them, and published with the same ``Producer.publish`` call.
    ``tests/integration/test_publish_builder.py`` (Redis) and ``test_publish_builder_amqp.py``
    (RabbitMQ: the raw content header and body frames) prove the messages byte-for-byte equal
    to ``send_task``'s for every option, on every Celery version of the tox matrix.

    The builder is not used (``send_task`` for every message) when the result could differ:
    task protocol 1, receivers on ``before_task_publish`` / ``after_task_publish`` /
    ``task_sent``, ``task_send_sent_event``, a publish from inside a worker task (parent and
    root ids, inherited priority), a router that is not a ``task_routes`` map (a router
    function may route on the arguments). A shape is sent with ``send_task`` every time
    when its template has an ``eta`` (a task-level countdown is relative to the publish), a
    ``root_id`` other than its id, or a custom header that names a protocol header.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.captured: tuple[Any, dict[str, Any]] | None = None
        self._templates: dict[tuple[Any, ...], Any] = {}
        on_task_call = type(app.backend).on_task_call
        from celery.backends.base import Backend

        self._on_task_call = None if on_task_call is Backend.on_task_call else \
            app.backend.on_task_call

    @classmethod
    def for_batch(cls, app: Any) -> _MessageBuilder | None:
        """A builder for one batch, or None when ``send_task`` must send every message."""
        from celery import signals
        from celery.app.routes import MapRoute

        conf = app.conf
        if int(conf.task_protocol) != 2 or conf.task_send_sent_event:
            return None
        for signal in (signals.before_task_publish, signals.after_task_publish,
                       signals.task_sent):
            if signal.receivers:
                return None
        if app.current_worker_task is not None:
            return None
        if not all(isinstance(route, MapRoute) for route in app.amqp.router.routes):
            return None
        return cls(app)

    @staticmethod
    def _shape(name: str, expires_at: datetime | None,
               options: Mapping[str, Any]) -> tuple[Any, ...]:
        return (name, expires_at is None, tuple(sorted(options.items())))

    def learn(self, name: str, args: list[Any], kwargs: dict[str, Any], task_id: str,
              custom: Mapping[str, Any], expires_at: datetime | None,
              options: Mapping[str, Any]) -> None:
        """Keep the publish ``send_task`` just made as the template of its shape."""
        captured, self.captured = self.captured, None
        shape = self._shape(name, expires_at, options)
        if captured is None or shape in self._templates:
            return
        body, kwargs_ = captured
        headers = kwargs_["headers"]
        usable = (
            isinstance(body, tuple) and len(body) == 3
            and headers.get("id") == task_id and headers.get("root_id") == task_id
            and headers.get("eta") is None and kwargs_.get("correlation_id") == task_id
            and ("expiration" in kwargs_) == (expires_at is not None)
        )
        # ``send_task`` appends the custom headers after its own; a custom header that names
        # one of its own (a header a newer Celery added) stays at that one's place instead
        items = list(headers.items())
        split = len(items) - len(custom)
        if not usable or split < 0 or [k for k, _ in items[split:]] != list(custom):
            self._templates[shape] = None  # this shape: send_task every time
            return
        protocol = dict(items[:split])
        self._templates[shape] = (body[2], protocol, kwargs_, args, kwargs)

    def publish(self, producer: Any, name: str, args: list[Any], kwargs: dict[str, Any],
                task_id: str, custom: Mapping[str, Any], expires_at: datetime | None,
                options: Mapping[str, Any]) -> bool:
        """Publish one message built from its shape's template; False: no template (the
        caller sends it with ``send_task``, which makes one)."""
        template = self._templates.get(self._shape(name, expires_at, options))
        if template is None:
            return False
        embed, protocol, publish_kwargs, t_args, t_kwargs = template
        if any(k in protocol for k in custom):
            return False
        args_: Any = args or ()  # as ``as_task_v2``: no arguments are an empty tuple
        kwargs_: Any = kwargs or {}
        headers = dict(protocol)
        headers["id"] = headers["root_id"] = task_id
        if args == t_args and kwargs == t_kwargs:
            shown = protocol["argsrepr"], protocol["kwargsrepr"]
        else:  # as _send_one passes them to send_task: redacted (reliable_beat.celery.reprs)
            shown = shown_reprs(self.app, args, kwargs)
        headers["argsrepr"], headers["kwargsrepr"] = shown
        publish = dict(publish_kwargs, headers=headers, correlation_id=task_id)
        for name, value in zip(("argsrepr", "kwargsrepr"), shown, strict=True):
            if name in publish:  # send_task also passes its options on as properties
                publish[name] = value
        if expires_at is not None:
            headers["expires"] = expires_at.isoformat()
            seconds = (expires_at - self.app.now()).total_seconds()
            publish["expiration"] = max(seconds, 0)
        headers.update(custom)
        body = (args_, kwargs_, dict(embed))
        with producer.connection._reraise_as_library_errors():
            if self._on_task_call is not None and not protocol.get("ignore_result"):
                self._on_task_call(producer, task_id)
            producer.publish(body, **publish)
        return True


def _custom_headers(raw: Any, message: OutboxMessage) -> dict[str, Any]:
    """A row's custom headers without Celery's protocol headers (``task``, ``id``, ...).

    A custom header with a protocol name would override the message's own (an entry for
    task A sent with ``task=B`` ran B): such keys are dropped and logged at WARNING.
    """
    if not isinstance(raw, Mapping):
        if raw:
            log.warning("outbox row %d (%s): 'headers' is not an object; ignored",
                        message.id, message.message_id)
        return {}
    headers = {}
    dropped = []
    for key, value in raw.items():
        if str(key).lower() in CELERY_PROTOCOL_HEADERS:
            dropped.append(str(key))
        else:
            headers[str(key)] = value
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
