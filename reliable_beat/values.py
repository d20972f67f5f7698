"""Values at the edges: Celery-compatible JSON, and the limits of names, keys and ids.

Framework-neutral (no Celery or kombu import): the encoding below is the one kombu's JSON
serializer (``kombu.utils.json``, Celery's default ``json`` serializer) uses for the types
it handles beyond plain JSON, so a value stored here and a value carried in a Celery
message look the same, and kombu's decoder turns either back into the Python value::

    datetime  -> {"__type__": "datetime", "__value__": "2026-01-10T12:00:00+00:00"}
    date      -> {"__type__": "date", "__value__": "2026-01-10"}
    time      -> {"__type__": "time", "__value__": "12:00:00"}
    Decimal   -> {"__type__": "decimal", "__value__": "12.50"}
    UUID      -> {"__type__": "uuid", "__value__": {"hex": "..."}}
    bytes     -> {"__type__": "bytes", "__value__": "<utf-8 text>"} (else "base64")
    tuple     -> list (as JSON has no tuple)

Limits are the column sizes of the store, the same on every dialect (SQLite would accept
any length; PostgreSQL refuses at the claim), checked where values enter: configuration,
CLI, API and the task call. One message names the value, its length and the limit.
"""

from __future__ import annotations

import base64
import json
import math
import uuid
from collections.abc import Mapping
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

from reliable_beat.errors import ConfigurationError

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_ENTRY_NAME",
    "MAX_IDEMPOTENCY_KEY",
    "MAX_TASK_ID",
    "MAX_TASK_NAME",
    "ValueLimitError",
    "call_digest",
    "check_entry_name",
    "check_length",
    "entry_name_problems",
    "from_json_value",
    "json_size",
    "to_json_value",
    "to_plain_json",
]

#: ``reliable_beat_runs.idempotency_key`` (characters).
MAX_IDEMPOTENCY_KEY = 400
#: ``reliable_beat_attempts.task_id``: a Celery task id (a UUID is 36).
MAX_TASK_ID = 64
#: ``reliable_beat_entries.name`` and ``reliable_beat_runs.entry_name``.
MAX_ENTRY_NAME = 200
#: ``reliable_beat_entries.task`` / ``reliable_beat_runs.task``: a registered task name.
MAX_TASK_NAME = 255


class ValueLimitError(ConfigurationError):
    """A value is longer than the store allows, or holds characters it must not.

    A :class:`ConfigurationError`, so a ``ValueError``: bad input, which retrying cannot fix
    (an ``IdempotentTask`` classes it as permanent). The message names the value, its length
    and the limit.
    """


def check_length(what: str, value: str, limit: int) -> str:
    """Return ``value`` if it has at most ``limit`` characters.

    Args:
        what: how to name the value in the message (``"idempotency key"``).
        value: the string.
        limit: the most characters allowed.

    Raises:
        ValueLimitError: ``value`` is longer; the message quotes its start, its length and
            the limit.
    """
    if len(value) > limit:
        raise ValueLimitError(
            f"{what} {value[:60]!r}... is {len(value)} characters long; the limit is {limit} "
            "(the same on every database): use a shorter one (e.g. a digest of the long part)"
        )
    return value


def entry_name_problems(name: Any) -> list[str]:
    """What is wrong with an entry name (empty list: nothing).

    An entry name is a non-empty string of at most :data:`MAX_ENTRY_NAME` characters with
    no control characters (a newline or an ANSI escape in a name forges log lines).
    """
    if not isinstance(name, str) or not name:
        return [f"entry name {name!r}: expected a non-empty string"]
    problems = []
    if len(name) > MAX_ENTRY_NAME:
        problems.append(
            f"entry name {name[:60]!r}... is {len(name)} characters long; the limit is "
            f"{MAX_ENTRY_NAME} (the same on every database): use a shorter name"
        )
    bad = sorted({c for c in name if ord(c) < 32 or 127 <= ord(c) < 160})
    if bad:
        problems.append(
            f"entry name {name[:60]!r} contains control characters "
            f"({', '.join(repr(c) for c in bad)}); use printable characters only"
        )
    return problems


def check_entry_name(name: Any) -> str:
    """Return ``name`` if it is a valid entry name (see :func:`entry_name_problems`).

    Raises:
        ValueLimitError: the name is too long, empty, or holds control characters.
    """
    problems = entry_name_problems(name)
    if problems:
        raise ValueLimitError("; ".join(problems))
    return str(name)


def _typed(kind: str, value: Any) -> dict[str, Any]:
    return {"__type__": kind, "__value__": value}


def to_json_value(value: Any, what: str = "value") -> Any:
    """``value`` as plain JSON data, encoded as Celery's JSON serializer (kombu) encodes it.

    Plain JSON values pass unchanged (tuples become lists); ``datetime``, ``date``,
    ``time``, ``Decimal``, ``UUID`` and ``bytes`` become kombu's ``{"__type__",
    "__value__"}`` objects (module docstring); an object with a ``__json__()`` method is
    replaced by what it returns. Dict keys must be strings (JSON's rule; ``int``, ``float``
    and ``bool`` keys are turned into strings as ``json`` does).

    Args:
        value: the value.
        what: how to name the value in errors (``"entry 'x': args[1]"``).

    Returns:
        A value made of ``dict`` / ``list`` / ``str`` / ``int`` / ``float`` / ``bool`` /
        ``None`` only.

    Raises:
        ValueError: a type neither JSON nor kombu carries, a non-finite float (NaN and
            infinities are not JSON; PostgreSQL refuses them) or a ``\\x00`` in a string
            (PostgreSQL's JSON refuses it). The message names the path to the value
            (``what[2]['when']``) and its type.
    """
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, str) and "\x00" in value:
            raise ValueError(f"{what}: a string with a NUL character (\\x00) cannot be stored")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{what}={value!r}: not a finite number; JSON has no NaN/infinity")
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if isinstance(k, (bool, int, float)) or k is None:
                k = json.dumps(k)
            if not isinstance(k, str):
                raise ValueError(f"{what}: key {k!r} ({type(k).__name__}) is not a string")
            out[k] = to_json_value(v, f"{what}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, f"{what}[{i}]") for i, v in enumerate(value)]
    reducer = getattr(value, "__json__", None)
    if callable(reducer):
        return to_json_value(reducer(), what)
    if isinstance(value, datetime):
        return _typed("datetime", value.isoformat())
    if isinstance(value, date):
        return _typed("date", value.isoformat())
    if isinstance(value, time):
        return _typed("time", value.isoformat())
    if isinstance(value, Decimal):
        return _typed("decimal", str(value))
    if isinstance(value, uuid.UUID):
        return _typed("uuid", {"hex": value.hex})
    if isinstance(value, (bytes, bytearray)):
        try:
            return _typed("bytes", bytes(value).decode("utf-8"))
        except UnicodeDecodeError:
            return _typed("base64", base64.b64encode(bytes(value)).decode("ascii"))
    raise ValueError(
        f"{what}: a {type(value).__name__} is not something Celery's JSON serializer "
        "carries (plain JSON, datetime, date, time, Decimal, UUID, bytes); convert it "
        "(e.g. to a string or a dict)"
    )


_DECODERS: dict[str, Any] = {
    "datetime": datetime.fromisoformat,
    "date": date.fromisoformat,
    "time": time.fromisoformat,
    "decimal": Decimal,
    "uuid": lambda v: uuid.UUID(hex=v["hex"]),
    "bytes": lambda v: v.encode("utf-8"),
    "base64": lambda v: base64.b64decode(v.encode("utf-8")),
}


def from_json_value(value: Any) -> Any:
    """The inverse of :func:`to_json_value`: kombu's typed objects back to Python values.

    ``{"__type__": "decimal", "__value__": "1.10"}`` becomes ``Decimal("1.10")``, and so on
    for ``datetime``, ``date``, ``time``, ``uuid``, ``bytes`` and ``base64`` (what kombu's
    JSON decoder does for a Celery worker), recursively through lists and dicts. A dict that
    is not exactly ``{"__type__", "__value__"}`` of a known type, or whose value does not
    decode, is kept as it is (a new dict); tuples were lists and stay lists. Deterministic:
    the same stored JSON always gives equal values (replay relies on it).
    """
    if isinstance(value, list):
        return [from_json_value(v) for v in value]
    if isinstance(value, dict):
        if value.keys() == {"__type__", "__value__"}:
            decode = _DECODERS.get(value["__type__"]) if isinstance(
                value["__type__"], str) else None
            if decode is not None:
                try:
                    return decode(value["__value__"])
                except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError):
                    pass
        return {k: from_json_value(v) for k, v in value.items()}
    return value


_PLAIN_RENDERINGS = {
    "datetime": str, "date": str, "time": str, "decimal": str, "bytes": str, "base64": str,
}


def to_plain_json(value: Any) -> Any:
    """``value`` (plain JSON from :func:`to_json_value`) with kombu's typed objects rendered
    as the strings a JSON API expects, for a far end that is not a Celery worker.

    ``{"__type__": "decimal", "__value__": "12.50"}`` becomes ``"12.50"``, a datetime, date or
    time its ISO 8601 text, a UUID its canonical text (``"1b4e28ba-2fa1-..."``), bytes their
    text (or base64 text): the rendering of Django's ``DjangoJSONEncoder``. Anything else is
    returned unchanged. A Celery worker needs no such step: kombu's JSON decoder turns the
    typed objects back into Python values.
    """
    if isinstance(value, list):
        return [to_plain_json(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 2 and "__type__" in value and "__value__" in value:
            kind, inner = value["__type__"], value["__value__"]
            if kind == "uuid" and isinstance(inner, dict) and isinstance(inner.get("hex"), str):
                try:
                    return str(uuid.UUID(hex=inner["hex"]))
                except ValueError:
                    return inner["hex"]
            render = _PLAIN_RENDERINGS.get(kind) if isinstance(kind, str) else None
            if render is not None and isinstance(inner, str):
                return render(inner)
        return {k: to_plain_json(v) for k, v in value.items()}
    return value


def call_digest(args: Any, kwargs: Any) -> str:
    """A digest of a call's arguments (SHA-256 hex of canonical JSON), for key-reuse checks.

    ``args`` / ``kwargs`` are first brought to :func:`to_json_value` form, so the digest of
    a call as sent and as stored are the same.
    """
    import hashlib

    body = json.dumps(
        [to_json_value(list(args or ())), to_json_value(dict(kwargs or {}))],
        sort_keys=True, separators=(",", ":"),
    )
    return hashlib.sha256(body.encode()).hexdigest()


#: Default largest JSON size of a row's payload + headers, in bytes (the setting
#: ``reliable_beat_max_payload_bytes``): a row is copied into the broker or the far end on
#: every delivery, and a relay holds a whole claimed batch in memory.
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON (values JSON cannot encode count as ``str``)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                          default=str).encode())
