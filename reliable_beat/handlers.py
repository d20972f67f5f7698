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

Here: the protocols, the registry (:func:`load_handlers`) and every public name. The errors
a handler raises to steer the relay are in :mod:`reliable_beat.outbound.base`, the built-in
handlers in :mod:`reliable_beat.outbound.webhook` and :mod:`reliable_beat.outbound.smtp`, the
destinations' configuration (:class:`WebhookDestination`, :class:`SmtpConfig`) in
:mod:`reliable_beat.destinations`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from reliable_beat.adapters import adapter_for
from reliable_beat.destinations import SmtpConfig, WebhookDestination, parse_webhook_destinations
from reliable_beat.errors import ConfigurationError
from reliable_beat.messages import OutboxMessage
from reliable_beat.outbound.base import DestinationUnavailableError, MessageExpiredError, Result
from reliable_beat.outbound.smtp import SmtpHandler, smtp_message_id
from reliable_beat.outbound.webhook import BlockedAddressError, WebhookHandler
from reliable_beat.redaction import get_logger
from reliable_beat.webhook_guard import blocked_reason

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
    "resolve_handler",
    "smtp_message_id",
]

log = get_logger(__name__)

#: Entry point group for user handlers: ``name = "package.module:attr"``.
ENTRY_POINT_GROUP = "reliable_beat.outbox_handlers"


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


#: Celery message-protocol headers (``task``, ``id``, ``eta``, ...): the message's own, never
#: taken from an entry's ``options["headers"]`` or a row's ``headers``.
CELERY_PROTOCOL_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps", "chord", "callbacks", "errbacks",
    "chain", "task_id", "content_type", "content_encoding", "correlation_id", "reply_to",
})


# --------------------------------------------------------------------------- registry


def resolve_handler(path: str) -> Any:
    """The object ``path`` names (``"package.module:attr"``, or ``"package.module.attr"``).

    Raises:
        ConfigurationError: the path has no module or attribute, or cannot be imported.
    """
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


#: The name :func:`resolve_handler` had before it was public.
_resolve = resolve_handler


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
        handlers.update(adapter_for(app).handlers(app))
    if importlib.util.find_spec("httpcore") is None:  # httpx missing
        configured_webhooks = sorted(getattr(settings, "webhook_destinations", None) or {})
        if configured_webhooks:
            # rows to them would wait `pending` with nothing said: say it where it is fixed
            log.error("webhook destinations %s are configured but httpx is not installed: "
                      "this process delivers no `webhook` outbox row (they stay pending); "
                      "install the extra: pip install 'reliable-beat[http]'",
                      ", ".join(map(repr, configured_webhooks)))
        else:
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
        handlers[name] = _instantiate(name, resolve_handler(path))
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
