"""SMTP through the operator's server only, with STARTTLS and AUTH, one bad row failing alone
(issues 12 and 13). The far end is a real aiosmtpd server offering STARTTLS (required) and
AUTH (only over TLS), with a throw-away certificate for 127.0.0.1."""

from __future__ import annotations

import socket
import ssl
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters
from reliable_beat.db.tables import outbox as outbox_t
from reliable_beat.errors import ConfigurationError
from reliable_beat.handlers import DestinationUnavailableError, SmtpHandler
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings

aiosmtpd_controller = pytest.importorskip("aiosmtpd.controller")
from aiosmtpd.smtp import AuthResult, LoginPassword  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))

from far_ends import DroppingSmtp, self_signed_cert  # noqa: E402
from sinks import SmtpSink  # noqa: E402
from unchecked_rows import unchecked  # noqa: E402


class Recorder:
    def __init__(self) -> None:
        self.mails: list[tuple[str, list[str], bytes, bool]] = []
        self.logins: list[str] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.mails.append((envelope.mail_from, list(envelope.rcpt_tos), envelope.content,
                           session.ssl is not None))
        return "250 OK"

    def authenticate(self, server: Any, session: Any, envelope: Any, mechanism: str,
                     auth_data: Any) -> AuthResult:
        assert isinstance(auth_data, LoginPassword)
        ok = (auth_data.login, auth_data.password) == (b"relay", b"s3cret-pw")
        self.logins.append(auth_data.login.decode())
        return AuthResult(success=ok, handled=False)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Any, Recorder, str]]:
    cert = self_signed_cert(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert.cert, cert.key)
    rec = Recorder()
    with socket.socket() as probe:  # aiosmtpd's Controller cannot take port 0
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctl = aiosmtpd_controller.Controller(
        rec, hostname="127.0.0.1", port=port, tls_context=context, require_starttls=True,
        authenticator=rec.authenticate, auth_require_tls=True, auth_required=True,
    )
    ctl.start()
    try:
        yield ctl, rec, str(cert.cert)
    finally:
        ctl.stop()


def config(ctl: Any, ca_file: str, **kw: Any) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": ctl.port, "ca_file": ca_file,
            "username": "relay", "password": {"env": "RB_TEST_SMTP_PASSWORD"},
            "from": "app@example.com", **kw}


def test_one_malformed_row_among_good_rows_fails_alone(
        sqlite_store: Store, server: tuple[Any, Recorder, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On main a CR/LF in `to` escaped deliver_batch: the good mails of the batch, already
    sent, were sent again on every retry (3 times) and then dead-lettered."""
    ctl, rec, ca = server
    monkeypatch.setenv("RB_TEST_SMTP_PASSWORD", "s3cret-pw")
    rows: list[tuple[str, dict[str, Any]]] = [
        ("good-1", {"to": ["a@example.com"], "subject": "one", "text": "1"}),
        ("crlf-to", {"to": "b@example.com\r\nBcc: spy@evil.example", "subject": "x",
                     "text": "x"}),
        ("good-2", {"to": "c@example.com", "cc": ["d@example.com"], "subject": "two",
                    "text": "2", "html": "<b>2</b>"}),
        ("crlf-subject", {"to": "e@example.com", "subject": "hi\r\nBcc: spy@evil.example"}),
        ("bad-from", {"from": "ceo@example.com", "to": "f@example.com", "subject": "x"}),
        ("no-to", {"subject": "x"}),
        ("good-3", {"to": "g@example.com", "subject": "three", "text": "3"}),
    ]
    with sqlite_store.begin() as conn, unchecked():  # outbox.add would refuse the bad ones
        for key, payload in rows:
            outbox.add(conn, "smtp", payload, key=key,
                       headers={"smtp_host": "10.1.2.3", "smtp_port": "x"})  # ignored
    settings = Settings(database_url="unused://", smtp=config(ctl, ca),
                        outbox_retry_base_seconds=0.05, outbox_retry_cap_seconds=0.1)
    relay = Relay(sqlite_store, settings=settings, owner="r")
    for _ in range(4):
        relay.run_once()
        time.sleep(0.2)
    with sqlite_store.begin() as conn:
        state = dict(conn.execute(sa.select(outbox_t.c.message_id, outbox_t.c.state)).all())
        errors = dict(conn.execute(sa.select(dead_letters.c.key, dead_letters.c.error)).all())
    assert state == {"good-1": "sent", "good-2": "sent", "good-3": "sent", "crlf-to": "dead",
                     "crlf-subject": "dead", "bad-from": "dead", "no-to": "dead"}
    assert sorted(rcpts[0] for _, rcpts, _, _ in rec.mails) == [
        "a@example.com", "c@example.com", "g@example.com"]  # each once, none re-sent
    assert all(tls for *_, tls in rec.mails) and rec.logins == ["relay"]  # STARTTLS + AUTH
    assert all(b"spy@evil" not in data for *_, data, _ in rec.mails)
    assert "invalid address" in errors["crlf-to"] and "'to'" in errors["crlf-to"]
    assert "allowed sender" in errors["bad-from"]
    assert "PermanentDeliveryError" in errors["crlf-subject"]


def test_no_plaintext_when_starttls_is_not_offered() -> None:
    """STARTTLS is on by default: a server without it gets nothing (main sent in clear)."""
    with SmtpSink() as sink:
        smtp = SmtpHandler({"host": "127.0.0.1", "port": sink.port, "from": "a@example.com"})
        results = smtp.deliver_batch([OutboxMessage(1, "m1", "smtp", {
            "to": "u@example.com", "subject": "s", "text": "t"})])
    assert sink.messages == []
    [err] = results
    assert isinstance(err, DestinationUnavailableError)  # backs off uncharged
    assert "does not offer STARTTLS" in str(err)


def test_wrong_password_sends_nothing(server: tuple[Any, Recorder, str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ctl, rec, ca = server
    monkeypatch.setenv("RB_TEST_SMTP_PASSWORD", "wrong")
    smtp = SmtpHandler(config(ctl, ca))
    results = smtp.deliver_batch([OutboxMessage(i, f"m{i}", "smtp", {
        "to": "u@example.com", "subject": "s"}) for i in range(2)])
    assert rec.mails == []
    assert Counter(type(r).__name__ for r in results) == Counter(
        {"DestinationUnavailableError": 2})
    assert "SMTPAuthenticationError" in str(results[0])


@pytest.mark.parametrize("raw, match", [
    ({"port": "x"}, "port"),
    ({"starttls": "yes"}, "starttls"),
    ({"username": "u", "starttls": False}, "only sent over TLS"),
    ({"hots": "typo"}, "unknown key 'hots'"),
    ({"from": "not an address"}, "from"),
])
def test_smtp_settings_are_checked(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Settings(smtp=raw)


def test_session_lost_midway_never_resends_accepted_mails(sqlite_store: Store) -> None:
    """The server accepts two mails then hangs up: those two are sent (never again), the
    rest are retried in a later session."""
    with DroppingSmtp(accept=2) as server:
        with sqlite_store.begin() as conn:
            for i in range(5):
                outbox.add(conn, "smtp", {"to": f"u{i}@example.com", "subject": f"s{i}"},
                           key=f"m{i}")
        settings = Settings(database_url="unused://", outbox_retry_base_seconds=0.05,
                            outbox_retry_cap_seconds=0.1, smtp={
                                "host": "127.0.0.1", "port": server.port, "starttls": False,
                                "from": "app@example.com"})
        relay = Relay(sqlite_store, settings=settings, owner="r")
        relay.run_once()
        with sqlite_store.begin() as conn:
            first = dict(conn.execute(sa.select(outbox_t.c.message_id, outbox_t.c.state)).all())
        for _ in range(6):
            time.sleep(0.2)
            relay.run_once()
        with sqlite_store.begin() as conn:
            final = Counter(conn.execute(sa.select(outbox_t.c.state)).scalars())
    assert first == {"m0": "sent", "m1": "sent", "m2": "pending", "m3": "pending",
                     "m4": "pending"}
    subjects = [line for data in server.received for line in data.split(b"\r\n")
                if line.startswith(b"Subject:")]
    assert sorted(subjects) == [b"Subject: s0", b"Subject: s1", b"Subject: s2",
                                b"Subject: s3", b"Subject: s4"]  # each exactly once
    assert final == Counter({"sent": 5})
