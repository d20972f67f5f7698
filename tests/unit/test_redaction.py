"""reliable_beat.redaction: one function decides what of a URL / header / error text is shown."""

from __future__ import annotations

import logging
import traceback

import pytest

from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError
from reliable_beat.redaction import (
    MASK,
    RedactingFilter,
    redact_headers,
    redact_text,
    redact_url,
    redact_value,
)
from reliable_beat.settings import Settings

SECRET = "S3cr3tLEAK"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"postgresql+psycopg://app:{SECRET}@db:5432/x", "postgresql+psycopg://app:***@db:5432/x"),
        (f"postgresql+psycopg://app@db/x?password={SECRET}&sslmode=require",
         "postgresql+psycopg://app@db/x?password=***&sslmode=require"),
        (f"redis://host:6379/0?password={SECRET}", "redis://host:6379/0?password=***"),
        (f"redis://:{SECRET}@host:6379/0", "redis://:***@host:6379/0"),
        # an unescaped '@' in the password: the host is after the last '@'
        (f"redis://u:ab@{SECRET}@host:6379/0", "redis://u:***@host:6379/0"),
        (f"postgresql://u:pa/ss?{SECRET}@h/db", "postgresql://u:***@h/db"),
        (f"https://hooks.slack.com/services/T0/B0/{SECRET}", "https://hooks.slack.com/***"),
        (f"https://acme.webhook.office.com/webhookb2/{SECRET}", "https://acme.webhook.office.com/***"),
        (f"https://discord.com/api/webhooks/1/{SECRET}", "https://discord.com/***"),
        (f"https://example.com/hook/{SECRET}0123456789?token={SECRET}&x=1#{SECRET}",
         "https://example.com/hook/***?token=***&x=1"),
        (f"https://example.com/x?key={SECRET}&sig={SECRET}&api_key={SECRET}",
         "https://example.com/x?key=***&sig=***&api_key=***"),
        (f"https://user:{SECRET}@example.com/path", "https://user:***@example.com/path"),
        ("sqlite:///tmp/rb.sqlite3", "sqlite:///tmp/rb.sqlite3"),
        ("https://example.com/orders/42", "https://example.com/orders/42"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert SECRET not in redact_url(url)


@pytest.mark.parametrize(
    "url",
    [f"redis://u:{SECRET}@host:notaport/0", f"post gres://u:{SECRET}@h/db", f"{SECRET}",
     f"http://[{SECRET}", f"mailto:{SECRET}@example.com", "", "://", "redis://@"],
)
def test_malformed_urls_never_echo_a_fragment_and_never_raise(url: str) -> None:
    assert SECRET not in redact_url(url)
    assert redact_url(None) == "<unparseable URL>"


def test_headers_and_json_values() -> None:
    headers = {"Authorization": f"Bearer {SECRET}", "Cookie": SECRET, "X-Api-Key": SECRET,
               "X-Auth-Token": SECRET, "Idempotency-Key": "k1", "Content-Type": "json"}
    shown = redact_headers(headers)
    assert shown == {"Authorization": MASK, "Cookie": MASK, "X-Api-Key": MASK,
                     "X-Auth-Token": MASK, "Idempotency-Key": "k1", "Content-Type": "json"}
    value = {"payload": {"url": f"https://hooks.slack.com/services/{SECRET}", "headers": headers,
                         "smtp_password": SECRET, "body": {"text": "hi"}},
             "key": "entry@2026-01-01T00:00:00Z", "fence_token": 3,
             "error": f"webhook https://u:{SECRET}@h/x answered HTTP 500"}
    shown_value = redact_value(value)
    assert SECRET not in repr(shown_value)
    # work identifiers stay visible: they are not secrets and operators need them
    assert shown_value["key"] == value["key"]
    assert shown_value["fence_token"] == 3
    assert shown_value["payload"]["body"] == {"text": "hi"}


def test_free_text() -> None:
    text = (f"connection failed: host=db password={SECRET} user=u; see "
            f"postgresql://u:{SECRET}@db/x?password={SECRET}. ok")
    shown = redact_text(text)
    assert SECRET not in shown
    assert "host=db" in shown and "user=u" in shown


def test_log_filter_redacts_message_args_and_traceback(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.redaction.filter")
    logger.addFilter(RedactingFilter())
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        try:
            raise ValueError(f"webhook https://hooks.slack.com/services/{SECRET} failed")
        except ValueError as exc:
            logger.exception("delivery to %s failed: %s",
                             f"https://x.example/?token={SECRET}", exc)
    text = caplog.text + "".join(r.exc_text or "" for r in caplog.records)
    assert "delivery to" in text and "Traceback" in text
    assert SECRET not in text
    # the template is kept (log aggregators group by it); only the arguments were redacted
    assert caplog.records[0].msg == "delivery to %s failed: %s"


def test_store_and_settings_reprs_hide_the_url(tmp_path: object) -> None:
    url = f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/x?password={SECRET}"
    store = Store.from_url(url)
    settings = Settings(database_url=url)
    beat = Beat(store, owner="test")
    for shown in (repr(store), repr(settings), str(store), str(settings), repr(beat)):
        assert SECRET not in shown
    assert "127.0.0.1:1" in repr(store)
    store.dispose()


def test_malformed_store_url_error_and_traceback_quote_nothing() -> None:
    url = f"postgresql+psycopg://u:ab@{SECRET}:notaport@host/db"
    with pytest.raises(ConfigurationError) as info:
        Store.from_url(url)
    rendered = "".join(traceback.format_exception(info.value))
    assert "port is not a number" in str(info.value)
    assert SECRET not in rendered


@pytest.mark.parametrize(
    ("url", "error"),
    [(f"redis://u:ab@{SECRET}@127.0.0.1:notaport/0", "ConfigurationError"),
     (f"redis://:{SECRET}@127.0.0.1:1/0?password={SECRET}", "StoreUnavailableError")],
)
def test_redbeat_importer_errors_quote_no_secret(url: str, error: str) -> None:
    pytest.importorskip("redbeat")
    from reliable_beat.celery.importers import read_redbeat

    with pytest.raises(Exception) as info:
        read_redbeat(url)
    assert type(info.value).__name__ == error
    assert SECRET not in "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize(("text", "shown"), [
    ("fence token 1 is stale", "fence token 1 is stale"),
    ("fence token 12 is stale (current 13)", "fence token 12 is stale (current 13)"),
    ("the token is stale", "the token is stale"),
    ("postgresql://u:pw@h/db?application_name=fu: inserted 4",
     "postgresql://u:***@h/db?application_name=fu: inserted 4"),
    ("see https://example.com/x?a=b.", "see https://example.com/x?a=b."),
    ("(see https://example.com/x?a=b)", "(see https://example.com/x?a=b)"),
])
def test_free_text_does_not_over_mask(text: str, shown: str) -> None:
    assert redact_text(text) == shown


@pytest.mark.parametrize("text", [
    f"Authorization: Token {SECRET}", f"token {SECRET}", f"Bearer {SECRET}",
    f"Basic {SECRET}", f"failed: postgresql://u:{SECRET}@h/db?password={SECRET}: boom",
    f"see https://example.com/x?token={SECRET}.",
])
def test_free_text_still_masks_credentials(text: str) -> None:
    assert SECRET not in redact_text(text)


@pytest.mark.parametrize(("text", "shown"), [
    # a non-determinism message: the digests are hashes of arguments, not HTTP Digest
    # credentials, and the closing brackets are the prose's
    ("seq 2: code did timer sleep 40s (args digest 988d5608d86d6f42), history has "
     "timer sleep 30s (args digest 0a8d5608d86d6f4b)",
     "seq 2: code did timer sleep 40s (args digest 988d5608d86d6f42), history has "
     "timer sleep 30s (args digest 0a8d5608d86d6f4b)"),
    ("call digest 3f2a9c0e1b7d4f5a6c8e9d0b1a2c3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d",
     "call digest 3f2a9c0e1b7d4f5a6c8e9d0b1a2c3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d"),
    (f"(Bearer {SECRET})", "(Bearer ***)"),
])
def test_hex_digests_are_shown_and_brackets_kept(text: str, shown: str) -> None:
    assert redact_text(text) == shown


@pytest.mark.parametrize("text", [
    f"Digest {SECRET}", f"digest {SECRET}xyz",
])
def test_http_digest_credentials_still_masked(text: str) -> None:
    assert SECRET not in redact_text(text)


@pytest.mark.parametrize("text", [
    'Authorization: Digest username="u", realm="r", nonce="n1", uri="/", response="{r}"',
    "headers={{'Authorization': 'Digest username=\"u\", response={r}, qop=auth'}}",
    "digest auth failed: Digest username=u response = '{r}'",
])
def test_the_response_of_an_http_digest_credential_is_masked(text: str) -> None:
    """The ``response`` of an HTTP Digest credential proves the password (replayable within
    its nonce). Fails on the old code: the scheme rule masked only the word after Digest."""
    response = "6629fae49393a05397450978507c4ef1"
    out = redact_text(text.format(r=response))
    assert response not in out and "***" in out, out
    # a quoted header value is masked whole after its scheme
    assert ("response" in out) != ("'Digest ***'" in out), out


def test_a_response_without_a_digest_credential_is_left_alone() -> None:
    assert redact_text("webhook response=200 after 3 tries") == (
        "webhook response=200 after 3 tries")


@pytest.mark.parametrize("text", [
    "PermanentError: api_key=sk_live_ADMINKEY999 refused",
    "error: password=hunter2x",
    "ValueError: client_secret=abc123def456",
])
def test_a_secret_pair_after_an_exception_name_is_masked(text: str) -> None:
    """``Name: secret_name=value``: the pair regex matched ``Name: ...`` first and swallowed
    the secret pair (the old code left it in clear, in the CLI's ``runs show`` and the
    admin alike)."""
    out = redact_text(text)
    secret = text.rsplit("=", 1)[1].split()[0]
    assert secret not in out and MASK in out, out


@pytest.mark.parametrize(("text", "secret"), [
    ("ValueError: token: abc123", "abc123"),
    ("failed: password: hunter2 x", "hunter2"),
    ("refused: reason: api_key: sk_live_Q7 (revoked)", "sk_live_Q7"),
    ("time: 12:30:00 token=t0k3n", "t0k3n"),
])
def test_a_colon_pair_after_harmless_names_is_masked(text: str, secret: str) -> None:
    """``Name: secret_name: value``: the harmless first pair's value ran to ``token:`` and the
    scan went on after it, so the secret stayed in clear (the old code: two of these four).
    The scan now goes on from a harmless name's separator."""
    out = redact_text(text)
    assert secret not in out and MASK in out, out


# ---------------------------------------------------------------- credential names, all forms

#: (name, how it is written) -> texts with the secret in every form a message carries it
_FORMS = [
    "{n}={s}", "{n}: {s}", "{n} = {s}", '"{n}": "{s}"', "'{n}': '{s}'", "{n}='{s}'",
    '{n}="{s}"', "error: {n}={s} (refused)", "https://api.example.com/v1?{n}={s}&x=1",
    "GET /v1/pay?a=1&{n}={s} HTTP/1.1", "?{n}={s}", "{{'headers': {{'{n}': '{s}'}}}}",
]
_NAMES = [
    "key", "Key", "KEY", "apikey", "api_key", "api-key", "X-Api-Key", "secret", "auth",
    "authorization", "credential", "credentials", "signature", "sig", "private_key",
    "access_token", "client_secret", "session", "sessionid", "cookie", "password", "token",
    "refresh_token", "secret_key", "AWS_SECRET_ACCESS_KEY", "x-auth-token",
]


@pytest.mark.parametrize("name", _NAMES)
@pytest.mark.parametrize("form", _FORMS)
def test_every_credential_name_in_every_form_is_masked(name: str, form: str) -> None:
    """Fails on the old code for ``key`` (in free text) and every quoted (JSON, dict) form."""
    text = form.format(n=name, s=SECRET)
    out = redact_text(text)
    assert SECRET not in out and MASK in out, (text, out)


@pytest.mark.parametrize(("text", "shown"), [
    ('password="my secret phrase" user=u', 'password="***" user=u'),  # a quoted value, whole
    ('{"token": "a\\"b c", "n": 1}', '{"token": "***", "n": 1}'),
    ("Cookie: sid=abc; uid=xyz\nnext line", "Cookie: ***\nnext line"),  # every cookie
    ("{'Cookie': 'sid=abc; uid=xyz'}", "{'Cookie': '***'}"),
    ("Authorization: Token abc", "Authorization: Token ***"),  # short: only the scheme rule
    (f"Authorization: Bearer {SECRET}", "Authorization: Bearer ***"),
    (f"authorization: Basic {SECRET}", "authorization: Basic ***"),
    ('{"auth": {"token": "t1"}, "n": 2}', '{"auth": {"token": "***"}, "n": 2}'),  # nested
    (f"ftp://u:{SECRET}@h/x", "ftp://u:***@h/x"),
    (f"API key: {SECRET}", "API key: ***"),
    (f"ValueError: key={SECRET}", "ValueError: key=***"),
])
def test_credential_values_are_masked_whole(text: str, shown: str) -> None:
    assert redact_text(text) == shown


@pytest.mark.parametrize("text", [
    # our own words: an idempotency key is not a secret, and messages that name one stay
    "idempotency key: payout:m1:2026-01 was used for another call",
    "Idempotency-Key: trigger:e@2026-01-01T00:00:00Z",
    "idempotency_key=payout:m1",
    "INSERT IGNORE downgraded an error other than a duplicate key: (1062) Duplicate entry",
    "ordering key: customer-42", "routing key: celery", "dedup key: approval:42",
    "KeyError: 'amount'", "key 'x' not found", "under key 'payout:m1' (message 7)",
    "primary key: (42)", "the public key: ssh-ed25519 AAAA", "keys=3",
    "author=ann", "fence token 12 is stale (current 13)",
])
def test_harmless_keys_and_words_are_shown(text: str) -> None:
    assert redact_text(text) == text


def test_structured_values_keep_our_key_and_mask_an_applications() -> None:
    """A bare ``key`` in our own documents is the idempotency key (shown); under ``args`` /
    ``kwargs`` (a task's arguments) it names a credential, as in free text."""
    row = {"key": "payout:m1", "kwargs": {"key": SECRET, "api_key": SECRET, "n": 1,
                                          "nested": {"key": SECRET}},
           "args": [{"key": SECRET}, "plain", f"key={SECRET}"],
           "payload": {"key": "trigger:e@2026"}}
    shown = redact_value(row)
    assert SECRET not in repr(shown)
    assert shown["key"] == "payout:m1" and shown["payload"] == {"key": "trigger:e@2026"}
    assert shown["kwargs"] == {"key": MASK, "api_key": MASK, "n": 1, "nested": {"key": MASK}}
    assert shown["args"] == [{"key": MASK}, "plain", "key=***"]
    assert redact_value({"key": SECRET}, user_data=True) == {"key": MASK}


def test_celery_and_dramatiq_loggers_are_filtered() -> None:
    """Celery's worker logs a task's exception (and, in ``extra``, its arguments) and at
    DEBUG the message body; Dramatiq's worker thread logs ``actor(args, kwargs)``."""
    from reliable_beat.redaction import THIRD_PARTY_LOGGERS

    for name in ("celery.app.trace", "celery.worker.strategy", "celery.worker.request",
                 "celery.pool", "dramatiq.worker.WorkerThread"):
        assert name in THIRD_PARTY_LOGGERS
        assert any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters)


def test_the_filter_redacts_celerys_extra_data(caplog: pytest.LogCaptureFixture) -> None:
    """Celery logs a failure as ``logger.log(level, fmt, context, extra={'data': context})``:
    the message and the ``data`` a JSON log handler prints are both redacted."""
    logger = logging.getLogger("celery.app.trace")
    context = {"name": "t", "id": "1", "description": "raised unexpected",
               "exc": f"ValueError('key={SECRET}')", "args": "()",
               "kwargs": f"{{'api_key': '{SECRET}'}}"}
    with caplog.at_level(logging.ERROR, logger=logger.name):
        logger.log(logging.ERROR, "Task %(name)s[%(id)s] %(description)s: %(exc)s", context,
                   extra={"data": context})
    [record] = caplog.records
    assert record.getMessage() == "Task t[1] raised unexpected: ValueError('key=***')"
    assert SECRET not in repr(record.__dict__["data"])


def test_a_real_dramatiq_worker_logs_no_keyword_secret(caplog: pytest.LogCaptureFixture) -> None:
    """Dramatiq's worker logs a failed message as ``actor('arg', api_key='...')`` with the
    traceback: keyword arguments with credential names are masked, as is the exception."""
    dramatiq = pytest.importorskip("dramatiq")
    from dramatiq.brokers.stub import StubBroker

    broker = StubBroker()
    broker.emit_after("process_boot")

    @dramatiq.actor(broker=broker, max_retries=0, actor_name="leaky_charge")
    def leaky_charge(customer: str, api_key: str) -> None:
        raise ValueError(f"refused: api_key={api_key}")

    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="dramatiq"):
            leaky_charge.send("c-1", api_key=SECRET)
            broker.join(leaky_charge.queue_name, fail_fast=False)
            worker.join()
    finally:
        worker.stop()
        broker.close()
    text = caplog.text + "".join(r.exc_text or "" for r in caplog.records)
    assert "Failed to process message leaky_charge('c-1', api_key=" in text, text
    assert SECRET not in text, text


@pytest.mark.parametrize("key", ["session:42:close", "password-reset:u1:2026-03",
                                 "token-refresh:7", "wf:api_key-rotation:1"])
def test_our_identifiers_are_shown_whole(key: str) -> None:
    """An idempotency key that reads like a pair (``session:42``) is ours, not a secret: shown
    whole in JSON identifier fields and inside a sentence after a colon-joined part. (The
    old code showed ``session:***`` in ``runs show --json`` and the dead letters.)"""
    row = {"idempotency_key": key, "key": key, "run_key": key, "message_id": key,
           "workflow_id": key, "payload": {"key": key}}
    assert redact_value(row) == row
    assert redact_text(f"(idempotency key: wf:{key})") == f"(idempotency key: wf:{key})"
