"""Outbox handlers: deliver an :class:`~reliable_beat.outbox.OutboxMessage` to the outside.

A handler is any callable ``handler(message) -> None`` that raises on failure:

* :class:`~reliable_beat.errors.PermanentDeliveryError`: retrying cannot help; the row is
  dead-lettered at once (e.g. HTTP 4xx other than 408/429, SMTP 5xx).
* :class:`DestinationUnavailableError`: the destination as a whole is down (broker refused
  the connection); the relay backs the whole batch off *without* charging the rows an
  attempt, so a long broker outage makes rows accumulate, never dead-letter.
* any other exception: retried with full-jitter backoff up to ``outbox_max_attempts``.

A handler may also offer ``deliver_batch(messages) -> list[BaseException | None]`` (one
result per message, in order) to deliver many messages over one connection; the relay uses
it when present.

Built-ins (payload shapes are JSON objects):

* ``celery``: ``{"task", "args", "kwargs", "task_id"?, "headers"?, "options"?:
  {"queue", "routing_key", "priority", "exchange"}, "expires_at"?: ISO-8601 UTC or null}``;
  sent with ``send_task`` over one producer per batch; the task id is ``task_id`` or
  ``uuid5(message_id)``, so a re-delivery carries the same task id.
* ``kombu``: ``{"exchange": "" , "exchange_type"?: "direct", "routing_key", "body",
  "serializer"?: "json", "headers"?}``; raw publish with ``message_id`` set.
* ``webhook``: ``{"url", "body", "method"?: "POST", "headers"?, "timeout_seconds"?: 10}``;
  POST of ``body`` as JSON with ``Idempotency-Key: <message_id>`` (needs the ``http`` extra,
  httpx).
* ``smtp``: ``{"from", "to": str | [str], "cc"?, "subject", "text", "html"?}``; host and
  port from the message headers ``smtp_host``/``smtp_port``, else the environment
  ``RELIABLE_BEAT_SMTP_HOST``/``RELIABLE_BEAT_SMTP_PORT``, else ``localhost:25``; the e-mail
  carries ``Message-ID: <message_id@reliable-beat>`` (characters not allowed there are
  %-escaped).

User handlers: ``reliable_beat_outbox_handlers = {"name": "package.module:attr"}`` in the
Celery config, or the entry point group ``reliable_beat.outbox_handlers``. The object named
is used as the handler; a class is instantiated with no arguments first.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import smtplib
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from email.message import EmailMessage
from email.utils import formatdate
from typing import Any, Protocol, runtime_checkable
from urllib.parse import quote

from reliable_beat.errors import ConfigurationError, DeliveryError, PermanentDeliveryError
from reliable_beat.outbox import OutboxMessage

__all__ = [
    "ENTRY_POINT_GROUP",
    "BatchHandler",
    "CeleryHandler",
    "DestinationUnavailableError",
    "Handler",
    "KombuHandler",
    "MessageExpiredError",
    "SmtpHandler",
    "WebhookHandler",
    "celery_task_id",
    "load_handlers",
    "publish_celery_batch",
]

log = logging.getLogger(__name__)

#: Entry point group for user handlers: ``name = "package.module:attr"``.
ENTRY_POINT_GROUP = "reliable_beat.outbox_handlers"

Result = BaseException | None


class DestinationUnavailableError(DeliveryError):
    """The destination as a whole cannot be reached (e.g. the broker refused the connection).

    The relay releases the batch with a backoff and does not count the attempt against the
    rows, so an outage never dead-letters messages. (Belongs in :mod:`reliable_beat.errors`.)
    """


class MessageExpiredError(PermanentDeliveryError):
    """A Celery trigger's ``expires_at`` passed before it could be published.

    The relay marks the row ``sent`` with ``last_error = "expired before publish"`` and the
    linked run ``skipped`` with reason ``expired``; it is not dead-lettered.
    """


@runtime_checkable
class Handler(Protocol):
    """Delivers one message; raises on failure (see the module docstring)."""

    def __call__(self, message: OutboxMessage) -> None: ...


@runtime_checkable
class BatchHandler(Handler, Protocol):
    """A handler that can deliver many messages over one connection."""

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[Result]:
        """Deliver ``messages`` in order; return one ``None`` or exception per message."""
        ...


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
    ``Producer.batch()``, see :func:`_publish_batch`); other transports publish per message.

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
    conn_errors: tuple[type[BaseException], ...] = ()
    try:
        with app.producer_or_acquire() as producer:
            conn_errors = _connection_errors(producer)
            with _publish_batch(producer, len(messages)) as batch_error:
                send_options: dict[str, Any] = {}
                if wait is not None and not batch_error:
                    wait()  # no buffering: every send_task below reaches the broker at once
                for index, message in enumerate(messages):
                    try:
                        _send_one(app, producer, message, now, **send_options)
                        results.append((message.id, None))
                        if batch_error and not send_options:
                            send_options = _pipelined_send_options(app, producer)
                    except MessageExpiredError as exc:
                        results.append((message.id, exc))
                    except conn_errors + batch_error as exc:
                        if not _is_connection_error(exc, conn_errors):
                            raise  # the broker refused a command: isolate the culprit below
                        down = DestinationUnavailableError(f"celery broker unavailable: {exc!r}")
                        down.__cause__ = exc
                        results.extend((m.id, down) for m in messages[index:])
                        break
                    except Exception as exc:
                        results.append((message.id, exc))
                if wait is not None and batch_error:
                    wait()  # buffered: leaving the batch flushes, i.e. publishes
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
        down = DestinationUnavailableError(f"celery broker unavailable: {exc!r}")
        down.__cause__ = exc
        # Buffered messages were not (or not surely) written: none counts as published.
        # The rows stay pending and the relay re-publishes them under the same task id.
        results = [(m.id, done.get(m.id, down)) for m in messages]
    return results


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


def _publish_one_by_one(
    app: Any, messages: Sequence[OutboxMessage], now: datetime
) -> list[tuple[int, Result]]:
    """Publish each message with its own ``send_task`` (no pipeline): an error then belongs
    to that message; a connection-level error fails the rest as unavailable."""
    results: list[tuple[int, Result]] = []
    try:
        with app.producer_or_acquire() as producer:
            conn_errors = _connection_errors(producer)
            for index, message in enumerate(messages):
                try:
                    _send_one(app, producer, message, now)
                    results.append((message.id, None))
                except MessageExpiredError as exc:
                    results.append((message.id, exc))
                except Exception as exc:
                    if _is_connection_error(exc, conn_errors):
                        down = DestinationUnavailableError(
                            f"celery broker unavailable: {exc!r}")
                        down.__cause__ = exc
                        results.extend((m.id, down) for m in messages[index:])
                        break
                    log.warning("celery trigger %s (outbox row %d) refused by the broker: %r",
                                message.message_id, message.id, exc)
                    results.append((message.id, exc))
    except Exception as exc:  # acquiring / releasing the producer
        down = DestinationUnavailableError(f"celery broker unavailable: {exc!r}")
        down.__cause__ = exc
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
    """``send_task`` options for the rest of a pipelined batch, once one message went out.

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
              **send_options: Any) -> None:
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
    headers = dict(payload.get("headers") or {})
    headers.setdefault("reliable_beat_message_id", message.message_id)
    app.send_task(
        payload["task"],
        args=list(payload.get("args") or []),
        kwargs=dict(payload.get("kwargs") or {}),
        task_id=celery_task_id(message),
        headers=headers,
        expires=expires_at,
        producer=producer,
        **options,
        **send_options,
    )


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
        """Publish every message over one connection, in order."""
        import kombu

        results: list[Result] = []
        try:
            if self.app is not None:
                conn = self.app.connection_for_write()
            else:
                conn = kombu.Connection(self.url)  # type: ignore[attr-defined,no-untyped-call]
            with conn, conn.Producer() as producer:
                conn_errors = _connection_errors(producer)
                for index, message in enumerate(messages):
                    try:
                        self._publish(kombu, producer, message)
                        results.append(None)
                    except conn_errors as exc:
                        down = DestinationUnavailableError(f"kombu broker unavailable: {exc!r}")
                        down.__cause__ = exc
                        results.extend([down] * (len(messages) - index))
                        break
                    except Exception as exc:
                        results.append(exc)
        except Exception as exc:
            down = DestinationUnavailableError(f"kombu broker unavailable: {exc!r}")
            down.__cause__ = exc
            results.extend([down] * (len(messages) - len(results)))
        return results

    @staticmethod
    def _publish(kombu: Any, producer: Any, message: OutboxMessage) -> None:
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
        )


# --------------------------------------------------------------------------- webhook


class WebhookHandler:
    """Destination ``webhook``: POST JSON with ``Idempotency-Key: <message_id>``.

    2xx is delivered. 408, 429, 5xx and transport errors are retried. Any other status (3xx,
    other 4xx) raises :class:`~reliable_beat.errors.PermanentDeliveryError`. Needs httpx
    (the ``http`` extra). The client is kept, so connections to one host are reused.
    """

    def __init__(self, timeout_seconds: float = 10.0) -> None:
        try:
            import httpx
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ConfigurationError(
                "the webhook outbox handler needs httpx: pip install 'reliable-beat[http]'"
            ) from exc
        self._httpx = httpx
        self.client = httpx.Client(timeout=timeout_seconds, follow_redirects=False)

    def __call__(self, message: OutboxMessage) -> None:
        p = message.payload
        if not isinstance(p, Mapping) or "url" not in p:
            raise PermanentDeliveryError(f"outbox row {message.id}: webhook payload needs 'url'")
        headers = {str(k): str(v) for k, v in dict(p.get("headers") or {}).items()}
        headers["Idempotency-Key"] = message.message_id
        try:
            response = self.client.request(
                str(p.get("method", "POST")).upper(),
                p["url"],
                json=p.get("body"),
                headers=headers,
                timeout=p.get("timeout_seconds", self.client.timeout),
            )
        except self._httpx.HTTPError as exc:
            raise DeliveryError(f"webhook {p['url']}: {exc!r}") from exc
        status = response.status_code
        if 200 <= status < 300:
            return
        detail = f"webhook {p['url']} answered HTTP {status}: {response.text[:200]!r}"
        if status in (408, 429) or status >= 500:
            raise DeliveryError(detail)
        raise PermanentDeliveryError(detail)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.client.close()


# --------------------------------------------------------------------------- smtp


_MSGID_SAFE = "!#$%&'*+/=?^_`{|}~.-"


def smtp_message_id(message_id: str) -> str:
    """The e-mail ``Message-ID`` of an outbox message: ``<escaped id@reliable-beat>``."""
    return f"<{quote(message_id, safe=_MSGID_SAFE)}@reliable-beat>"


class SmtpHandler:
    """Destination ``smtp``: an e-mail whose ``Message-ID`` is derived from the message id.

    SMTP 5xx answers and refused recipients are permanent; 4xx and connection errors are
    retried. Batches to the same host share one SMTP session.

    Args:
        host / port: default server; the message headers ``smtp_host`` / ``smtp_port``
            override them per message.
        timeout_seconds: socket timeout.
    """

    def __init__(
        self, host: str | None = None, port: int | None = None, timeout_seconds: float = 30.0
    ) -> None:
        self.host = host or os.environ.get("RELIABLE_BEAT_SMTP_HOST", "localhost")
        self.port = int(port or os.environ.get("RELIABLE_BEAT_SMTP_PORT", "25"))
        self.timeout_seconds = timeout_seconds

    def _target(self, message: OutboxMessage) -> tuple[str, int]:
        h = message.headers or {}
        return str(h.get("smtp_host", self.host)), int(h.get("smtp_port", self.port))

    @staticmethod
    def build(message: OutboxMessage) -> EmailMessage:
        """The :class:`email.message.EmailMessage` for ``message``.

        Raises:
            PermanentDeliveryError: the payload lacks ``from``, ``to`` or ``subject``.
        """
        p = message.payload
        if not isinstance(p, Mapping) or not all(k in p for k in ("from", "to", "subject")):
            raise PermanentDeliveryError(
                f"outbox row {message.id}: smtp payload needs 'from', 'to' and 'subject'"
            )
        email = EmailMessage()
        email["From"] = p["from"]
        to = p["to"]
        email["To"] = ", ".join(to) if isinstance(to, list) else str(to)
        if p.get("cc"):
            cc = p["cc"]
            email["Cc"] = ", ".join(cc) if isinstance(cc, list) else str(cc)
        email["Subject"] = p["subject"]
        email["Message-ID"] = smtp_message_id(message.message_id)
        email["Date"] = formatdate(usegmt=True)
        email.set_content(p.get("text", ""))
        if p.get("html"):
            email.add_alternative(p["html"], subtype="html")
        return email

    def __call__(self, message: OutboxMessage) -> None:
        error = self.deliver_batch([message])[0]
        if error is not None:
            raise error

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[Result]:
        """Send each message, one SMTP session per (host, port) in the batch."""
        results: dict[int, Result] = {}
        groups: dict[tuple[str, int], list[tuple[int, OutboxMessage]]] = {}
        for index, m in enumerate(messages):
            groups.setdefault(self._target(m), []).append((index, m))
        for (host, port), items in groups.items():
            try:
                with smtplib.SMTP(host, port, timeout=self.timeout_seconds) as client:
                    for index, m in items:
                        results[index] = self._send(client, m)
            except (OSError, smtplib.SMTPException) as exc:
                err = DeliveryError(f"smtp {host}:{port}: {exc!r}")
                err.__cause__ = exc
                for index, _ in items:
                    results.setdefault(index, err)
        return [results[i] for i in range(len(messages))]

    def _send(self, client: smtplib.SMTP, message: OutboxMessage) -> Result:
        try:
            client.send_message(self.build(message))
            return None
        except PermanentDeliveryError as exc:
            return exc
        except smtplib.SMTPRecipientsRefused as exc:
            return _chain(PermanentDeliveryError(f"smtp: recipients refused: {exc!r}"), exc)
        except smtplib.SMTPResponseException as exc:
            if exc.smtp_code >= 500:
                return _chain(PermanentDeliveryError(f"smtp: {exc.smtp_code} {exc!r}"), exc)
            return _chain(DeliveryError(f"smtp: {exc.smtp_code} {exc!r}"), exc)
        except smtplib.SMTPServerDisconnected:
            raise  # the session is gone: the caller fails the rest of the group
        except smtplib.SMTPException as exc:
            return _chain(DeliveryError(f"smtp: {exc!r}"), exc)


def _chain(error: DeliveryError, cause: BaseException) -> DeliveryError:
    error.__cause__ = cause
    return error


# --------------------------------------------------------------------------- registry


def _resolve(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not attr:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigurationError(f"outbox handler {path!r}: expected 'package.module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"outbox handler {path!r} cannot be imported: {exc}") from exc
    return obj


def _instantiate(name: str, obj: Any) -> Callable[[OutboxMessage], None]:
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise ConfigurationError(f"outbox handler {name!r} ({obj!r}) is not callable")
    return obj  # type: ignore[no-any-return]


def load_handlers(
    app: Any = None,
    configured: Mapping[str, str] | None = None,
    extra: Mapping[str, Callable[[OutboxMessage], None]] | None = None,
) -> dict[str, Callable[[OutboxMessage], None]]:
    """The destination -> handler map a relay uses.

    Later sources override earlier ones: built-ins (``celery`` and ``kombu`` only when an app
    is given, ``webhook`` only when httpx is installed, ``smtp``), then the entry point group
    :data:`ENTRY_POINT_GROUP`, then ``configured`` (``reliable_beat_outbox_handlers``), then
    ``extra`` (handler objects passed in code).

    Raises:
        ConfigurationError: a configured handler cannot be imported or is not callable.
    """
    handlers: dict[str, Callable[[OutboxMessage], None]] = {}
    if app is not None:
        handlers["celery"] = CeleryHandler(app)
        handlers["kombu"] = KombuHandler(app)
    try:
        handlers["webhook"] = WebhookHandler()
    except ConfigurationError:  # pragma: no cover - httpx missing
        log.info("webhook outbox handler disabled: httpx is not installed")
    handlers["smtp"] = SmtpHandler()
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            handlers[ep.name] = _instantiate(ep.name, ep.load())
        except Exception as exc:
            raise ConfigurationError(
                f"outbox handler entry point {ep.name!r} ({ep.value}) failed to load: {exc}"
            ) from exc
    for name, path in (configured or {}).items():
        handlers[name] = _instantiate(name, _resolve(path))
    handlers.update(extra or {})
    return handlers
