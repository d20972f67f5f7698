"""Who may look and who may act: the dashboard's authentication, roles, bind rule and CSRF.

Two roles: ``viewer`` (every page) and ``operator`` (every page, and the actions). Tokens
come from the settings (``reliable_beat_dashboard_operator_token`` /
``reliable_beat_dashboard_viewer_token``) or the environment
(``RELIABLE_BEAT_DASHBOARD_OPERATOR_TOKEN`` / ``RELIABLE_BEAT_DASHBOARD_VIEWER_TOKEN``), never
the command line (it shows in ``ps``). A client presents one as ``Authorization: Bearer
TOKEN`` or as the password of HTTP basic auth (the user name is then who acts, recorded in
the audit; a browser asks for it).

Without any token configured, only loopback clients are served (as operators named
``local``); :func:`check_bind` refuses to serve on any other address, and the app refuses
a request from any other address (the app mounted in a server bound elsewhere). With a
token configured, every request must present one, loopback or not.

CSRF: every response carries a random ``rb_csrf`` cookie (``SameSite=Strict``, HttpOnly);
each form repeats it in a hidden field, and a POST whose field does not match the cookie, or
whose ``Origin`` is another host, is refused (:func:`csrf_problem`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from reliable_beat.errors import ConfigurationError

__all__ = [
    "CSRF_COOKIE",
    "OPERATOR",
    "VIEWER",
    "AuthConfig",
    "Principal",
    "authenticate",
    "check_bind",
    "csrf_problem",
    "flash_signature",
    "is_loopback",
    "is_loopback_host_header",
    "new_csrf_token",
]

VIEWER = "viewer"
OPERATOR = "operator"
CSRF_COOKIE = "rb_csrf"
CSRF_FIELD = "csrf"
OPERATOR_TOKEN_ENV = "RELIABLE_BEAT_DASHBOARD_OPERATOR_TOKEN"
VIEWER_TOKEN_ENV = "RELIABLE_BEAT_DASHBOARD_VIEWER_TOKEN"
#: The shortest token accepted (a guessable token is no authentication).
MIN_TOKEN_LENGTH = 16


@dataclass(frozen=True)
class Principal:
    """Who makes a request: a name (recorded in the audit) and a role."""

    name: str
    role: str

    @property
    def can_act(self) -> bool:
        return self.role == OPERATOR


@dataclass(frozen=True)
class AuthConfig:
    """The configured tokens (either may be None)."""

    operator_token: str | None = field(default=None, repr=False)
    viewer_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for what, token in (("operator", self.operator_token), ("viewer", self.viewer_token)):
            if token is not None and len(token) < MIN_TOKEN_LENGTH:
                raise ConfigurationError(
                    f"the dashboard {what} token is shorter than {MIN_TOKEN_LENGTH} "
                    f"characters: use a random one (python -c 'import secrets; "
                    f"print(secrets.token_urlsafe(32))')")
        if (self.operator_token is not None
                and self.operator_token == self.viewer_token):
            raise ConfigurationError("the dashboard's viewer and operator tokens are the "
                                     "same: give each role its own")

    @property
    def configured(self) -> bool:
        return self.operator_token is not None or self.viewer_token is not None

    @classmethod
    def from_sources(cls, settings: Any = None,
                     environ: Mapping[str, str] | None = None) -> AuthConfig:
        """The tokens of ``settings`` (``dashboard_operator_token`` /
        ``dashboard_viewer_token``), else of the environment."""
        env = os.environ if environ is None else environ

        def pick(attr: str, var: str) -> str | None:
            value = getattr(settings, attr, None) if settings is not None else None
            value = value or env.get(var) or None
            return str(value) if value is not None else None

        return cls(operator_token=pick("dashboard_operator_token", OPERATOR_TOKEN_ENV),
                   viewer_token=pick("dashboard_viewer_token", VIEWER_TOKEN_ENV))


def is_loopback(host: str | None) -> bool:
    """True for a loopback address (``127.0.0.0/8``, ``::1``) or ``localhost``."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_loopback_host_header(host_header: str | None) -> bool:
    """True when an HTTP ``Host`` header names a loopback host: ``localhost``,
    ``127.0.0.1:8000``, ``[::1]:8000`` (with or without a port).

    A page of another site reaching a loopback-only dashboard through DNS rebinding sends its
    own name (``Host: evil.example``) from the victim's browser, to 127.0.0.1: the peer
    address alone cannot tell it from the operator.
    """
    if not host_header:
        return False
    name = host_header.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return is_loopback(name.rstrip("."))


def check_bind(host: str, auth: AuthConfig) -> None:
    """Refuse to serve on ``host`` off loopback without authentication.

    Raises:
        ConfigurationError: ``host`` is not a loopback address and no token is configured.
    """
    if is_loopback(host) or auth.configured:
        return
    raise ConfigurationError(
        f"refusing to serve the dashboard on {host!r} with no token configured (anyone "
        f"reaching that address could act); give {OPERATOR_TOKEN_ENV} (and/or "
        f"{VIEWER_TOKEN_ENV}) in the environment, or the settings "
        "reliable_beat_dashboard_operator_token / reliable_beat_dashboard_viewer_token, to a "
        "random token of at least 16 characters; or bind 127.0.0.1")


def _same(given: str, wanted: str | None) -> bool:
    return wanted is not None and hmac.compare_digest(given.encode(), wanted.encode())


def authenticate(authorization: str | None, client_host: str | None,
                 auth: AuthConfig) -> Principal | None:
    """The principal of a request, or None (refused).

    Args:
        authorization: the ``Authorization`` header.
        client_host: the peer's address.
        auth: the configured tokens.
    """
    if not auth.configured:
        return Principal("local", OPERATOR) if is_loopback(client_host) else None
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    value = value.strip()
    name: str | None = None
    if scheme.lower() == "bearer":
        token = value
    elif scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        user, sep, token = decoded.partition(":")
        if not sep:
            return None
        name = user.strip()[:100] or None
    else:
        return None
    if _same(token, auth.operator_token):
        return Principal(name or "operator-token", OPERATOR)
    if _same(token, auth.viewer_token):
        return Principal(name or "viewer-token", VIEWER)
    return None


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def flash_signature(csrf_token: str, outcome: str, message: str) -> str:
    """The signature an action's redirect gives its message (``sig``), keyed by the
    browser's CSRF token: a link from elsewhere cannot make the dashboard show its text."""
    mac = hmac.new(csrf_token.encode(), f"{outcome}\0{message}".encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def csrf_problem(cookie: str | None, field_value: Any, origin: str | None,
                 host: str | None) -> str | None:
    """Why a POST fails the CSRF check, or None when it passes."""
    if origin and origin != "null" and host and urlsplit(origin).netloc != host:
        return f"the request comes from another site ({origin})"
    if not cookie or not isinstance(field_value, str) or not field_value:
        return "the form carries no CSRF token (reload the page and try again)"
    if not hmac.compare_digest(cookie.encode(), field_value.encode()):
        return "the form's CSRF token does not match (reload the page and try again)"
    return None
