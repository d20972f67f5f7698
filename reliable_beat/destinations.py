"""Outbound destinations' configuration: webhook destinations and the SMTP server.

What an operator configures for the built-in ``webhook`` and ``smtp`` outbox handlers
(:mod:`reliable_beat.handlers`): ``reliable_beat_webhook_destinations`` (checked by
:func:`parse_webhook_destinations` into :class:`WebhookDestination` objects) and
``reliable_beat_smtp`` (:class:`SmtpConfig`). :class:`~reliable_beat.settings.Settings`
checks their shape when it is built; the relay's handlers build them with the process
environment (values given as ``{"env": "NAME"}`` are secrets read there).

Configuration only: no I/O, no HTTP or SMTP client. A layer below the settings and the
handlers, so both read it and neither imports the other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from reliable_beat.errors import ConfigurationError, PermanentDeliveryError
from reliable_beat.webhook_guard import (
    header_name_problem,
    header_value_problem,
    normalise_path,
)

__all__ = [
    "SmtpConfig",
    "WebhookDestination",
    "parse_webhook_destinations",
]

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


_SMTP_KEYS = frozenset({
    "host", "port", "starttls", "ssl", "username", "password", "timeout_seconds", "from",
    "allowed_from", "ca_file",
})


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
