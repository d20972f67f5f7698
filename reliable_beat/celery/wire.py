"""How a batch of Celery triggers reaches the broker: the wire level of
:func:`reliable_beat.celery.publishing.publish_celery_batch`.

:mod:`reliable_beat.celery.publishing` decides what a batch of outbox rows becomes and what
each publish result means (payload shapes, expiry, custom headers, a hung broker, the
``celery`` / ``kombu`` handlers); this module holds the broker-side machinery it drives:

* Redis: one pipeline per batch (kombu's ``Producer.batch()``, :func:`_publish_batch`).
* RabbitMQ (kombu ``pyamqp``): a confirm-mode channel per batch, the publishes held and
  written back to back, the broker's confirms awaited once (:class:`_AmqpConfirms`,
  :func:`_amqp_confirms`).
* Both: trigger messages built from a template of ``send_task``'s first publish of each
  shape, byte for byte the same (:class:`_MessageBuilder`), the routed queue bound once per
  batch (:class:`_BoundQueueRouter`), and which errors mean "the broker is unreachable"
  (:func:`_connection_errors`, :func:`_is_connection_error`).

Nothing here touches the database or decides a row's fate.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from reliable_beat.celery.reprs import shown_reprs
from reliable_beat.errors import DeliveryError
from reliable_beat.handlers import DestinationUnavailableError
from reliable_beat.outbound.base import Result

__all__: list[str] = []


def _connection_errors(producer: Any) -> tuple[type[BaseException], ...]:
    from kombu.exceptions import OperationalError

    errors: tuple[type[BaseException], ...] = (OperationalError, OSError, ConnectionError)
    with contextlib.suppress(Exception):  # a transport without the attribute
        errors += tuple(producer.connection.connection_errors)
    return errors


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
        _coalesce_pushes(producer)  # the batch was built without error: it flushes next


def _coalesce_pushes(producer: Any) -> int:
    """Merge each run of consecutive buffered ``LPUSH``es to one key in ``producer``'s
    Redis batch into one multi-value ``LPUSH`` (the same values in the same order), before
    the batch's flush.

    ``LPUSH k a`` then ``LPUSH k b`` and ``LPUSH k a b`` leave the same list (each value is
    pushed at the head, left to right), and a non-transactional pipeline runs its commands
    one after the other either way; a refused ``LPUSH`` (``WRONGTYPE``) refuses every value
    for that key in both forms. What changes is the client's work: one command to pack and
    one reply to parse per run instead of one per message (most of redis-py's per-message
    cost in a pipeline: 500 pushes of ~700 bytes, 8 -> 2 us per message). Anything other
    than a plain ``LPUSH`` (a ``PEXPIRE`` of a queue with ``x-expires``, another key) ends
    a run. Does nothing unless the batch is a kombu Redis publish batch holding a redis-py
    pipeline.

    Returns:
        How many commands the merge removed.
    """
    state = _batch_state(producer)
    pipeline = getattr(getattr(state, "session", None), "pipeline", None)
    stack = getattr(pipeline, "command_stack", None)
    if not isinstance(stack, list) or len(stack) < 2:
        return 0
    merged: list[Any] = []
    values: list[Any] | None = None  # the values of the run being merged (its last command)
    key: Any = None
    removed = 0
    if not all(isinstance(c, tuple) and len(c) == 2 for c in stack):
        return 0  # not redis-py's (args, options) pairs: a client this was not made for
    for command in stack:
        args, options = command
        if (isinstance(args, tuple) and len(args) >= 3 and args[0] == "LPUSH"
                and not options):
            if values is not None and args[1] == key:
                values.extend(args[2:])
                removed += 1
                continue
            key, values = args[1], list(args[2:])
            merged.append((key, values))
            continue
        values = None
        merged.append(command)
    if removed:
        stack[:] = [(("LPUSH", item[0], *item[1]), {}) if isinstance(item[1], list) else item
                    for item in merged]
    return removed


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
        self._builder.prepared = None
        state = _batch_state(self._producer)
        if state is None:
            return self._producer.publish(body, **kwargs)
        # a Redis batch: also record the prepared message kombu hands the batch (before the
        # channel adds its body encoding, delivery tag and delivery info), for _RawTemplate
        real = state.publish

        def recording(channel: Any, message: Any, **publish_kwargs: Any) -> Any:
            props = dict(message["properties"])
            props["delivery_info"] = dict(props.get("delivery_info") or {})
            self._builder.prepared = (channel, dict(message, headers=dict(message["headers"]),
                                                    properties=props), publish_kwargs)
            return real(channel, message, **publish_kwargs)

        state.publish = recording
        try:
            return self._producer.publish(body, **kwargs)
        finally:
            del state.publish  # the instance attribute: the class's method again


def _batch_state(producer: Any) -> Any:
    """kombu's active ``Producer.batch()`` state of ``producer`` (kombu 5.7+), or None."""
    local = getattr(producer, "_batch_local", None)
    return None if local is None else getattr(local, "current", None)


class _RawTemplate:
    """What ``Producer.publish`` hands a Redis batch for one message shape, minus what
    changes per message: the batch's messages of that shape are handed to the batch
    directly (:meth:`_MessageBuilder.publish`), skipping ``Producer.publish`` (its argument
    handling, the declarations already made by the shape's first message, ``ensure``).

    Kept only when re-serialising the template's body with the serializer it was sent with
    gives the very bytes kombu prepared and kombu added no header (no compression): the
    hand-made prepared message is then the one ``Producer.publish`` would make, and the
    channel turns it into the same Redis command
    (``tests/integration/test_publish_builder.py``).
    """

    __slots__ = ("batch_kwargs", "channel", "content_encoding", "content_type", "properties",
                 "serializer", "shows_reprs")

    def __init__(self, channel: Any, properties: dict[str, Any], batch_kwargs: dict[str, Any],
                 serializer: Any, content_type: str, content_encoding: str) -> None:
        self.channel = channel
        self.properties = properties
        self.batch_kwargs = batch_kwargs
        self.serializer = serializer
        self.content_type = content_type
        self.content_encoding = content_encoding
        #: the properties carry ``argsrepr`` / ``kwargsrepr`` (replaced per message)
        self.shows_reprs = "argsrepr" in properties or "kwargsrepr" in properties

    @classmethod
    def of(cls, prepared: Any, body: Any, publish_kwargs: Mapping[str, Any],
           task_id: str, expires: bool, dumps: Any) -> _RawTemplate | None:
        """The template of a recorded prepared message, or None when it cannot be proven
        (``dumps``: kombu's serializer registry's ``dumps``)."""
        if prepared is None:
            return None
        channel, message, batch_kwargs = prepared
        props = message["properties"]
        serializer = publish_kwargs.get("serializer")
        if (publish_kwargs.get("compression") is not None
                or publish_kwargs.get("content_type") is not None
                or message["headers"] != publish_kwargs.get("headers")
                or props.get("correlation_id") != task_id
                or props.get("delivery_info") != {}
                or ("expiration" in props) != expires):
            return None
        try:
            content_type, content_encoding, data = dumps(body, serializer=serializer)
        except Exception:  # pragma: no cover - it was just serialised the same way
            return None
        if (data != message["body"] or content_type != message["content-type"]
                or content_encoding != message["content-encoding"]):
            return None
        return cls(channel, props, dict(batch_kwargs), serializer, content_type,
                   content_encoding)


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
    as ``send_task`` appends them, and published with the same ``Producer.publish`` call;
    in a Redis batch they are handed straight to kombu's batch as the prepared message
    ``Producer.publish`` would make (:class:`_RawTemplate`, when the template proves it).
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
        #: (channel, prepared message, batch kwargs) of the last captured publish in a batch
        self.prepared: tuple[Any, dict[str, Any], dict[str, Any]] | None = None
        from kombu.exceptions import OperationalError
        from kombu.serialization import dumps

        self._dumps: Any = dumps
        self._operational_error: type[Exception] = OperationalError
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
        return (name, expires_at is None, tuple(sorted(options.items())) if options else ())

    def learn(self, name: str, args: list[Any], kwargs: dict[str, Any], task_id: str,
              custom: Mapping[str, Any], expires_at: datetime | None,
              options: Mapping[str, Any]) -> None:
        """Keep the publish ``send_task`` just made as the template of its shape."""
        captured, self.captured = self.captured, None
        prepared, self.prepared = self.prepared, None
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
        raw = _RawTemplate.of(prepared, body, kwargs_, task_id, expires_at is not None,
                              self._dumps)
        self._templates[shape] = (body[2], protocol, kwargs_, args, kwargs, raw)

    def publish(self, producer: Any, name: str, args: list[Any], kwargs: dict[str, Any],
                task_id: str, custom: Mapping[str, Any], expires_at: datetime | None,
                options: Mapping[str, Any]) -> bool:
        """Publish one message built from its shape's template; False: no template (the
        caller sends it with ``send_task``, which makes one)."""
        template = self._templates.get(self._shape(name, expires_at, options))
        if template is None:
            return False
        embed, protocol, publish_kwargs, t_args, t_kwargs, raw = template
        for k in custom:
            if k in protocol:
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
        expiration = None
        if expires_at is not None:
            headers["expires"] = expires_at.isoformat()
            expiration = max((expires_at - self.app.now()).total_seconds(), 0)
        if custom:
            headers.update(custom)
        body = (args_, kwargs_, dict(embed))
        state = None if raw is None else _batch_state(producer)
        if state is not None and producer.channel is raw.channel:
            # Producer.publish's own steps for this shape, done once for the template
            content_type, content_encoding, data = self._dumps(body, serializer=raw.serializer)
            if content_type == raw.content_type and content_encoding == raw.content_encoding:
                props = raw.properties.copy()
                props["correlation_id"] = task_id
                props["delivery_info"] = {}
                if raw.shows_reprs:
                    for name, value in zip(("argsrepr", "kwargsrepr"), shown, strict=True):
                        if name in props:
                            props[name] = value
                if expiration is not None:
                    props["expiration"] = str(int(expiration * 1000))
                message = {"body": data, "content-encoding": content_encoding,
                           "content-type": content_type, "headers": headers,
                           "properties": props}
                # kombu's Connection._reraise_as_library_errors(), inline (no context
                # manager per message): a transport error becomes kombu's OperationalError
                try:
                    if self._on_task_call is not None and not protocol.get("ignore_result"):
                        self._on_task_call(producer, task_id)
                    state.publish(raw.channel, message, **raw.batch_kwargs)
                except self._operational_error:
                    raise
                except producer.connection.recoverable_connection_errors as exc:
                    raise self._operational_error(str(exc)) from exc
                except producer.connection.recoverable_channel_errors as exc:
                    raise self._operational_error(str(exc)) from exc
                return True
        publish = dict(publish_kwargs, headers=headers, correlation_id=task_id)
        for name, value in zip(("argsrepr", "kwargsrepr"), shown, strict=True):
            if name in publish:  # send_task also passes its options on as properties
                publish[name] = value
        if expiration is not None:
            publish["expiration"] = expiration
        with producer.connection._reraise_as_library_errors():
            if self._on_task_call is not None and not protocol.get("ignore_result"):
                self._on_task_call(producer, task_id)
            producer.publish(body, **publish)
        return True
