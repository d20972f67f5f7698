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

* ``celery`` and ``kombu``: a framework app's broker, given by its adapter
  (:mod:`reliable_beat.adapters`) when the relay runs with an app; the Celery ones live in
  :mod:`reliable_beat.celery.publishing` (payload shapes there).
* ``webhook``: ``{"destination", "path", "body", "method"?: "POST"}``; the request goes
  to an operator-configured destination (``reliable_beat_webhook_destinations``: base URL,
  auth headers, overall deadline, concurrency) + ``path``, with the body as JSON and
  ``Idempotency-Key: <message_id>`` (needs the ``http`` extra). See :class:`WebhookHandler`.
* ``smtp``: ``{"to": str | [str], "cc"?, "subject", "text", "html"?, "from"?}``; server,
  port, STARTTLS (default on) and credentials from ``reliable_beat_smtp`` only; the e-mail
  carries ``Message-ID: <message_id@reliable-beat>`` (characters not allowed there are
  %-escaped). See :class:`SmtpHandler`.

Celery protocol headers (``task``, ``id``, ``eta``, ... :data:`CELERY_PROTOCOL_HEADERS`) in
a ``celery`` row's ``headers`` are dropped (WARNING): they never override the message's own.

No Celery or kombu here: ``CeleryHandler``, ``KombuHandler``, ``publish_celery_batch`` and
``celery_task_id`` moved to :mod:`reliable_beat.celery.publishing` (still importable from
this module by their old names, resolved on first use).

User handlers: ``reliable_beat_outbox_handlers = {"name": "package.module:attr"}`` in the
Celery config, or the entry point group ``reliable_beat.outbox_handlers``. The object named
is used as the handler; a class is instantiated with no arguments first.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import smtplib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from email import errors as email_errors
from email import policy as email_policy
from email.message import EmailMessage
from email.utils import formatdate
from typing import Any, Protocol, runtime_checkable
from urllib.parse import quote, urlsplit

from reliable_beat import tracing
from reliable_beat.errors import ConfigurationError, DeliveryError, PermanentDeliveryError
from reliable_beat.messages import OutboxMessage
from reliable_beat.redaction import get_logger
from reliable_beat.values import to_plain_json
from reliable_beat.webhook_guard import (
    blocked_reason,
    header_name_problem,
    header_value_problem,
    normalise_path,
)

__all__ = [
    "CELERY_PROTOCOL_HEADERS",
    "ENTRY_POINT_GROUP",
    "BatchHandler",
    "BlockedAddressError",
    "DestinationUnavailableError",
    "Handler",
    "MessageExpiredError",
    "SmtpConfig",
    "SmtpHandler",
    "WebhookDestination",
    "WebhookHandler",
    "blocked_reason",
    "load_handlers",
    "parse_webhook_destinations",
    "smtp_message_id",
]

log = get_logger(__name__)

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


# --------------------------------------------------------------------------- webhook

#: Celery message-protocol headers (``task``, ``id``, ``eta``, ...): the message's own, never
#: taken from an entry's ``options["headers"]`` or a row's ``headers``.
CELERY_PROTOCOL_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps", "chord", "callbacks", "errbacks",
    "chain", "task_id", "content_type", "content_encoding", "correlation_id", "reply_to",
})

#: Request headers a row or a destination never sets (the handler or HTTP owns them).
_RESERVED_HTTP_HEADERS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "idempotency-key",
    "content-type", "te", "upgrade", "proxy-authorization",
})
_DEFAULT_WEBHOOK_TIMEOUT = 10.0
_DEFAULT_WEBHOOK_CONCURRENCY = 4
_DESTINATION_KEYS = frozenset({
    "base_url", "headers", "timeout_seconds", "max_concurrency", "methods",
    "block_private_networks",
})


def _secret(value: Any, what: str, environ: Mapping[str, str]) -> str:
    """A setting value that may be given as ``{"env": "NAME"}`` (read from the environment)."""
    if isinstance(value, Mapping) and set(value) == {"env"}:
        name = value["env"]
        if not isinstance(name, str) or name not in environ:
            raise ConfigurationError(
                f"{what}: environment variable {name!r} is not set (set it in the relay's "
                "environment, or give the value itself)"
            )
        return environ[name]
    if not isinstance(value, str):
        raise ConfigurationError(
            f"{what}={type(value).__name__}: expected a string or {{'env': 'VARIABLE'}}"
        )
    return value


@dataclass(frozen=True)
class WebhookDestination:
    """One operator-configured webhook destination (``reliable_beat_webhook_destinations``).

    Attributes:
        name: the name rows use (``{"destination": name, "path": ..., "body": ...}``).
        base_url: ``http(s)://host[:port][/prefix]``; a row's path is appended to it and can
            never leave it (other host, port, scheme or a path outside the prefix).
        headers: request headers added to every request (auth headers belong here; values
            given as ``{"env": "NAME"}`` are read from the relay's environment).
        timeout_seconds: overall deadline of one request (connect, send, headers and body
            read together), seconds, > 0 and at most ``reliable_beat_webhook_max_timeout_seconds``.
        max_concurrency: most requests in flight to this destination at once, per relay
            process (1..64).
        methods: HTTP methods a row may ask for (default ``{"POST"}``).
        block_private_networks: refuse to connect to private, loopback, link-local,
            multicast, reserved or unspecified addresses (checked on the address actually
            connected, after DNS resolution).
    """

    name: str
    base_url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    timeout_seconds: float = _DEFAULT_WEBHOOK_TIMEOUT
    max_concurrency: int = _DEFAULT_WEBHOOK_CONCURRENCY
    methods: frozenset[str] = frozenset({"POST"})
    block_private_networks: bool = False

    def url_for(self, path: Any) -> str:
        """``base_url`` + ``path``; the path cannot leave the base (scheme, host, port, prefix).

        Raises:
            PermanentDeliveryError: ``path`` is refused by
                :func:`reliable_beat.webhook_guard.normalise_path` (not a string starting
                with a single ``/``; whitespace, control characters, ``\\`` or ``#``;
                ``.``/``..`` segments, ``;`` path parameters or encoded ``/`` in any
                percent-decoded form). Printable non-ASCII characters are percent-encoded as
                UTF-8, not refused.
        """
        try:
            sent = normalise_path(path)
        except ValueError as exc:
            raise PermanentDeliveryError(f"webhook destination {self.name!r}: {exc}") from None
        url = self.base_url.rstrip("/") + sent
        base, full = urlsplit(self.base_url), urlsplit(url)
        if (full.scheme, full.netloc) != (base.scheme, base.netloc):  # pragma: no cover
            raise PermanentDeliveryError(f"webhook destination {self.name!r}: path leaves host")
        return url


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_base_url(url: Any, what: str, allowed_hosts: Sequence[str]) -> str:
    if not isinstance(url, str):
        raise ConfigurationError(f"{what}: expected an http(s) URL string")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        raise ConfigurationError(
            f"{what}: only visible ASCII in base_url (give an internationalised host name in "
            "its xn-- form and percent-encode the prefix)")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"{what}: expected http://host[:port][/prefix] or https://...")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigurationError(
            f"{what}: no query, fragment or user:password@ in base_url; put credentials in "
            "the destination's 'headers' (e.g. {'Authorization': {'env': 'BILLING_TOKEN'}})"
        )
    if allowed_hosts and parts.hostname.lower() not in allowed_hosts:
        raise ConfigurationError(
            f"{what}: host {parts.hostname!r} is not in reliable_beat_webhook_allowed_hosts "
            f"({', '.join(allowed_hosts)}); add it there or fix the URL"
        )
    return url


def parse_webhook_destinations(
    raw: Any,
    *,
    max_timeout_seconds: float = 60.0,
    block_private_networks: bool = False,
    allowed_hosts: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> dict[str, WebhookDestination]:
    """Check ``reliable_beat_webhook_destinations`` and build the destinations.

    Args:
        raw: ``{name: {"base_url": str, "headers"?: {str: str | {"env": NAME}},
            "timeout_seconds"?: float, "max_concurrency"?: int, "methods"?: [str],
            "block_private_networks"?: bool}}``.
        max_timeout_seconds: ``reliable_beat_webhook_max_timeout_seconds``.
        block_private_networks: the default of each destination's ``block_private_networks``.
        allowed_hosts: lower-case host names; when not empty, every ``base_url`` host must be
            one of them.
        environ: where ``{"env": NAME}`` values are read; None: check the shape only (a
            beat, which sends no webhooks, does not need the relay's secrets).

    Raises:
        ConfigurationError: every problem, each naming the destination, the key and the fix.
    """
    if not isinstance(raw, Mapping):
        raise ConfigurationError(
            "reliable_beat_webhook_destinations: expected {name: {'base_url': ..., ...}}"
        )
    problems: list[str] = []
    out: dict[str, WebhookDestination] = {}
    for name, spec in raw.items():
        what = f"reliable_beat_webhook_destinations[{name!r}]"
        try:
            if not isinstance(name, str) or not name or len(name) > 100:
                raise ConfigurationError(f"{what}: the name must be a string of 1..100 characters")
            if not isinstance(spec, Mapping):
                raise ConfigurationError(f"{what}: expected a dict with at least 'base_url'")
            unknown = sorted(set(spec) - _DESTINATION_KEYS)
            if unknown:
                raise ConfigurationError(
                    f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; valid: "
                    + ", ".join(sorted(_DESTINATION_KEYS))
                )
            base_url = _check_base_url(spec.get("base_url"), f"{what}.base_url", allowed_hosts)
            timeout = spec.get("timeout_seconds", _DEFAULT_WEBHOOK_TIMEOUT)
            if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                    or not 0 < timeout <= max_timeout_seconds):
                raise ConfigurationError(
                    f"{what}.timeout_seconds={timeout!r}: expected seconds > 0 and at most "
                    f"reliable_beat_webhook_max_timeout_seconds ({max_timeout_seconds:g}); "
                    "a request without a deadline can hold a relay forever"
                )
            conc = spec.get("max_concurrency", _DEFAULT_WEBHOOK_CONCURRENCY)
            if not isinstance(conc, int) or isinstance(conc, bool) or not 1 <= conc <= 64:
                raise ConfigurationError(f"{what}.max_concurrency={conc!r}: expected 1..64")
            methods = spec.get("methods", ["POST"])
            if (not isinstance(methods, (list, tuple)) or not methods
                    or not all(isinstance(m, str) and m.isalpha() for m in methods)):
                raise ConfigurationError(f"{what}.methods={methods!r}: expected e.g. ['POST']")
            block = spec.get("block_private_networks", block_private_networks)
            if not isinstance(block, bool):
                raise ConfigurationError(f"{what}.block_private_networks: expected True/False")
            headers_raw = spec.get("headers") or {}
            if not isinstance(headers_raw, Mapping):
                raise ConfigurationError(f"{what}.headers: expected {{name: value}}")
            headers: dict[str, str] = {}
            for hname, hvalue in headers_raw.items():
                hwhat = f"{what}.headers[{hname!r}]"
                if header_name_problem(hname) is not None:
                    raise ConfigurationError(f"{hwhat}: not a valid HTTP header name")
                if hname.lower() in _RESERVED_HTTP_HEADERS:
                    raise ConfigurationError(f"{hwhat}: set by the handler, cannot be configured")
                if environ is None:
                    if not (isinstance(hvalue, str) or (
                            isinstance(hvalue, Mapping) and set(hvalue) == {"env"})):
                        raise ConfigurationError(
                            f"{hwhat}: expected a string or {{'env': 'VARIABLE'}}")
                    continue
                value = _secret(hvalue, hwhat, environ)
                problem = header_value_problem(value)  # never the value: it may be a secret
                if problem is not None:
                    raise ConfigurationError(f"{hwhat}: the {problem}")
                headers[hname] = value
            out[name] = WebhookDestination(
                name=name, base_url=base_url, headers=headers, timeout_seconds=float(timeout),
                max_concurrency=conc, methods=frozenset(m.upper() for m in methods),
                block_private_networks=block,
            )
        except ConfigurationError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigurationError("; ".join(problems))
    return out


class BlockedAddressError(PermanentDeliveryError):
    """A webhook host resolved only to addresses the destination may not reach."""


_deadline = threading.local()


def _remaining(timeout: float | None) -> float | None:
    """``timeout`` clamped to what is left of this thread's request deadline."""
    deadline: float | None = getattr(_deadline, "at", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise _DeadlinePassed(f"overall deadline of {_deadline.seconds:g} s passed")
    return left if timeout is None else min(timeout, left)


class _DeadlinePassed(Exception):
    pass


def _network_backend(block_private: bool) -> Any:
    """An httpcore network backend that enforces the request deadline on every socket
    operation (httpx / httpcore timeouts are per read: a server trickling one byte per read
    never trips them) and, if asked, refuses private addresses after resolving the host."""
    import httpcore

    class DeadlineStream(httpcore.NetworkStream):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            return self.inner.read(max_bytes, _remaining(timeout))  # type: ignore[no-any-return]

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self.inner.write(buffer, _remaining(timeout))

        def close(self) -> None:
            self.inner.close()

        def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                      timeout: float | None = None) -> Any:
            return DeadlineStream(self.inner.start_tls(ssl_context, server_hostname,
                                                       _remaining(timeout)))

        def get_extra_info(self, info: str) -> Any:
            return self.inner.get_extra_info(info)

    class GuardedBackend(httpcore.NetworkBackend):
        def __init__(self) -> None:
            self.sync = httpcore.SyncBackend()

        def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                        local_address: str | None = None,
                        socket_options: Any = None) -> Any:
            timeout = _remaining(timeout)
            if not block_private:
                return DeadlineStream(self.sync.connect_tcp(
                    host, port, timeout, local_address, socket_options))
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from exc
            refused: list[str] = []
            last: BaseException | None = None
            for *_, sockaddr in infos:
                address = str(sockaddr[0])
                why = blocked_reason(address)
                if why is not None:
                    refused.append(f"{address} ({why})")
                    continue
                try:  # connect to the checked address itself: no second lookup
                    stream = self.sync.connect_tcp(address, port, _remaining(timeout),
                                                   local_address, socket_options)
                except httpcore.ConnectError as exc:
                    last = exc
                    continue
                peer = stream.get_extra_info("server_addr")
                why = blocked_reason(str(peer[0])) if peer else "unknown peer"
                if why is not None:  # pragma: no cover - the kernel connected elsewhere
                    stream.close()
                    refused.append(f"{peer} ({why})")
                    continue
                return DeadlineStream(stream)
            if last is not None:
                raise last
            raise BlockedAddressError(
                f"host {host!r} resolves only to blocked addresses: {', '.join(refused)} "
                "(block_private_networks is on for this destination)"
            )

        def sleep(self, seconds: float) -> None:  # pragma: no cover - retries are off
            time.sleep(seconds)

    return GuardedBackend()


class WebhookHandler:
    """Destination ``webhook``: an HTTP request to an operator-configured destination.

    Row payload (JSON object): ``{"destination": name, "path": "/...", "body": any JSON,
    "method"?: "POST"}``; the request goes to the destination's ``base_url`` + ``path`` with
    the destination's headers, ``Content-Type: application/json`` and ``Idempotency-Key:
    <message_id>``. A row cannot choose the host, port, scheme or headers.

    Rows written before named destinations (``{"url", "body", "method"?, "headers"?,
    "timeout_seconds"?}``) are refused permanently (dead-lettered with the fix), unless the
    operator opts in with ``reliable_beat_webhook_allow_row_urls = True``: then the URL's host
    must be in ``reliable_beat_webhook_allowed_hosts``, the method POST, PUT or PATCH, and the
    timeout is clamped to the maximum.

    Bounds: each request has an overall deadline (the destination's ``timeout_seconds``,
    covering connect, send, headers and body together), at most
    ``reliable_beat_webhook_max_response_bytes`` of the response body are read (and dropped:
    only the status code and reason are kept), and at most ``max_concurrency`` requests are
    in flight per destination; destinations of one batch are served in parallel, so a slow
    one delays only its own rows. No request of a batch starts after
    ``reliable_beat_webhook_batch_seconds`` (default 30, below the relay's 60 s claim lease):
    rows not started by then are handed back uncharged
    (:class:`DestinationUnavailableError`: the relay backs them off) instead of holding
    their claim past its lease.

    Outcomes: 2xx is delivered; 408, 429, 5xx, transport errors and a passed deadline are
    retried; any other status (3xx, other 4xx), a bad row or a blocked address raises
    :class:`~reliable_beat.errors.PermanentDeliveryError`. Errors name the destination, the
    method and the path without its query string, never the body of the response.

    Args:
        destinations: name -> :class:`WebhookDestination` (or the raw setting), default none.
        settings: read ``webhook_*`` settings from it (destinations resolved with the
            process environment).
    """

    def __init__(
        self,
        destinations: Mapping[str, WebhookDestination] | None = None,
        *,
        settings: Any = None,
        max_response_bytes: int | None = None,
        allow_row_urls: bool | None = None,
        allowed_hosts: Sequence[str] | None = None,
        max_timeout_seconds: float | None = None,
        block_private_networks: bool | None = None,
        batch_seconds: float | None = None,
    ) -> None:
        try:
            import httpcore
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ConfigurationError(
                "the webhook outbox handler needs httpx: pip install 'reliable-beat[http]'"
            ) from exc
        self._httpcore = httpcore

        def pick(value: Any, name: str, default: Any) -> Any:
            if value is not None:
                return value
            return getattr(settings, name, default) if settings is not None else default

        self.max_timeout_seconds = float(pick(max_timeout_seconds,
                                              "webhook_max_timeout_seconds", 60.0))
        self.max_response_bytes = int(pick(max_response_bytes,
                                           "webhook_max_response_bytes", 65536))
        self.allow_row_urls = bool(pick(allow_row_urls, "webhook_allow_row_urls", False))
        self.allowed_hosts = tuple(h.lower() for h in pick(allowed_hosts,
                                                           "webhook_allowed_hosts", ()))
        self.block_private_networks = bool(pick(block_private_networks,
                                                "webhook_block_private_networks", False))
        self.batch_seconds = float(pick(batch_seconds, "webhook_batch_seconds", 30.0))
        if destinations is None:
            destinations = parse_webhook_destinations(
                pick(None, "webhook_destinations", {}),
                max_timeout_seconds=self.max_timeout_seconds,
                block_private_networks=self.block_private_networks,
                allowed_hosts=self.allowed_hosts,
                environ=os.environ,
            )
        self.destinations = dict(destinations)
        self._pools: dict[str, Any] = {}
        self._pools_lock = threading.Lock()

    def _pool(self, key: str, concurrency: int, block_private: bool) -> Any:
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = self._httpcore.ConnectionPool(
                    max_connections=concurrency, retries=0,
                    network_backend=_network_backend(block_private),
                )
            return pool

    def _request_for(self, message: OutboxMessage) -> _WebhookRequest:
        p = message.payload
        if not isinstance(p, Mapping):
            raise PermanentDeliveryError(
                f"outbox row {message.id}: webhook payload must be a JSON object")
        if "url" in p and "destination" not in p:
            return self._legacy_request(message, p)
        name = p.get("destination")
        dest = self.destinations.get(name) if isinstance(name, str) else None
        if dest is None:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: webhook destination {_short(name)} is not "
                "configured; configured: " + (", ".join(sorted(self.destinations)) or "none")
                + " (reliable_beat_webhook_destinations)"
            )
        extra = sorted(set(p) - {"destination", "path", "body", "method"})
        if extra:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: webhook payload key(s) {', '.join(extra)} are not "
                "accepted; a row gives only 'destination', 'path', 'body' and 'method' "
                "(headers and timeouts are the destination's configuration)"
            )
        method = p.get("method", "POST")
        if not isinstance(method, str) or method.upper() not in dest.methods:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: method {_short(method)} is not allowed for webhook "
                f"destination {dest.name!r} (allowed: {', '.join(sorted(dest.methods))})"
            )
        url = dest.url_for(p.get("path", "/"))
        label = f"webhook {dest.name!r} {method.upper()} {str(p.get('path', '/')).split('?')[0]}"
        return _WebhookRequest(dest.name, dest.max_concurrency, dest.block_private_networks,
                               method.upper(), url, dict(dest.headers), p.get("body"),
                               dest.timeout_seconds, label)

    def _legacy_request(self, message: OutboxMessage, p: Mapping[str, Any]) -> _WebhookRequest:
        url = p.get("url")
        parts = urlsplit(url) if isinstance(url, str) else None
        host = (parts.hostname or "").lower() if parts is not None else ""
        fix = ("name an operator-configured destination instead: {'destination': NAME, "
               "'path': '/...', 'body': ...} with reliable_beat_webhook_destinations = "
               "{NAME: {'base_url': ...}}")
        if not self.allow_row_urls:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: webhook rows may not carry a 'url' any more; {fix} "
                "(or, for rows written before the upgrade, set reliable_beat_webhook_allow_row_"
                "urls = True and list their hosts in reliable_beat_webhook_allowed_hosts)"
            )
        if parts is None or parts.scheme not in ("http", "https") or host not in self.allowed_hosts:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: webhook row URL host {host or '?'!r} is not in "
                "reliable_beat_webhook_allowed_hosts; " + fix
            )
        method = str(p.get("method", "POST")).upper()
        if method not in ("POST", "PUT", "PATCH"):
            raise PermanentDeliveryError(
                f"outbox row {message.id}: method {method!r} refused for a row URL "
                "(POST, PUT or PATCH)")
        url = str(url)
        if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
            raise PermanentDeliveryError(
                f"outbox row {message.id}: the row URL has whitespace, control or non-ASCII "
                "characters; percent-encode them")
        try:
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError as exc:
            raise PermanentDeliveryError(f"outbox row {message.id}: row URL: {exc}") from None
        raw_headers = p.get("headers") or {}
        if not isinstance(raw_headers, Mapping):
            raise PermanentDeliveryError(
                f"outbox row {message.id}: 'headers' must be an object {{name: value}}")
        headers = {str(k): str(v) for k, v in raw_headers.items()
                   if str(k).lower() not in _RESERVED_HTTP_HEADERS}
        for k, v in headers.items():
            problem = header_name_problem(k) or header_value_problem(v)
            if problem is not None:  # CR/LF (header injection), non-ASCII, ...: never sent
                raise PermanentDeliveryError(
                    f"outbox row {message.id}: header {_short(k)}: the {problem}")
        timeout = p.get("timeout_seconds")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            timeout = _DEFAULT_WEBHOOK_TIMEOUT
        timeout = min(float(timeout), self.max_timeout_seconds)
        label = f"webhook row URL {method} {host}{parts.path}"
        return _WebhookRequest("row-url:" + host, _DEFAULT_WEBHOOK_CONCURRENCY,
                               self.block_private_networks, method, str(url), headers,
                               p.get("body"), timeout, label)

    def __call__(self, message: OutboxMessage) -> None:
        error = self.deliver_batch([message])[0]
        if error is not None:
            raise error

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[Result]:
        """Deliver ``messages``: destinations in parallel, each at most ``max_concurrency``
        requests at a time. Returns one ``None`` or exception per message, in order."""
        results: list[Result] = [None] * len(messages)
        queues: dict[str, list[tuple[int, OutboxMessage, _WebhookRequest]]] = {}
        for index, m in enumerate(messages):
            try:
                req = self._request_for(m)
            except DeliveryError as exc:
                results[index] = exc
                continue
            except Exception as exc:  # building a request does no I/O: it fails every time
                results[index] = _chain(PermanentDeliveryError(
                    f"outbox row {m.id}: the webhook request cannot be built from the row: "
                    f"{type(exc).__name__}: {exc}"), exc)
                continue
            queues.setdefault(req.group, []).append((index, m, req))

        budget_ends = time.monotonic() + self.batch_seconds

        def worker(queue: list[tuple[int, OutboxMessage, _WebhookRequest]],
                   lock: threading.Lock) -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    if time.monotonic() >= budget_ends:  # the rest waits for a later batch
                        for index, _, req in queue:
                            results[index] = DestinationUnavailableError(
                                f"webhook {req.group!r}: not attempted, the batch's "
                                f"{self.batch_seconds:g} s were used up (a slow destination)")
                        queue.clear()
                        return
                    index, m, req = queue.pop(0)
                try:
                    self._send(m, req)
                except Exception as exc:
                    results[index] = exc

        threads = []
        for queue in queues.values():
            lock = threading.Lock()
            for _ in range(min(queue[0][2].concurrency, len(queue))):
                threads.append(threading.Thread(target=worker, args=(queue, lock), daemon=True,
                                                name="reliable_beat-webhook"))
        if len(threads) == 1:
            threads[0].run()
        else:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return results

    def _send(self, message: OutboxMessage, req: _WebhookRequest) -> None:
        # an HTTP client span under the relay's delivery span; the far end gets its traceparent
        with tracing.span(req.method, parent=message.traceparent, kind="client",
                          attributes=tracing.http_attributes(req.method, req.url)) as s:
            status = self._request(message, req, tracing.traceparent_of(s))
            if s is not None:
                s.set_attribute("http.response.status_code", status)

    def _request(self, message: OutboxMessage, req: _WebhookRequest,
                 traceparent: str | None) -> int:
        httpcore = self._httpcore
        try:
            content = json.dumps(to_plain_json(req.body), allow_nan=False).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            raise PermanentDeliveryError(f"{req.label}: body is not JSON ({exc})") from exc
        problem = header_value_problem(message.message_id)
        if problem is not None:  # a key with CR/LF would inject a header; non-ASCII is refused
            raise PermanentDeliveryError(
                f"{req.label}: the row's key cannot be sent as its Idempotency-Key header: "
                f"the {problem}; write webhook rows under keys of visible ASCII")
        headers = [(k, v) for k, v in req.headers.items()]
        headers += [("Content-Type", "application/json"),
                    ("Idempotency-Key", message.message_id)]
        if traceparent is not None:
            headers.append(("traceparent", traceparent))
        pool = self._pool(req.group, req.concurrency, req.block_private)
        t = req.timeout_seconds
        deadline = time.monotonic() + t
        _deadline.at, _deadline.seconds = deadline, t
        try:
            with pool.stream(req.method, req.url, headers=headers, content=content,
                             extensions={"timeout": {"connect": t, "read": t, "write": t,
                                                     "pool": t}}) as response:
                status = int(response.status)
                reason = response.extensions.get("reason_phrase", b"")
                read = 0
                for chunk in response.iter_stream():  # read (and drop) up to the cap
                    read += len(chunk)
                    if read > self.max_response_bytes:
                        log.debug("%s: response body over %d bytes, connection dropped",
                                  req.label, self.max_response_bytes)
                        break
        except PermanentDeliveryError:
            raise
        except (TypeError, UnicodeError) as exc:  # the HTTP client refused the request as built
            raise PermanentDeliveryError(
                f"{req.label}: the HTTP client refused the request: {exc}") from None
        except _DeadlinePassed as exc:
            raise DeliveryError(f"{req.label}: {exc}") from None
        except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError,
                httpcore.UnsupportedProtocol, httpcore.LocalProtocolError, OSError) as exc:
            if isinstance(exc, httpcore.TimeoutException) and time.monotonic() >= deadline - 0.05:
                raise DeliveryError(f"{req.label}: overall deadline of {t:g} s passed") from None
            raise DeliveryError(f"{req.label}: {type(exc).__name__}: {exc}") from None
        finally:
            _deadline.at = None
        if 200 <= status < 300:
            return status
        phrase = reason.decode("ascii", "replace") if isinstance(reason, bytes) else str(reason)
        phrase = "".join(c for c in phrase if c.isprintable())[:60]
        detail = f"{req.label} answered HTTP {status} {phrase}".rstrip()
        if status in (408, 429) or status >= 500:
            raise DeliveryError(detail)
        raise PermanentDeliveryError(detail)

    def close(self) -> None:
        """Close the connection pools."""
        with self._pools_lock:
            for pool in self._pools.values():
                with contextlib.suppress(Exception):
                    pool.close()
            self._pools.clear()


@dataclass(frozen=True)
class _WebhookRequest:
    group: str
    concurrency: int
    block_private: bool
    method: str
    url: str
    headers: dict[str, str]
    body: Any
    timeout_seconds: float
    label: str


# --------------------------------------------------------------------------- smtp


_MSGID_SAFE = "!#$%&'*+/=?^_`{|}~.-"
_SMTP_KEYS = frozenset({
    "host", "port", "starttls", "ssl", "username", "password", "timeout_seconds", "from",
    "allowed_from", "ca_file",
})
_MAX_RECIPIENTS = 100


def smtp_message_id(message_id: str) -> str:
    """The e-mail ``Message-ID`` of an outbox message: ``<escaped id@reliable-beat>``."""
    return f"<{quote(message_id, safe=_MSGID_SAFE)}@reliable-beat>"


@dataclass(frozen=True)
class SmtpConfig:
    """The SMTP server the ``smtp`` destination sends through (``reliable_beat_smtp``).

    Attributes:
        host / port: the server; default ``$RELIABLE_BEAT_SMTP_HOST`` (else ``localhost``) and
            ``$RELIABLE_BEAT_SMTP_PORT`` (else 465 with ``ssl``, 587 with ``starttls``, 25).
        starttls: upgrade the session with STARTTLS before anything else (default on; a
            server that does not offer it fails the batch, nothing is sent in plain text).
        ssl: implicit TLS (SMTPS, port 465) instead of STARTTLS.
        username / password: AUTH credentials (only over TLS); a value may be
            ``{"env": "NAME"}``.
        timeout_seconds: socket timeout, seconds.
        from_address: the sender of rows that give no ``from``.
        allowed_from: the ``from`` addresses rows may use (default: ``from_address``).
        ca_file: a CA bundle to verify the server's certificate with (default: the system's).
    """

    host: str = "localhost"
    port: int = 587
    starttls: bool = True
    ssl: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout_seconds: float = 30.0
    from_address: str | None = None
    allowed_from: frozenset[str] = frozenset()
    ca_file: str | None = None

    @classmethod
    def from_setting(cls, raw: Any, environ: Mapping[str, str] | None = None) -> SmtpConfig:
        """Check ``reliable_beat_smtp`` (a dict with the keys of the attributes, ``from``
        for ``from_address``) and build the configuration.

        Args:
            environ: where ``{"env": NAME}`` values are read; None: check the shape only.

        Raises:
            ConfigurationError: every problem, naming the key and the fix.
        """
        env = os.environ if environ is None else environ
        raw = dict(raw or {})
        problems = [f"reliable_beat_smtp: unknown key {k!r}; valid: "
                    + ", ".join(sorted(_SMTP_KEYS)) for k in sorted(set(raw) - _SMTP_KEYS)]
        starttls, use_ssl = raw.get("starttls", True), raw.get("ssl", False)
        for key, value in (("starttls", starttls), ("ssl", use_ssl)):
            if not isinstance(value, bool):
                problems.append(f"reliable_beat_smtp.{key}={value!r}: expected True or False")
        if use_ssl is True and "starttls" not in raw:
            starttls = False
        if use_ssl is True and starttls is True:
            problems.append("reliable_beat_smtp: 'ssl' and 'starttls' exclude each other")
        default_port = 465 if use_ssl is True else 587 if starttls is True else 25
        host = raw.get("host", env.get("RELIABLE_BEAT_SMTP_HOST", "localhost"))
        port = raw.get("port", env.get("RELIABLE_BEAT_SMTP_PORT", default_port))
        if not isinstance(host, str) or not host or any(c in host for c in "\r\n /"):
            problems.append(f"reliable_beat_smtp.host={host!r}: expected a host name")
        try:
            port = int(port)
            if not 0 < port < 65536:
                raise ValueError
        except (TypeError, ValueError):
            problems.append(f"reliable_beat_smtp.port={port!r}: expected 1..65535")
            port = 25
        timeout = raw.get("timeout_seconds", 30.0)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            problems.append(f"reliable_beat_smtp.timeout_seconds={timeout!r}: expected > 0")
            timeout = 30.0
        username, password = raw.get("username"), raw.get("password")
        for key, value in (("username", username), ("password", password)):
            if value is None:
                continue
            if environ is None:  # shape only: the relay reads the environment
                if not (isinstance(value, str) or (isinstance(value, Mapping)
                                                   and set(value) == {"env"})):
                    problems.append(f"reliable_beat_smtp.{key}: expected a string or "
                                    "{'env': 'VARIABLE'}")
                continue
            try:
                resolved = _secret(value, f"reliable_beat_smtp.{key}", env)
            except ConfigurationError as exc:
                problems.append(str(exc))
                continue
            if key == "username":
                username = resolved
            else:
                password = resolved
        if password is not None and username is None:
            problems.append("reliable_beat_smtp: 'password' without 'username'")
        if username is not None and starttls is not True and use_ssl is not True:
            problems.append("reliable_beat_smtp: credentials are only sent over TLS; turn "
                            "'starttls' (or 'ssl') on")
        sender = raw.get("from")
        allowed = raw.get("allowed_from", [sender] if sender else [])
        if sender is not None and not _is_address(sender):
            problems.append(f"reliable_beat_smtp.from={sender!r}: expected an e-mail address")
        if not isinstance(allowed, (list, tuple)) or not all(_is_address(a) for a in allowed):
            problems.append(f"reliable_beat_smtp.allowed_from={allowed!r}: expected a list "
                            "of e-mail addresses")
            allowed = []
        ca_file = raw.get("ca_file")
        if ca_file is not None and not isinstance(ca_file, str):
            problems.append("reliable_beat_smtp.ca_file: expected a path")
        if problems:
            raise ConfigurationError("; ".join(problems))
        return cls(host=host, port=port, starttls=starttls, ssl=use_ssl, username=username,
                   password=password, timeout_seconds=float(timeout), from_address=sender,
                   allowed_from=frozenset(a.lower() for a in allowed), ca_file=ca_file)


def _is_address(value: Any) -> bool:
    if not isinstance(value, str) or not 3 <= len(value) <= 254:
        return False
    if any(ord(c) < 0x20 or c in "<>,;\"\\ \x7f" for c in value):
        return False
    local, at, domain = value.rpartition("@")
    return bool(at and local and domain and "." in domain.strip("."))


def _addresses(value: Any, what: str, row: int) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not items or len(items) > _MAX_RECIPIENTS:
        raise PermanentDeliveryError(
            f"outbox row {row}: smtp {what!r} needs 1..{_MAX_RECIPIENTS} addresses")
    for item in items:
        if not _is_address(item):
            raise PermanentDeliveryError(
                f"outbox row {row}: smtp {what!r} has an invalid address {_short(item)} "
                "(one plain address per item, no name, no CR/LF, no comma)")
    return [str(i) for i in items]


@dataclass(frozen=True)
class _Mail:
    sender: str
    recipients: list[str]
    data: bytes


class SmtpHandler:
    """Destination ``smtp``: an e-mail through the operator's SMTP server.

    Row payload: ``{"to": str | [str], "cc"?: str | [str], "subject": str, "text": str,
    "html"?: str, "from"?: str}`` (``from`` must be one of ``allowed_from``; default the
    configured ``from``). Server, port, TLS and credentials come from ``reliable_beat_smtp``
    only; row headers ``smtp_host`` / ``smtp_port`` are ignored (logged at WARNING).

    Every message of a batch is built and checked (addresses, header values without CR/LF,
    the whole message serialised) before connecting; a bad one fails alone and permanently.
    The rest go over one session (STARTTLS, then AUTH when configured); a mail the server
    accepted is never re-sent because a later one of the batch failed. SMTP 5xx answers and
    refused recipients are permanent; 4xx answers and a session lost midway are retried. A
    server that cannot be reached, offers no STARTTLS or refuses the login is
    :class:`DestinationUnavailableError`: the batch backs off uncharged, so an outage or a
    configuration mistake never dead-letters mail.

    Args:
        config: a :class:`SmtpConfig` or the raw ``reliable_beat_smtp`` dict; None: defaults
            (and the ``RELIABLE_BEAT_SMTP_HOST`` / ``_PORT`` environment).
    """

    def __init__(self, config: SmtpConfig | Mapping[str, Any] | None = None) -> None:
        self.config = config if isinstance(config, SmtpConfig) else SmtpConfig.from_setting(
            config, os.environ)

    def build(self, message: OutboxMessage) -> _Mail:
        """Build and check the e-mail of ``message``; nothing is sent.

        Raises:
            PermanentDeliveryError: a missing or malformed field (the message says which).
        """
        p = message.payload
        if not isinstance(p, Mapping) or "to" not in p or "subject" not in p:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: smtp payload needs 'to' and 'subject'")
        cfg = self.config
        sender = p.get("from", cfg.from_address)
        if sender is None:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: no sender; set reliable_beat_smtp['from']")
        if not _is_address(sender) or (p.get("from") is not None
                                       and sender.lower() not in cfg.allowed_from):
            raise PermanentDeliveryError(
                f"outbox row {message.id}: smtp 'from' {_short(sender)} is not an allowed "
                "sender (reliable_beat_smtp['allowed_from'])")
        to = _addresses(p["to"], "to", message.id)
        cc = _addresses(p["cc"], "cc", message.id) if p.get("cc") else []
        for key in ("subject", "text", "html"):
            if key in p and not isinstance(p[key], str):
                raise PermanentDeliveryError(
                    f"outbox row {message.id}: smtp {key!r} must be a string")
        try:
            email = EmailMessage()
            email["From"] = sender
            email["To"] = ", ".join(to)
            if cc:
                email["Cc"] = ", ".join(cc)
            email["Subject"] = p["subject"]
            email["Message-ID"] = smtp_message_id(message.message_id)
            email["Date"] = formatdate(usegmt=True)
            email.set_content(p.get("text", ""))
            if p.get("html"):
                email.add_alternative(p["html"], subtype="html")
            data = email.as_bytes(policy=email_policy.SMTP)
        except (ValueError, TypeError, LookupError, email_errors.MessageError) as exc:
            raise PermanentDeliveryError(
                f"outbox row {message.id}: the e-mail cannot be built: {exc}") from exc
        if (message.headers or {}).keys() & {"smtp_host", "smtp_port"}:
            log.warning("outbox row %d: row headers smtp_host/smtp_port are ignored; the "
                        "server is reliable_beat_smtp's", message.id)
        return _Mail(sender, to + cc, data)

    def __call__(self, message: OutboxMessage) -> None:
        error = self.deliver_batch([message])[0]
        if error is not None:
            raise error

    def _connect(self) -> smtplib.SMTP:
        cfg = self.config
        context = ssl.create_default_context(cafile=cfg.ca_file)
        client: smtplib.SMTP
        if cfg.ssl:
            client = smtplib.SMTP_SSL(cfg.host, cfg.port, timeout=cfg.timeout_seconds,
                                      context=context)
        else:
            client = smtplib.SMTP(cfg.host, cfg.port, timeout=cfg.timeout_seconds)
        try:
            client.ehlo()
            if cfg.starttls:
                if not client.has_extn("starttls"):
                    raise DeliveryError(
                        f"smtp {cfg.host}:{cfg.port} does not offer STARTTLS; nothing was "
                        "sent in plain text (set reliable_beat_smtp['starttls'] = False only "
                        "for a server on this host)")
                client.starttls(context=context)
                client.ehlo()
            if cfg.username is not None:
                client.login(cfg.username, cfg.password or "")
        except BaseException:
            with contextlib.suppress(Exception):
                client.close()
            raise
        return client

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[Result]:
        """Build every message first, then send the good ones over one session.

        Returns one ``None`` or exception per message, in order; never raises.
        """
        results: list[Result] = [None] * len(messages)
        mails: list[tuple[int, _Mail]] = []
        for index, m in enumerate(messages):
            try:
                mails.append((index, self.build(m)))
            except Exception as exc:
                results[index] = exc
        if not mails:
            return results
        cfg = self.config
        done: set[int] = set()
        try:
            client = self._connect()
        except Exception as exc:  # connect, TLS, AUTH: the server, not these messages
            down = DestinationUnavailableError(
                f"smtp {cfg.host}:{cfg.port}: {type(exc).__name__}: {exc}")
            down.__cause__ = exc
            for index, _ in mails:
                results[index] = down
            return results
        try:
            try:
                for index, mail in mails:
                    results[index] = self._send(client, mail)
                    done.add(index)
            finally:
                with contextlib.suppress(Exception):
                    client.quit()
        except Exception as exc:
            err = exc if isinstance(exc, DeliveryError) else _chain(
                DeliveryError(f"smtp {cfg.host}:{cfg.port}: {type(exc).__name__}: {exc}"), exc)
            for index, _ in mails:
                if index not in done:  # mails the server accepted keep their success
                    results[index] = err
        return results

    @staticmethod
    def _send(client: smtplib.SMTP, mail: _Mail) -> Result:
        try:
            client.sendmail(mail.sender, mail.recipients, mail.data)
            return None
        except smtplib.SMTPRecipientsRefused as exc:
            return _chain(PermanentDeliveryError(f"smtp: recipients refused: {exc!r}"), exc)
        except smtplib.SMTPResponseException as exc:
            if exc.smtp_code >= 500:
                return _chain(PermanentDeliveryError(f"smtp: {exc.smtp_code} {exc!r}"), exc)
            return _chain(DeliveryError(f"smtp: {exc.smtp_code} {exc!r}"), exc)
        except smtplib.SMTPServerDisconnected:
            raise  # the session is gone: the caller fails the rest of the batch
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
    *,
    settings: Any = None,
) -> dict[str, Callable[[OutboxMessage], None]]:
    """The destination -> handler map a relay uses.

    Later sources override earlier ones: built-ins (``celery`` and ``kombu`` only when an app
    is given: its adapter's, :meth:`reliable_beat.adapters.AppAdapter.handlers`; ``webhook``
    only when httpx is installed; ``smtp``), then the entry point group
    :data:`ENTRY_POINT_GROUP`, then ``configured`` (``reliable_beat_outbox_handlers``), then
    ``extra`` (handler objects passed in code).

    ``settings`` (a :class:`~reliable_beat.settings.Settings`) configures the built-in
    ``webhook`` (``webhook_*``: destinations, allowed hosts, bounds) and ``smtp``
    (``smtp``) handlers; None: their defaults (no webhook destination configured).

    Raises:
        ConfigurationError: a configured handler cannot be imported or is not callable, or
            the webhook / SMTP settings are invalid (e.g. a secret's environment variable is
            not set).
    """
    handlers: dict[str, Callable[[OutboxMessage], None]] = {}
    if app is not None:
        from reliable_beat.adapters import adapter_for

        handlers.update(adapter_for(app).handlers(app))
    if importlib.util.find_spec("httpcore") is None:  # pragma: no cover - httpx missing
        log.info("webhook outbox handler disabled: httpx is not installed")
    else:
        handlers["webhook"] = WebhookHandler(settings=settings)
    handlers["smtp"] = SmtpHandler(getattr(settings, "smtp", None))
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


#: Names that moved to the Celery adapter (:mod:`reliable_beat.celery.publishing`).
_MOVED_TO_CELERY = frozenset({"CeleryHandler", "KombuHandler", "celery_task_id",
                              "publish_celery_batch"})
_CELERY_PUBLISHING = "reliable_beat.celery.publishing"


def __getattr__(name: str) -> Any:
    # The old import path of the Celery publishing names keeps working; resolving them
    # imports the Celery adapter (and Celery), never at this module's import.
    if name in _MOVED_TO_CELERY:
        return getattr(importlib.import_module(_CELERY_PUBLISHING), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
