"""Write-time checks of outbox payloads: a row its handler can never deliver is refused.

:func:`reliable_beat.outbox.add` calls :func:`check_payload` before it inserts, so a row
whose shape its destination's handler would refuse (a ``webhook`` row with the retired
``url``, an ``smtp`` row without ``to``, a ``celery`` row without ``task``) raises
:class:`~reliable_beat.errors.OutboxPayloadError` in the caller's transaction, naming the
field and the fix, instead of being dead-lettered by the relay on its first attempt.

What is checked is what can be known where the row is written: the payload's shape. What
depends on the relay's configuration (is webhook destination ``billing`` configured, is this
``from`` address in ``reliable_beat_smtp['allowed_from']``, is the Celery task registered) is
still the relay's to refuse.

Validators:

* built-in destinations (``celery``, ``kombu``, ``webhook``, ``smtp``, ``dramatiq``): the
  functions :data:`BUILTIN_VALIDATORS` names, which run the handlers' own checks where they
  exist (the webhook path guard, the e-mail builder), so the two cannot disagree;
* a user handler's optional ``validate(payload)`` hook: the handler object named in
  ``reliable_beat_outbox_handlers`` (passed to ``add`` as ``handlers=``; ``IdempotentTask``'s
  and ``current()``'s ``outbox.add`` pass their settings') or in the entry point group
  ``reliable_beat.outbox_handlers``. ``validate`` raises ``ValueError`` (or
  ``OutboxPayloadError``) for a payload it would never deliver; on a class it must be a
  ``staticmethod`` or ``classmethod`` (nothing is instantiated to validate);
* any other destination: not checked.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from datetime import datetime
from importlib.metadata import entry_points
from typing import Any

from reliable_beat.destinations import SmtpConfig, WebhookDestination
from reliable_beat.errors import ConfigurationError, OutboxPayloadError, PermanentDeliveryError
from reliable_beat.handlers import ENTRY_POINT_GROUP, SmtpHandler, resolve_handler
from reliable_beat.messages import OutboxMessage
from reliable_beat.redaction import get_logger

__all__ = [
    "BUILTIN_VALIDATORS",
    "check_celery",
    "check_dramatiq",
    "check_kombu",
    "check_payload",
    "check_smtp",
    "check_webhook",
    "validator_for",
]

log = get_logger(__name__)

Validator = Callable[[Any], None]

#: The keys a ``webhook`` row may carry.
_WEBHOOK_KEYS = frozenset({"destination", "path", "body", "method"})
_WEBHOOK_FIX = ("name an operator-configured destination instead: {'destination': NAME, "
                "'path': '/...', 'body': ...} with reliable_beat_webhook_destinations = "
                "{NAME: {'base_url': 'https://...'}}")


def _refuse(field: str | None, problem: str) -> OutboxPayloadError:
    return OutboxPayloadError(problem, field=field)


def _object(payload: Any, shape: str) -> Mapping[str, Any]:
    if not isinstance(payload, Mapping):
        raise _refuse(None, f"the payload must be a JSON object {shape}, got "
                            f"{type(payload).__name__}")
    return payload


def check_webhook(payload: Any) -> None:
    """``{"destination": str, "path"?: "/...", "body"?: any, "method"?: str}``.

    Refuses the retired ``url`` form (and any other key), a destination that is not a name,
    a method that is not a word, and a path the handler's guard refuses (not starting with a
    single ``/``, ``..`` segments, whitespace, ``\\``, ``#``).
    """
    p = _object(payload, '{"destination", "path", "body"}')
    if "url" in p:
        raise _refuse("url", f"webhook rows may not carry a 'url'; {_WEBHOOK_FIX}")
    extra = sorted(set(p) - _WEBHOOK_KEYS)
    if extra:
        raise _refuse(extra[0], f"webhook payload key(s) {', '.join(map(repr, extra))} are not "
                                "accepted; a row gives only 'destination', 'path', 'body' and "
                                "'method' (headers and timeouts are the destination's "
                                "configuration)")
    name = p.get("destination")
    if not isinstance(name, str) or not 0 < len(name) <= 100:
        raise _refuse("destination", "webhook rows need 'destination': the name (1..100 "
                                     f"characters) of a configured destination; {_WEBHOOK_FIX}")
    method = p.get("method", "POST")
    if not isinstance(method, str) or not method.isalpha():
        raise _refuse("method", f"webhook 'method' must be an HTTP method such as 'POST', "
                                f"got {method!r}")
    try:  # the handler's own guard, on a stand-in base URL
        WebhookDestination(name=name, base_url="http://payload.check").url_for(p.get("path", "/"))
    except PermanentDeliveryError as exc:
        raise _refuse("path", str(exc)) from None


#: A stand-in SMTP configuration: the sender checks that depend on the operator's
#: ``allowed_from`` are the relay's; every other check is :meth:`SmtpHandler.build`'s own.
_SMTP_SENDER = "sender@payload.check"


def check_smtp(payload: Any) -> None:
    """``{"to": str | [str], "cc"?, "subject": str, "text"?: str, "html"?: str, "from"?}``:
    the e-mail is built as the relay would build it (addresses, CR/LF in headers, the
    serialised message); nothing is sent."""
    p = _object(payload, '{"to", "subject", "text"}')
    for key in ("to", "subject"):
        if key not in p:
            raise _refuse(key, f"smtp rows need {key!r}: {{'to': address or [addresses], "
                               "'subject': str, 'text': str}; 'cc', 'html', 'from' are "
                               "optional")
    subject = p["subject"]
    if isinstance(subject, str) and ("\r" in subject or "\n" in subject):
        raise _refuse("subject", "smtp 'subject' may not contain CR or LF")
    sender = p.get("from")
    allowed = {sender.lower()} if isinstance(sender, str) else set()
    config = SmtpConfig(from_address=_SMTP_SENDER, allowed_from=frozenset(allowed))
    message = OutboxMessage(id=0, message_id="payload-check", destination="smtp",
                            payload=p)
    try:
        SmtpHandler(config).build(message)
    except PermanentDeliveryError as exc:
        text = str(exc).removeprefix("outbox row 0: ")
        field = next((k for k in ("from", "to", "cc", "subject", "text", "html")
                      if repr(k) in text), None)
        raise _refuse(field, text) from None


def _instant(value: Any, field: str) -> None:
    if value is None or isinstance(value, datetime):
        return
    text = str(value)
    try:
        parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise _refuse(field, f"{field!r} must be an ISO-8601 instant with a UTC offset "
                             f"(e.g. '2026-01-01T02:00:00Z') or null, got {value!r}")


def _sequence(p: Mapping[str, Any], key: str) -> None:
    if p.get(key) is not None and not isinstance(p[key], (list, tuple)):
        raise _refuse(key, f"{key!r} must be a list, got {type(p[key]).__name__}")


def _mapping(p: Mapping[str, Any], key: str) -> None:
    if p.get(key) is not None and not isinstance(p[key], Mapping):
        raise _refuse(key, f"{key!r} must be an object, got {type(p[key]).__name__}")


def _name(p: Mapping[str, Any], key: str, what: str) -> None:
    if not isinstance(p.get(key), str) or not p[key]:
        raise _refuse(key, f"{what} rows need {key!r}: the name, a non-empty string")


def check_celery(payload: Any) -> None:
    """``{"task": str, "args"?: list, "kwargs"?: object, "options"?: object,
    "expires_at"?: ISO-8601 with offset, ...}``."""
    p = _object(payload, '{"task", "args", "kwargs"}')
    _name(p, "task", "celery")
    _sequence(p, "args")
    _mapping(p, "kwargs")
    _mapping(p, "options")
    _instant(p.get("expires_at"), "expires_at")


def check_kombu(payload: Any) -> None:
    """``{"routing_key", "body", "exchange"?, "exchange_type"?, "serializer"?, "headers"?}``."""
    p = _object(payload, '{"routing_key", "body"}')
    for key in ("routing_key", "body"):
        if key not in p:
            raise _refuse(key, f"kombu rows need {key!r} ('routing_key' and 'body')")
    _mapping(p, "headers")


def check_dramatiq(payload: Any) -> None:
    """``{"actor": str, "args"?: list, "kwargs"?: object, "queue"?, "delay_ms"?,
    "options"?: object}`` (or a beat's trigger payload, which names a ``task``)."""
    p = _object(payload, '{"actor", "args", "kwargs"}')
    if "actor" not in p and "task" in p:  # a trigger payload, as a beat writes it
        _name(p, "task", "dramatiq trigger")
        return
    _name(p, "actor", "dramatiq")
    _sequence(p, "args")
    _mapping(p, "kwargs")
    _mapping(p, "options")
    delay = p.get("delay_ms")
    if delay is not None and (not isinstance(delay, int) or isinstance(delay, bool)
                              or delay < 0):
        raise _refuse("delay_ms", f"'delay_ms' must be milliseconds >= 0, got {delay!r}")
    _instant(p.get("expires_at"), "expires_at")


#: Destination name -> the check of its built-in handler.
BUILTIN_VALIDATORS: Mapping[str, Validator] = {
    "celery": check_celery,
    "kombu": check_kombu,
    "webhook": check_webhook,
    "smtp": check_smtp,
    "dramatiq": check_dramatiq,
}


def _hook(name: str, obj: Any) -> Validator | None:
    """The ``validate`` hook of handler ``obj`` (a class: its static or class method)."""
    hook = getattr(obj, "validate", None)
    if hook is None:
        return None
    if isinstance(obj, type) and not isinstance(
            inspect.getattr_static(obj, "validate"), (staticmethod, classmethod)):
        raise ConfigurationError(
            f"outbox handler {name!r}: {obj.__qualname__}.validate must be a staticmethod or "
            "classmethod (rows are validated where they are written, without instantiating "
            "the handler)")
    if not callable(hook):
        raise ConfigurationError(f"outbox handler {name!r}: 'validate' is not callable")
    return hook  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=256)
def _configured_hook(name: str, path: str) -> Validator | None:
    try:
        obj = resolve_handler(path)
    except ConfigurationError as exc:
        log.warning("outbox rows to %r are not checked where they are written: %s", name, exc)
        return None
    return _hook(name, obj)


@functools.lru_cache(maxsize=1)
def _entry_points() -> Mapping[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


@functools.lru_cache(maxsize=256)
def _entry_point_hook(name: str) -> Validator | None:
    ep = _entry_points().get(name)
    if ep is None:
        return None
    try:
        obj = ep.load()
    except Exception as exc:
        log.warning("outbox rows to %r are not checked where they are written: entry point "
                    "%s failed to load: %s", name, ep.value, exc)
        return None
    return _hook(name, obj)


def validator_for(destination: str, handlers: Mapping[str, Any] | None = None
                  ) -> Validator | None:
    """The validator of rows to ``destination``, or None (not checked).

    Later sources win, as in :func:`reliable_beat.handlers.load_handlers`: a built-in, then an
    entry point of :data:`~reliable_beat.handlers.ENTRY_POINT_GROUP`, then ``handlers``
    (``reliable_beat_outbox_handlers``: name -> ``"package.module:attr"`` or the handler).

    Raises:
        ConfigurationError: a handler's ``validate`` is an instance method of a class.
    """
    if handlers and destination in handlers:
        named = handlers[destination]
        if isinstance(named, str):
            return _configured_hook(destination, named)
        return _hook(destination, named)
    hook = _entry_point_hook(destination) if _entry_points() else None
    if hook is not None:
        return hook
    if destination in _entry_points():
        return None  # a user handler replaces the built-in of that name, without a hook
    return BUILTIN_VALIDATORS.get(destination)


def check_payload(destination: str, payload: Any, *, label: str,
                  handlers: Mapping[str, Any] | None = None) -> None:
    """Refuse ``payload`` if ``destination``'s handler can never deliver it.

    Args:
        label: names the message in the error (``outbox message 'key' to 'webhook'``).

    Raises:
        OutboxPayloadError: the validator refused the payload; the message names ``label``,
            the field when known and the fix (the validator's own exception is the cause).
    """
    validate = validator_for(destination, handlers)
    if validate is None:
        return
    try:
        validate(payload)
    except OutboxPayloadError as exc:
        where = f" field {exc.field!r}" if exc.field else ""
        raise OutboxPayloadError(f"{label}: refused, payload{where}: {exc.problem}",
                                 field=exc.field, destination=destination) from None
    except Exception as exc:  # a hook's ValueError, or its own bug on an odd payload
        raise OutboxPayloadError(
            f"{label}: refused by the handler's validate(): {exc}",
            destination=destination) from exc
