"""What a webhook request may carry and where it may go: pure checks, no I/O.

* :func:`normalise_path`: the path a row gives, made safe to append to a destination's base
  URL, or refused. :meth:`reliable_beat.destinations.WebhookDestination.url_for` calls it, so a
  row is judged the same where it is written (the write-time check of webhook rows runs the
  handler's own guard) and where the relay sends it.
* :func:`header_value_problem` / :func:`header_name_problem`: a header the HTTP client would
  refuse (or that would inject another header) is found before anything is sent.
* :func:`blocked_reason`: the address classes ``block_private_networks`` refuses, including
  IPv6 addresses that embed a blocked IPv4 address (IPv4-mapped, IPv4-compatible, 6to4,
  Teredo, NAT64).

A refusal is deterministic (the same row is refused on every attempt), so the callers turn
each one into a permanent error: the row is dead-lettered at once with the reason, never
retried to the attempt limit.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from typing import Any
from urllib.parse import quote, unquote

__all__ = [
    "MAX_PATH_DECODES",
    "blocked_reason",
    "header_name_problem",
    "header_value_problem",
    "normalise_path",
]

#: How many rounds of percent-decoding a path is checked through. A path still changing
#: after that many rounds is refused: no server decodes that often, and nothing legitimate
#: is encoded that deep.
MAX_PATH_DECODES = 4

_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}")
# RFC 9110 field-value: visible ASCII, with single spaces / tabs only between them
_HEADER_VALUE = re.compile(r"(?:[\x21-\x7e](?:[\x20\x09]*[\x21-\x7e])*)?")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(char: str) -> str:
    name = unicodedata.name(char, "")
    return f"{char!r} (U+{ord(char):04X}{' ' + name if name else ''})"


def _unsafe_raw(char: str) -> bool:
    """A character the path may not carry as it is (before any decoding)."""
    if char < "\x80":
        return char <= " " or char in "\x7f\\#"
    return not char.isprintable()  # control, format (bidi overrides), separators, surrogates


def normalise_path(path: Any) -> str:
    """``path`` as sent after the destination's base URL, or ``ValueError`` naming why not.

    Accepted: a string starting with a single ``/``; printable non-ASCII characters are
    percent-encoded as UTF-8 (what browsers do), so ``/café`` is sent as ``/caf%C3%A9``;
    everything else is kept as given. The query string (after ``?``) is kept as given.

    Refused (each path segment is checked as given and in every percent-decoded form, up to
    :data:`MAX_PATH_DECODES` rounds, so ``%2e``, ``%252e`` and ``%25252e`` are all ``.``):

    * whitespace, control characters (``%00``, ``%0d%0a`` decoded too), invisible Unicode
      (bidi overrides, zero-width characters), ``\\`` and ``#``;
    * ``.`` and ``..`` segments (and segments of dots only, or that Unicode compatibility
      folding turns into dots, e.g. full-width ``U+FF0E``);
    * ``;`` in the path (``/..;/admin``: path parameters, which some servers strip before
      resolving ``..``);
    * an encoded ``/`` or ``\\`` inside a segment;
    * a path still changing after :data:`MAX_PATH_DECODES` rounds of decoding.

    Raises:
        ValueError: the reason, starting with ``'path'``.
    """
    if not isinstance(path, str) or not path.startswith("/") or path.startswith("//"):
        raise ValueError(f"'path' must be a string starting with a single '/', got {_short(path)}")
    for char in path:
        if _unsafe_raw(char):
            raise ValueError(
                f"'path' contains {_describe(char)}; whitespace, control and invisible "
                "characters, '\\' and '#' are refused (percent-encode data characters)"
            )
    encoded = "".join(c if c < "\x80" else quote(c, safe="") for c in path)
    target, _, _query = encoded.partition("?")
    for segment in target.split("/")[1:]:
        _check_segment(segment)
    return encoded


def _check_segment(segment: str) -> None:
    form = segment
    for _ in range(MAX_PATH_DECODES + 1):
        _check_form(form, segment)
        decoded = unquote(form, errors="replace")
        if decoded == form:
            return
        form = decoded
    raise ValueError(
        f"'path' segment {_short(segment)} is still percent-encoded after "
        f"{MAX_PATH_DECODES} rounds of decoding; refused"
    )


def _check_form(form: str, segment: str) -> None:
    if not form:
        return  # an empty segment ("/a//b", a trailing "/"): no traversal
    shown = _short(segment) if form == segment else f"{_short(segment)} (decoded {_short(form)})"
    bare = form.strip(" \t")
    folded = unicodedata.normalize("NFKC", form).strip(" \t")
    if (bare and set(bare) == {"."}) or (folded and set(folded) == {"."}):
        raise ValueError(f"'path' segment {shown} is a '.' or '..' segment; refused")
    if ";" in form:
        raise ValueError(
            f"'path' segment {shown} has a ';' (a path parameter, as in '/..;/'); refused")
    if "/" in form or "\\" in form:  # "/" only once decoded: the split was on the raw "/"
        raise ValueError(f"'path' segment {shown} has an encoded '/' or '\\'; refused")
    for char in form:
        if char < " " or char == "\x7f" or (char >= "\x80" and not char.isprintable()):
            raise ValueError(
                f"'path' segment {shown} has {_describe(char)} once decoded; control and "
                "invisible characters are refused")


def header_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be an HTTP header name (None: it can)."""
    if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
        return f"header name {_short(name)} is not an HTTP token (letters, digits, '-', ...)"
    return None


def header_value_problem(value: Any) -> str | None:
    """Why ``value`` cannot be sent as an HTTP header value (None: it can).

    A value is visible ASCII with single spaces or tabs between words: no CR, LF or other
    control character (header injection), no non-ASCII character (the HTTP client refuses
    them), no leading or trailing whitespace (HTTP strips it; h11 refuses it).
    """
    if not isinstance(value, str):
        return f"header value {_short(value)} is not a string"
    if _HEADER_VALUE.fullmatch(value):
        return None
    if "\r" in value or "\n" in value:
        return "header value contains CR or LF"
    bad = next((c for c in value if not ("\x20" <= c <= "\x7e" or c == "\t")), None)
    if bad is not None:
        return (f"header value contains {_describe(bad)}; only visible ASCII is sent "
                "(percent-encode or base64 other text)")
    return "header value has leading or trailing whitespace"


# ------------------------------------------------------------------ addresses

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052 well-known prefix
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215 local use
_IPV4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # RFC 2765 SIIT
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated (RFC 4291)


def _own_reason(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    for attr in ("is_loopback", "is_unspecified", "is_link_local", "is_multicast",
                 "is_private", "is_reserved"):
        if getattr(ip, attr):
            return attr[3:].replace("_", "-")
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return "shared (100.64.0.0/10)"
    return None


def _embedded(ip: ipaddress.IPv6Address) -> tuple[str, list[ipaddress.IPv4Address]] | None:
    """The IPv4 addresses an IPv6 address carries, with the name of the scheme."""
    if ip.ipv4_mapped is not None:
        return "IPv4-mapped", [ip.ipv4_mapped]
    if ip.sixtofour is not None:
        return "6to4", [ip.sixtofour]
    if ip.teredo is not None:
        server, client = ip.teredo
        return "Teredo", [client, server]
    low32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _NAT64:
        return "NAT64", [low32]
    if ip in _IPV4_TRANSLATED:
        return "IPv4-translated", [low32]
    if ip in _IPV4_COMPATIBLE and int(ip) > 1:  # not :: or ::1
        return "IPv4-compatible", [low32]
    return None


def blocked_reason(address: str) -> str | None:
    """Why ``address`` (an IP literal) is blocked by ``block_private_networks``, or None.

    Blocked: loopback, unspecified, link-local, multicast, private, reserved, IPv6
    site-local and shared (100.64.0.0/10) addresses; an IPv6 address that embeds a blocked
    IPv4 address (IPv4-mapped ``::ffff:0:0/96``, IPv4-compatible ``::/96``,
    IPv4-translated ``::ffff:0:0:0/96``, 6to4 ``2002::/16``, Teredo ``2001::/32`` (client
    and server), NAT64 ``64:ff9b::/96``), named with the embedded address; local-use NAT64
    (``64:ff9b:1::/48``); and the deprecated IPv4-compatible and IPv4-translated forms
    whatever they embed. An IPv4-mapped or well-known-prefix NAT64 address of a public IPv4
    address passes (the connection goes to that public address).

    Raises:
        ValueError: ``address`` is not an IP address.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return "private (local-use NAT64 64:ff9b:1::/48)"
        embedded = _embedded(ip)
        if embedded is not None:
            kind, inner = embedded
            for v4 in inner:
                why = _own_reason(v4)
                if why is not None:
                    return f"{why} (IPv4 {v4} embedded in a {kind} address)"
            if kind in ("IPv4-mapped", "NAT64"):
                return None  # a public IPv4 address, reached through the IPv6 stack
            if kind in ("IPv4-compatible", "IPv4-translated"):
                return f"reserved (deprecated {kind} address)"
    return _own_reason(ip)
