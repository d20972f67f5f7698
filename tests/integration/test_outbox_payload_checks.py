"""``outbox.add`` refuses, in the caller's transaction, a row its handler can never deliver.

A ``webhook`` row with the retired ``{"url": ...}`` form used to be accepted by
``outbox.add`` and dead-lettered by the relay on its first attempt: work lost after the
effect committed. Now every write path (``outbox.add``, ``IdempotentTask.outbox.add``,
Dramatiq's ``current().outbox.add``, the workflow engine's wakes) checks the payload against
its handler: the built-ins' shapes (running the handlers' own guards) and a user handler's
``validate(payload)`` hook (``reliable_beat_outbox_handlers`` or the entry point group).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import outbox, payloads
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox as outbox_t
from reliable_beat.errors import (
    ConfigurationError,
    OutboxPayloadError,
    PermanentDeliveryError,
    ReliableBeatError,
)
from reliable_beat.handlers import SmtpConfig, SmtpHandler, WebhookDestination, WebhookHandler
from reliable_beat.outbox import OutboxMessage

APPS = Path(__file__).resolve().parents[1] / "apps"
sys.path.insert(0, str(APPS))

RETIRED_WEBHOOK = {"url": "https://hooks.example.com/payouts", "body": {"id": 1}}


def destinations(store: Store) -> list[str]:
    with store.begin() as conn:
        return [r.message_id for r in conn.execute(sa.select(outbox_t.c.message_id))]


def test_add_refuses_the_retired_webhook_url_in_the_callers_transaction(store: Store) -> None:
    with store.begin() as conn:
        with pytest.raises(OutboxPayloadError) as caught:
            outbox.add(conn, "webhook", RETIRED_WEBHOOK, key="payout:1")
        # the caller's transaction is still usable: the next row (and the effect) commit
        outbox.add(conn, "webhook", {"destination": "billing", "path": "/payouts",
                                     "body": {"id": 1}}, key="payout:1:named")
    err = caught.value
    assert isinstance(err, ReliableBeatError) and isinstance(err, ValueError)
    assert err.field == "url" and err.destination == "webhook"
    text = str(err)
    assert "'payout:1'" in text and "'url'" in text and "'destination'" in text, text
    assert "reliable_beat_webhook_destinations" in text, text
    assert destinations(store) == ["payout:1:named"]


# (destination, payload, the field named): refused by outbox.add
REFUSED = [
    ("webhook", RETIRED_WEBHOOK, "url"),
    ("webhook", {"destination": "billing", "url": "/x", "body": {}}, "url"),
    ("webhook", {"destination": "billing", "path": "/x", "headers": {"A": "b"}}, "headers"),
    ("webhook", {"path": "/x", "body": {}}, "destination"),
    ("webhook", {"destination": "billing", "path": "x"}, "path"),
    ("webhook", {"destination": "billing", "path": "//evil.example/x"}, "path"),
    ("webhook", {"destination": "billing", "path": "/a/../admin"}, "path"),
    ("webhook", {"destination": "billing", "path": "/a/%2e%2e/admin"}, "path"),
    ("webhook", {"destination": "billing", "path": "/a b"}, "path"),
    ("webhook", {"destination": "billing", "path": "/x", "method": 7}, "method"),
    ("webhook", [1, 2], None),
    ("smtp", {"subject": "hi", "text": "t"}, "to"),
    ("smtp", {"to": "a@example.com", "text": "t"}, "subject"),
    ("smtp", {"to": "Ann <a@example.com>", "subject": "s", "text": "t"}, "to"),
    ("smtp", {"to": "a@example.com", "cc": ["x"], "subject": "s", "text": "t"}, "cc"),
    ("smtp", {"to": "a@example.com", "subject": "s\r\nBcc: x@evil.example", "text": "t"},
     "subject"),
    ("smtp", {"to": "a@example.com", "subject": "s", "text": 5}, "text"),
    ("smtp", {"to": "a@example.com", "subject": "s", "text": "t", "from": "nobody"}, "from"),
    ("celery", {"args": [1]}, "task"),
    ("celery", {"task": "t", "args": "12"}, "args"),
    ("celery", {"task": "t", "kwargs": [1]}, "kwargs"),
    ("celery", {"task": "t", "expires_at": "2026-01-01T02:00:00"}, "expires_at"),
    ("kombu", {"body": {}}, "routing_key"),
    ("kombu", {"routing_key": "q"}, "body"),
    ("dramatiq", {"args": [42]}, "actor"),
    ("dramatiq", {"actor": "send_invoice", "delay_ms": -1}, "delay_ms"),
]

ACCEPTED = [
    ("webhook", {"destination": "billing", "path": "/invoices/42", "body": {"id": 42}}),
    ("webhook", {"destination": "billing", "path": "/q?a=1&b=%2F", "method": "put"}),
    ("webhook", {"destination": "billing"}),  # path "/"; body null
    ("smtp", {"to": "a@example.com", "subject": "s", "text": "t"}),
    ("smtp", {"to": ["a@example.com"], "cc": "c@example.com", "subject": "s", "text": "t",
              "html": "<p>t</p>", "from": "noreply@example.com"}),
    ("celery", {"task": "shop.pay", "args": [1], "kwargs": {},
                "options": {"queue": "q"}, "expires_at": "2026-01-01T02:00:00Z"}),
    ("kombu", {"routing_key": "q", "body": {"a": 1}}),
    ("dramatiq", {"actor": "send_invoice", "args": [42]}),
    ("crm", {"anything": "goes"}),  # no handler known here: not checked
]


@pytest.mark.parametrize(("destination", "payload", "field"), REFUSED)
def test_builtin_checks_refuse_what_the_relay_would_dead_letter(
        destination: str, payload: Any, field: str | None) -> None:
    with pytest.raises(OutboxPayloadError) as caught:
        payloads.check_payload(destination, payload, label="m")
    assert caught.value.field == field, caught.value
    if field:
        assert repr(field) in str(caught.value)
    # ... and the relay's handler refuses it permanently too: the row could never go out
    message = OutboxMessage(id=1, message_id="m", destination=destination, payload=payload)
    if destination == "webhook":
        handler = WebhookHandler({"billing": WebhookDestination("billing", "http://h.example")})
        with pytest.raises(PermanentDeliveryError):
            handler._request_for(message)
    elif destination == "smtp":
        smtp = SmtpHandler(SmtpConfig(from_address="noreply@example.com",
                                      allowed_from=frozenset({"noreply@example.com"})))
        with pytest.raises(PermanentDeliveryError):
            smtp.build(message)


@pytest.mark.parametrize(("destination", "payload"), ACCEPTED)
def test_builtin_checks_accept_deliverable_rows(destination: str, payload: Any) -> None:
    payloads.check_payload(destination, payload, label="m")
    message = OutboxMessage(id=1, message_id="m", destination=destination, payload=payload)
    if destination == "webhook":
        handler = WebhookHandler({"billing": WebhookDestination(
            "billing", "http://h.example", methods=frozenset({"POST", "PUT"}))})
        handler._request_for(message)
    elif destination == "smtp":
        SmtpHandler(SmtpConfig(from_address="noreply@example.com",
                               allowed_from=frozenset({"noreply@example.com"}))).build(message)


def test_user_handler_validate_hook(sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    configured = {"crm": "crm_handler:CrmHandler", "plain": "crm_handler:NoHook"}
    with sqlite_store.begin() as conn:
        with pytest.raises(OutboxPayloadError, match=r"'crm'.*'customer': an integer id"):
            outbox.add(conn, "crm", {"customer": "acme"}, handlers=configured)
        outbox.add(conn, "crm", {"customer": 7}, key="crm:7", handlers=configured)
        outbox.add(conn, "plain", ["any", "thing"], key="plain:1", handlers=configured)
    assert sorted(destinations(sqlite_store)) == ["crm:7", "plain:1"]
    # a handler object (not a path) with a hook is used as well
    hook_obj = __import__("crm_handler").CrmHandler()
    with pytest.raises(OutboxPayloadError):
        payloads.check_payload("crm", {}, label="m", handlers={"crm": hook_obj})
    # a class whose validate needs an instance: named, with the fix
    with pytest.raises(ConfigurationError, match="staticmethod or classmethod"):
        payloads.check_payload("x", {}, label="m",
                               handlers={"x": "crm_handler:InstanceHook"})
    # an entry point handler's hook, found without settings; one replacing a built-in
    # without a hook turns the built-in check off for its name
    class EntryPoint:
        def __init__(self, name: str, obj: Any) -> None:
            self.name, self.value, self._obj = name, f"crm_handler:{name}", obj

        def load(self) -> Any:
            return self._obj

    crm = __import__("crm_handler")
    monkeypatch.setattr(payloads, "_entry_points", lambda: {
        "crm": EntryPoint("crm", crm.CrmHandler), "webhook": EntryPoint("webhook", crm.NoHook)})
    payloads._entry_point_hook.cache_clear()
    try:
        with pytest.raises(OutboxPayloadError):
            payloads.check_payload("crm", {"customer": None}, label="m")
        payloads.check_payload("webhook", RETIRED_WEBHOOK, label="m")
    finally:
        payloads._entry_point_hook.cache_clear()


@pytest.fixture
def app(sqlite_store: Store) -> Iterator[Celery]:
    app = Celery("payload_checks", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        reliable_beat_database_url=sqlite_store.engine.url.render_as_string(hide_password=False),
        reliable_beat_outbox_handlers={"crm": "crm_handler:CrmHandler"},
    )
    yield app


def test_idempotent_task_outbox_add_checks_builtins_and_configured_hooks(
        app: Celery, sqlite_store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="p.pay")
    def pay(self: IdempotentTask, destination: str, payload: Any) -> str:
        with self.transaction() as tx:
            return self.outbox.add(tx, destination, payload)

    for n, (destination, payload) in enumerate([("webhook", RETIRED_WEBHOOK),
                                                ("crm", {"customer": "acme"})]):
        result = pay.apply((destination, payload), headers={KEY_HEADER: f"bad:{n}"})
        with pytest.raises(OutboxPayloadError):
            result.get()
    assert pay.apply(("crm", {"customer": 3}), headers={KEY_HEADER: "good"}).get() == "good#1"
    assert destinations(sqlite_store) == ["good#1"]


dramatiq = pytest.importorskip("dramatiq")


def test_dramatiq_outbox_add_checks_builtins_and_configured_hooks(
        sqlite_url: str, sqlite_store: Store) -> None:
    from dramatiq.brokers.stub import StubBroker

    from reliable_beat.dramatiq import IdempotentActor, ReliableBeat, current

    broker = StubBroker()
    broker.add_middleware(ReliableBeat(settings={
        "database_url": sqlite_url, "retry_max_attempts": 1,
        "outbox_handlers": {"crm": "crm_handler:CrmHandler"}}))
    dramatiq.set_broker(broker)
    refused: list[str] = []

    @dramatiq.actor(actor_class=IdempotentActor)
    def notify(destination: str, payload: Any) -> None:
        rb = current()
        with rb.transaction() as tx:
            try:
                rb.outbox.add(tx, destination, payload)
            except OutboxPayloadError as exc:
                refused.append(str(exc.field))
                raise

    worker = dramatiq.Worker(broker, worker_timeout=50)
    worker.start()
    try:
        notify.send_with_key("d:1", "dramatiq", {"args": [42]})
        notify.send_with_key("d:2", "crm", {"customer": "acme"})
        notify.send_with_key("d:3", "dramatiq", {"actor": "send_invoice", "args": [42]})
        broker.join(notify.queue_name, fail_fast=False)
    finally:
        worker.stop()
        broker.close()
    assert sorted(refused) == ["None", "actor"]  # the hook raised ValueError: no field
    assert destinations(sqlite_store) == ["d:3#1"]
