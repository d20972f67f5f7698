"""The one place that decides what of a URL, a header set or an error text may be shown.

Every log line, banner, CLI output (text and ``--json``), ``last_error`` column, dead-letter
``error`` and metric that shows a URL or headers goes through this module. The rules:

* **URLs** (:func:`redact_url`): the password of ``user:password@`` is replaced by ``***``
  (an unescaped ``@`` inside the password is handled: everything up to the *last* ``@`` of
  the authority is userinfo); every query parameter whose name is sensitive (``password``,
  ``token``, ``secret``, ``key``, ``sig``, ...: :data:`SENSITIVE_WORDS`) has its value
  replaced; the fragment is dropped; in ``http(s)`` / ``ws(s)`` URLs, path segments that
  look like tokens (long, letters and digits) are replaced, and on known webhook hosts
  (Slack, Teams, Discord, ...: the URL *is* the credential) the whole path is. A URL that
  cannot be parsed is shown as
  ``<unparseable URL>`` (with its scheme when one is recognisable): never a fragment of it,
  and the function never raises (no ``invalid literal for int()`` echoing a port).
* **Headers** (:func:`redact_headers`): the value of every header whose name is sensitive
  (``Authorization``, ``Proxy-Authorization``, ``Cookie``, ``Set-Cookie``, ``X-Api-Key``,
  anything naming a token, secret, password, signature, credential or session) becomes
  ``***``.
* **Free text** (:func:`redact_text`): every URL found in the text is redacted as above,
  an HTTP credential (``Bearer ...``, ``Basic ...``) loses its value, and ``name=value`` /
  ``name: value`` pairs with a sensitive name (libpq DSNs, ``password=...``, header lines),
  also quoted as JSON or a Python dict shows them (``"api_key": "..."``), lose their value
  (a quoted value whole; a ``Cookie:`` line to its end). A bare ``key`` is sensitive here
  (``key=sk_live_...``, ``API key: ...``) unless a word before it names a harmless key
  (``idempotency key: ...``, ``duplicate key: ...``). Used on exception messages before they
  are logged or stored.
* **JSON-like values** (:func:`redact_value`): dicts, lists and strings, recursively; keys
  with sensitive names lose their values, ``headers`` mappings go through
  :func:`redact_headers`, strings through :func:`redact_text`. A bare ``key`` is this
  project's idempotency key (shown) except in a task's ``args`` / ``kwargs``. Used by
  ``dead-letters`` output, ``--json`` and the Celery messages' ``argsrepr`` / ``kwargsrepr``
  (:mod:`reliable_beat.celery.reprs`).
* **Loggers**: every reliable_beat logger and the third-party loggers that print URLs, task
  arguments, exceptions or message bodies (:data:`THIRD_PARTY_LOGGERS`: httpx, Celery's
  worker, Dramatiq's worker thread) carry :class:`RedactingFilter`.

The masking is one-way and stable (``***``), so two redacted outputs of the same input are
equal and can be compared in tests. Nothing here touches what is stored for replay: a dead
letter's payload keeps what the relay needs; only what is *shown* is redacted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote

__all__ = [
    "IDENTIFIER_FIELDS",
    "MASK",
    "SENSITIVE_HEADERS",
    "SENSITIVE_WORDS",
    "THIRD_PARTY_LOGGERS",
    "USER_DATA_FIELDS",
    "WEBHOOK_HOSTS",
    "RedactingFilter",
    "get_logger",
    "is_sensitive_name",
    "redact_headers",
    "redact_text",
    "redact_url",
    "redact_value",
]

#: What replaces a secret.
MASK = "***"

#: Header names whose values are always secret (compared case-insensitively).
SENSITIVE_HEADERS = frozenset({
    "authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key",
    "x-auth-token", "x-access-token", "x-csrf-token", "x-xsrf-token", "x-amz-security-token",
    "x-goog-api-key", "x-hub-signature", "x-hub-signature-256", "x-slack-signature",
})

#: A header, query parameter or JSON key whose name contains one of these (after lower-casing
#: and removing ``-`` and ``_``) is secret (``sig`` only as the end of the name). A name
#: ending in ``key`` is secret only with a qualifier (``api_key``, ``access_key``,
#: ``secret_key``, ``private_key``, ...), and a bare ``key`` only as a URL query parameter, so
#: ``Idempotency-Key`` and ``reliable_beat_key`` (work identifiers, not secrets) stay visible.
SENSITIVE_WORDS = (
    "password", "passwd", "pwd", "secret", "token", "auth", "cookie", "credential",
    "signature", "session", "apikey", "accesskey", "privatekey", "secretkey", "sig",
)
_EXACT_SENSITIVE = frozenset({"pass", "jwt", "bearer", "dsn"})
# short query parameter names that carry credentials in URLs (``?key=``, ``?code=``,
# ``?sig=``): secret in a URL, but ``key`` in our own JSON is an idempotency key
_EXACT_SENSITIVE_QUERY = frozenset({"key", "code", "sig", "sas", "sv", "se", "st", "sp", "k"})
_NOT_SENSITIVE = frozenset({"idempotencykey", "reliablebeatkey", "messageid", "routingkey",
                            "orderingkey", "dedupkey", "author", "fencetoken",
                            "reliablebeatfencetoken"})

#: Hosts whose webhook URLs carry their credential in the path (the whole path is hidden).
WEBHOOK_HOSTS = (
    "hooks.slack.com", "webhook.office.com", "discord.com", "discordapp.com",
    "outlook.office.com", "chat.googleapis.com", "api.telegram.org", "hooks.zapier.com",
    "maker.ifttt.com", "events.pagerduty.com", "api.opsgenie.com",
)

# a path segment that looks like a token: 16+ characters of a token alphabet with a digit
# and a letter, or 32+ of them whatever they are
_TOKENISH = re.compile(
    r"^(?=[A-Za-z0-9_\-.~+=%]*\d)(?=[A-Za-z0-9_\-.~+=%]*[A-Za-z])[A-Za-z0-9_\-.~+=%]{16,}$"
    r"|^[A-Za-z0-9_\-.~+=%]{32,}$"
)
# host[:port] or [ipv6][:port], comma-separated (libpq multi-host URLs)
_ONE_HOST = r"(?:\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9]+)?\]|[A-Za-z0-9.\-_~%]*)(?::\d{0,5})?"
_HOSTPORT = re.compile(rf"{_ONE_HOST}(?:,{_ONE_HOST})*")
# scheme://... up to whitespace or a quote/bracket that commonly ends a URL in prose
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
# an HTTP auth scheme and its credential ("Bearer abc", "Basic dXNlcjpw")
_SCHEME_CREDENTIAL = re.compile(
    r"\b(Bearer|Basic|Token|Digest|Negotiate)\s+(?!\*\*\*)([^\s'\",;()]+)", re.I)
# "digest 988d5608d86d6f42": a hash shown as a hash (a non-determinism message, a call
# digest), never an HTTP Digest credential (those are "Digest username=..., response=...")
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{8,128}$")
# a bare request target ("/hook/abc123...?token=x", as a server echoes it): after a space,
# a quote or the start, never inside a URL (those were redacted whole, above)
_PATH_IN_TEXT = re.compile(r"(?:(?<=[\s'\"(\[=])|^)(/[^\s'\"<>`]+)")
# name=value or name: value with a sensitive name (libpq DSN, "password=...", a header
# line), also quoted as JSON or a Python dict shows it ("api_key": "...", 'key': '...'); a
# quoted value is taken whole, up to its closing quote (spaces included); a value starting
# with '{' or '[' is a nested object, scanned on its own
_PAIR_IN_TEXT = re.compile(
    r"(?P<name>[A-Za-z][A-Za-z0-9_\-]*)(?P<nq>['\"]?)(?P<sep>\s*[=:]\s*)"
    r"(?:(?P<q>['\"])(?P<qvalue>(?:\\.|(?!(?P=q))[^\\\r\n])*)(?P=q)"
    r"|['\"]?(?P<value>[^\s'\",;&)}{\[][^\s'\",;&)}]*))"
)
# a bare "key" names a credential ("key=sk_live_...", "?key=...", "API key: ...") unless a
# word before it says which harmless key it is ("idempotency key: ...", "duplicate key: ...")
_HARMLESS_KEY_QUALIFIERS = frozenset({
    "idempotency", "ordering", "routing", "dedup", "dedupe", "deduplication", "duplicate",
    "primary", "foreign", "unique", "sort", "partition", "cache", "lookup", "row", "run",
    "message", "entry", "slot", "signal", "redis", "public", "dict", "mapping", "index",
    "composite", "natural", "shard", "hash", "lock", "group", "schedule", "workflow",
})
_WORD_BEFORE = re.compile(r"([A-Za-z]+)[ \t_\-]+$")
# after a credential's header name: "Authorization: Token <credential>"
_SCHEME_THEN_CREDENTIAL = re.compile(r"[ \t]+(?P<cred>[^\s'\",;()]+)")


def _norm(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "").replace(" ", "")


def is_sensitive_name(name: object) -> bool:
    """True when a header, query parameter or JSON key named ``name`` holds a secret."""
    if not isinstance(name, str):
        return False
    return _sensitive_str(name)


@functools.lru_cache(maxsize=4096)
def _sensitive_str(name: str) -> bool:
    # cached: the same few keys come back for every row of a large JSON document
    # (``reliable-beat status --json`` on 20,000 entries asks 280,000 times)
    if name.lower() in SENSITIVE_HEADERS:
        return True
    n = _norm(name)
    if n in _NOT_SENSITIVE:
        return False
    if n in _EXACT_SENSITIVE or (n.endswith("key") and n[:-3] in ("api", "access", "private",
                                                                  "secret", "client", "sas",
                                                                  "subscription", "signing")):
        return True
    return any(word in n for word in SENSITIVE_WORDS if word != "sig") or n.endswith("sig")


def _scheme_hint(url: str) -> str:
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]{0,30})://", url)
    return f"{m.group(1)}://" if m else ""


def redact_url(url: object) -> str:
    """``url`` with every secret in it masked, safe for logs, banners, JSON and error texts.

    Args:
        url: any URL (SQLAlchemy ``dialect+driver://``, ``redis://``, ``amqp://``,
            ``https://hooks.slack.com/services/...``) or anything else (shown only as
            ``<unparseable URL>``).

    Returns:
        ``scheme://user:***@host:port/path?name=***`` with the password, sensitive query
        values and token-like path segments masked and the fragment dropped. Never raises.
    """
    if not isinstance(url, str):
        return "<unparseable URL>"
    text = url.strip()
    try:
        return _redact_url(text)
    except Exception:
        return f"<unparseable URL {_scheme_hint(text)}...>"


def _redact_url(text: str) -> str:
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*):(//)?(.*)$", text, re.S)
    if m is None or any(c in text for c in "\r\n\t "):
        return f"<unparseable URL {_scheme_hint(text)}...>" if "://" in text else (
            "<unparseable URL>")
    scheme, slashes, rest = m.group(1), m.group(2) or "", m.group(3)
    if not slashes:  # mailto:, sqlite: relative forms etc.: nothing structured to keep
        return f"{scheme}:{MASK}" if rest else f"{scheme}:"
    # the authority ends at the first '/', '?' or '#' after the last '@' (an unescaped '@'
    # in a password belongs to the userinfo)
    end = len(rest)
    for sep in "/?#":
        i = rest.find(sep)
        if i != -1:
            end = min(end, i)
    at = rest.rfind("@")
    if at != -1 and ":" not in rest[:at] and "/" in rest[:at]:
        at = -1  # an '@' in the path (https://host/users/@me), not userinfo
    if at != -1:  # the userinfo may itself contain '/', '?' or '#' (unescaped in a password)
        tail = rest[at + 1:]
        t_end = len(tail)
        for sep in "/?#":
            i = tail.find(sep)
            if i != -1:
                t_end = min(t_end, i)
        authority, remainder = rest[: at + 1 + t_end], tail[t_end:]
    else:
        authority, remainder = rest[:end], rest[end:]
    userinfo, _, hostport = authority.rpartition("@")
    if userinfo:
        user, colon, _password = userinfo.partition(":")
        userinfo = f"{user}:{MASK}@" if colon else (f"{MASK}@" if _looks_secret(user) else
                                                     f"{user}@")
    if not _HOSTPORT.fullmatch(hostport):
        hostport = "<host?>"
    path, _, query = remainder.split("#", 1)[0].partition("?")
    host = hostport.lower().rsplit(":", 1)[0] if not hostport.startswith("[") else hostport
    if scheme.lower() in ("http", "https", "ws", "wss"):  # not database names / file paths
        path = _redact_path(path, host)
    out = f"{scheme}://{userinfo}{hostport}{path}"
    if query:
        out += "?" + _redact_query(query)
    return out


def _looks_secret(segment: str) -> bool:
    return bool(_TOKENISH.match(segment))


def _redact_path(path: str, host: str) -> str:
    path = path.split("#", 1)[0]
    if not path or path == "/":
        return path
    if any(host == h or host.endswith("." + h) for h in WEBHOOK_HOSTS):
        return "/" + MASK
    parts = path.split("/")
    return "/".join(MASK if _looks_secret(p) else p for p in parts)


def _redact_query(query: str) -> str:
    try:
        pairs = parse_qsl(query, keep_blank_values=True)
    except Exception:
        return MASK
    shown = []
    for name, value in pairs:
        if is_sensitive_name(name) or name.lower() in _EXACT_SENSITIVE_QUERY or (
                _looks_secret(value)):
            value = MASK
        shown.append(f"{quote(name, safe='')}={quote(value, safe='*')}" if value != MASK
                     else f"{quote(name, safe='')}={MASK}")
    return "&".join(shown)


def _redact_bare_path(m: re.Match[str]) -> str:
    target = m.group(1)
    path, sep, query = target.partition("?")
    shown = "/".join(MASK if _looks_secret(p) else p for p in path.split("/"))
    return shown + (sep + _redact_query(query) if sep else "")


def redact_headers(headers: Mapping[Any, Any] | None) -> dict[str, Any]:
    """A copy of ``headers`` with the value of every sensitive header replaced by ``***``.

    Args:
        headers: header name -> value (any mapping; ``None`` gives ``{}``).

    Returns:
        A new ``dict`` (names kept as given); nested values go through :func:`redact_value`.
    """
    if not headers:
        return {}
    return {
        str(k): MASK if is_sensitive_name(k) else redact_value(v) for k, v in headers.items()
    }


def redact_text(text: object) -> str:
    """``text`` (an exception message, a log argument) with URLs and ``secret=value`` masked.

    Returns:
        The text with each URL passed through :func:`redact_url` and the value of each
        ``name=value`` / ``name: value`` pair whose name is sensitive replaced by ``***``.
    """
    s = text if isinstance(text, str) else str(text)
    # cheap substring checks first: most log lines (events of the beat's hot path) have
    # nothing any pattern below could match, and skip every regular expression
    if "://" in s:
        s = _URL_IN_TEXT.sub(_redact_url_in_text, s)
    low = s.lower()
    if _CREDENTIAL_SCHEME_IN.search(low):
        s = _SCHEME_CREDENTIAL.sub(_redact_scheme_credential, s)
        if "digest" in low and "response" in low:  # HTTP Digest: the response is the proof
            s = _DIGEST_RESPONSE.sub(rf"\g<1>\g<2>{MASK}", s)
    if "/" in s:
        s = _PATH_IN_TEXT.sub(_redact_bare_path, s)
    if ("=" not in s and ":" not in s) or not _mentions_sensitive_word(low):
        return s

    # Scan pair by pair. A harmless name's "value" may itself begin a sensitive pair
    # ("ValueError: token: abc", "PermanentError: api_key=sk_live_..."): after a harmless
    # name the scan goes on from its separator, so that value is read as a name too.
    out: list[str] = []
    pos = 0
    while (m := _PAIR_IN_TEXT.search(s, pos)) is not None:
        group = "qvalue" if m.group("q") else "value"
        value = m.group(group)
        if not value or value == MASK:
            out.append(s[pos:m.end()])
            pos = m.end()
            continue
        name = m.group("name")
        if (m.start() and s[m.start() - 1] == ":") or not _secret_pair(name, s, m.start()):
            # ":" right before the name: a part of a colon-joined identifier (an idempotency
            # key "wf:password-reset:1", "session:42:close"), not a pair's name
            out.append(s[pos:m.end("sep")])
            pos = m.end("sep")
            continue
        start, end = m.start(group), m.end(group)
        scheme = value.split(None, 1)[0]
        if group == "qvalue" and scheme.lower() in _CREDENTIAL_SCHEMES and scheme != value:
            start += len(scheme) + 1  # 'Digest username=..., response=...': 'Digest ***'
        elif group == "value" and value.lower() in _CREDENTIAL_SCHEMES:
            # "Authorization: Bearer ***" (masked above) stays; "Token abc": abc goes
            cred = _SCHEME_THEN_CREDENTIAL.match(s, end)
            if cred is not None and cred.group("cred") == MASK:
                out.append(s[pos:cred.end()])
                pos = cred.end()
                continue
            if cred is not None:
                start, end = cred.span("cred")
        elif group == "value" and _norm(name) in ("cookie", "setcookie") and (
                ":" in m.group("sep")):
            # a Cookie header line: every cookie of it ("a=1; b=2"), to the end of the line
            newline = s.find("\n", end)
            end = len(s) if newline == -1 else newline
            end -= s[end - 1:end] == "\r"
        out.append(s[pos:start])
        out.append(MASK)
        pos = end
    out.append(s[pos:])
    return "".join(out)


def _secret_pair(name: str, text: str, start: int) -> bool:
    """Whether ``name`` (found at ``start`` of ``text``) names a secret in free text."""
    if is_sensitive_name(name):
        return True
    if _norm(name) != "key":
        return False
    before = _WORD_BEFORE.search(text, max(0, start - 40), start)
    return before is None or before.group(1).lower() not in _HARMLESS_KEY_QUALIFIERS


_CREDENTIAL_SCHEMES = ("bearer", "basic", "token", "digest", "negotiate")
#: any of them in a text (one scan instead of one per word: most texts hold none)
_CREDENTIAL_SCHEME_IN = re.compile("|".join(_CREDENTIAL_SCHEMES))
# the ``response`` parameter of an HTTP ``Digest`` credential (a hash that proves the
# password, replayable within its nonce): masked wherever a Digest credential is quoted
_DIGEST_RESPONSE = re.compile(r"""(\bresponse\s*=\s*)(["']?)(?!\*\*\*)[^"',\s]+""", re.I)
# punctuation that ends a sentence or a clause after a URL in prose ("see https://x/y.",
# "url=postgresql://h/db?a=b: inserted 4"): not part of the URL (as linkifiers decide)
_URL_TRAILING = ".,;:!?"
# a "Token <credential>" value: "token" is an ordinary word ("fence token 1 is stale"), so
# only a value shaped like a credential (letters and digits mixed, or long) is one
_TOKEN_CREDENTIAL = re.compile(
    r"^(?=.*\d)(?=.*[A-Za-z]).{8,}$|^.{20,}$"
)


def _redact_url_in_text(m: re.Match[str]) -> str:
    url = m.group(0)
    core = url.rstrip(_URL_TRAILING)
    if core.endswith(")") and core.count("(") < core.count(")"):
        core = core[:-1]  # "(see https://x/y)": the bracket closes the prose, not the URL
    return redact_url(core) + url[len(core):]


def _redact_scheme_credential(m: re.Match[str]) -> str:
    scheme, value = m.group(1), m.group(2)
    if value.isdigit() and len(value) < 8:
        return m.group(0)  # "fence token 1", "basic 2 retries": a count, never a credential
    if scheme.lower() == "digest" and _HEX_DIGEST.match(value):
        return m.group(0)  # "args digest 988d5608d86d6f42": a hash, not a credential
    if scheme.lower() == "token" and not _TOKEN_CREDENTIAL.match(value):
        return m.group(0)  # "the token is stale": the English word, not the HTTP scheme
    return f"{scheme} {MASK}"
_TEXT_WORDS = (*SENSITIVE_WORDS, *_EXACT_SENSITIVE, "key")


_TEXT_WORD_IN = re.compile("|".join(re.escape(w) for w in _TEXT_WORDS))


def _mentions_sensitive_word(low: str) -> bool:
    squeezed = low.replace("-", "").replace("_", "")
    return _TEXT_WORD_IN.search(squeezed) is not None


def redact_value(value: Any, *, user_data: bool = False) -> Any:
    """``value`` (JSON-like: dict / list / str / scalar) with every secret masked.

    Keys with sensitive names lose their values; a ``headers`` mapping goes through
    :func:`redact_headers`; a ``url`` string through :func:`redact_url`; other strings
    through :func:`redact_text`. The input is not modified.

    A bare ``key`` is this project's own field (an idempotency key, a dead letter's key),
    shown as it is (as are the other :data:`IDENTIFIER_FIELDS`), except in an application's
    data: the values under ``args``, ``kwargs`` and ``body`` (:data:`USER_DATA_FIELDS`), or
    all of ``value`` with ``user_data=True``, where ``key`` names a credential as in free
    text (``key="sk_..."``).
    """
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if (is_sensitive_name(k) or (user_data and isinstance(k, str) and _norm(k) == "key")
                    ) and not isinstance(v, (Mapping, list, tuple)):
                out[k] = MASK if v not in (None, "") else v
            elif k == "headers" and isinstance(v, Mapping):
                out[k] = redact_headers(v)
            elif k == "url" and isinstance(v, str):
                out[k] = redact_url(v)
            elif k in IDENTIFIER_FIELDS and isinstance(v, str) and not user_data:
                out[k] = v  # our own identifier, whatever it reads like ("session:42:close")
            else:
                out[k] = redact_value(v, user_data=user_data or k in USER_DATA_FIELDS)
        return out
    if isinstance(value, (list, tuple)):
        return [redact_value(v, user_data=user_data) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


#: The keys under which an application's own data is found (a task's, a workflow's
#: arguments, a webhook's body): a bare ``key`` there is a credential's name, not an
#: idempotency key.
USER_DATA_FIELDS = frozenset({"args", "kwargs", "body"})
#: Fields that hold this project's own identifiers (idempotency keys, message, workflow and
#: entry names): shown as they are, even when one reads like a secret pair
#: (``"session:42:close"``), outside :data:`USER_DATA_FIELDS`.
IDENTIFIER_FIELDS = frozenset({"idempotency_key", "key", "run_key", "message_id",
                               "workflow_id", "dedup_key", "ordering_key", "entry_name"})


class RedactingFilter(logging.Filter):
    """A :class:`logging.Filter` that passes every record through :func:`redact_text`.

    The message is rendered (``msg % args``), redacted and stored back with no args; the
    traceback of ``exc_info`` is rendered and redacted into ``exc_text`` (which standard
    formatters print instead of formatting the exception again); string ``extra`` fields
    (``record.error``, ``record.url``) are redacted too. Attached to every reliable_beat
    logger by :func:`get_logger`, so a URL or token in an exception message never reaches a
    log handler, whatever handler the application configures.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        # a broken format string: logging reports it at emit, as it always does
        with contextlib.suppress(Exception):
            self._redact_message(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(_FORMATTER.formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        for name in ("error", "url", "reason"):
            value = record.__dict__.get(name)
            if isinstance(value, str):
                record.__dict__[name] = redact_text(value)
        data = record.__dict__.get("data")
        if isinstance(data, Mapping):  # Celery's ``extra={"data": context}`` (args, exc)
            with contextlib.suppress(Exception):
                record.__dict__["data"] = redact_value(data)
        return True


    @staticmethod
    def _redact_message(record: logging.LogRecord) -> None:
        fields = record.__dict__.get("event_fields")
        if isinstance(fields, tuple) and isinstance(record.__dict__.get("event"), str):
            # a structured event of ours (reliable_beat.logs.event): redact it field by
            # field, so an identifier field (the idempotency ``key``) is shown whole while
            # its neighbours (an ``error``) are redacted
            record.msg = record.__dict__["event"] + " " + " ".join(
                f"{k}={v}" if k in IDENTIFIER_FIELDS else f"{k}={redact_text(str(v))}"
                for k, v in ((k, record.__dict__.get(k)) for k in fields))
            record.args = ()
            return
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted == message:  # the common case: nothing secret, the record is untouched
            return
        args = record.args
        if isinstance(args, tuple) and args and isinstance(record.msg, str):
            # redact the arguments and keep the template (log aggregators group by it) when
            # that is enough; numbers stay numbers for %d / %.1f
            shown = tuple(a if isinstance(a, (int, float)) or a is None else redact_text(a)
                          for a in args)
            rendered = record.msg % shown
            if redact_text(rendered) == rendered:
                record.args = shown
                return
        record.msg = redacted
        record.args = None


_FORMATTER = logging.Formatter()
_FILTER = RedactingFilter()

#: Third-party loggers that print request URLs or headers (httpx logs every request's full
#: URL at INFO), or a task's arguments, its exception and traceback, or a message body
#: (Celery's worker: the "raised unexpected" ERROR line, "TaskPool: Apply" at DEBUG, an
#: unknown message's body; Dramatiq's worker thread: "Failed to process message
#: actor(args, kwargs)"): they get the same filter when this module is imported. A filter
#: applies to the records of the logger it is attached to, so each is named.
THIRD_PARTY_LOGGERS = (
    "httpx", "httpcore", "httpcore.connection", "httpcore.http11", "httpcore.http2",
    "httpcore.proxy", "httpcore.socks", "urllib3", "urllib3.connectionpool",
    "celery.app.trace", "celery.worker.strategy", "celery.worker.request", "celery.pool",
    "celery.worker.consumer.consumer", "dramatiq.worker.WorkerThread",
)


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with a :class:`RedactingFilter` attached (once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(_FILTER)
    return logger


for _name in THIRD_PARTY_LOGGERS:
    get_logger(_name)
