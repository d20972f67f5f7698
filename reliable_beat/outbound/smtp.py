"""The ``smtp`` outbox handler: an e-mail through the operator's SMTP server.

See :class:`SmtpHandler`; the server's configuration is :class:`reliable_beat.destinations.
SmtpConfig`.
"""

from __future__ import annotations

import contextlib
import os
import smtplib
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from email import errors as email_errors
from email import policy as email_policy
from email.message import EmailMessage
from email.utils import formatdate
from typing import Any
from urllib.parse import quote

from reliable_beat.destinations import SmtpConfig, _is_address
from reliable_beat.errors import DeliveryError, PermanentDeliveryError
from reliable_beat.messages import OutboxMessage
from reliable_beat.outbound.base import DestinationUnavailableError, Result, _chain, _short
from reliable_beat.redaction import get_logger

__all__ = [
    "SmtpHandler",
    "smtp_message_id",
]

#: The handlers' logger: records keep the name ``reliable_beat.handlers``.
log = get_logger("reliable_beat.handlers")


_MSGID_SAFE = "!#$%&'*+/=?^_`{|}~.-"
_MAX_RECIPIENTS = 100


def smtp_message_id(message_id: str) -> str:
    """The e-mail ``Message-ID`` of an outbox message: ``<escaped id@reliable-beat>``."""
    return f"<{quote(message_id, safe=_MSGID_SAFE)}@reliable-beat>"


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
