"""The ``webhook`` outbox handler: an HTTP request to an operator-configured destination.

See :class:`WebhookHandler`; the destinations' configuration is :mod:`reliable_beat.destinations`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from reliable_beat import tracing
from reliable_beat.destinations import (
    _DEFAULT_WEBHOOK_CONCURRENCY,
    _DEFAULT_WEBHOOK_TIMEOUT,
    _RESERVED_HTTP_HEADERS,
    WebhookDestination,
    parse_webhook_destinations,
)
from reliable_beat.errors import ConfigurationError, DeliveryError, PermanentDeliveryError
from reliable_beat.messages import OutboxMessage
from reliable_beat.outbound.base import DestinationUnavailableError, Result, _chain, _short
from reliable_beat.redaction import get_logger
from reliable_beat.values import to_plain_json
from reliable_beat.webhook_guard import (
    blocked_reason,
    header_name_problem,
    header_value_problem,
)

__all__ = [
    "BlockedAddressError",
    "WebhookHandler",
]

#: The handlers' logger: records keep the name ``reliable_beat.handlers``.
log = get_logger("reliable_beat.handlers")


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
