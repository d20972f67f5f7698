"""The relay against real far ends: Redis (stopped and restarted), two relays racing on
PostgreSQL and on MariaDB, a poison row, ordering keys, a local HTTP server and a local SMTP
sink."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from harness.servers import RedisServer
from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters
from reliable_beat.db.tables import outbox as outbox_t
from reliable_beat.errors import DeliveryError
from reliable_beat.handlers import (
    CeleryHandler,
    KombuHandler,
    SmtpHandler,
    WebhookHandler,
    smtp_message_id,
)
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))

import redis_queue
from sinks import HttpRecorder, SmtpSink

FAST = Settings(database_url="unused://", outbox_retry_base_seconds=0.05,
                outbox_retry_cap_seconds=0.5, outbox_max_attempts=4, relay_poll_seconds=0.1)


def states(store: Store) -> Counter[str]:
    with store.begin() as conn:
        return Counter(conn.execute(sa.select(outbox_t.c.state)).scalars())


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Running:
    """Relays in threads, stopped on exit."""

    def __init__(self, *relays: Relay) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=r.run_forever, args=(self.stop,), daemon=True)
                        for r in relays]

    def __enter__(self) -> Running:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def add_celery_rows(store: Store, n: int, prefix: str = "m") -> list[str]:
    with store.begin() as conn:
        return [outbox.add(conn, "celery", {"task": "t", "args": [i]}, key=f"{prefix}{i}")
                for i in range(n)]


def test_redis_outage_rows_accumulate_then_all_delivered(server_store: Store) -> None:
    server = RedisServer()
    server.start()
    app = Celery("outage", broker=server.url)
    app.conf.broker_connection_timeout = 1
    try:
        relay = Relay(server_store, handlers={"celery": CeleryHandler(app)}, settings=FAST,
                      owner="r1", batch_size=50)
        with Running(relay):
            add_celery_rows(server_store, 10, "before")
            wait_for(lambda: states(server_store)["sent"] == 10, 20, "the first rows")
            server.stop()
            ids = add_celery_rows(server_store, 200, "during")
            time.sleep(3)  # the relay keeps trying against a dead broker
            assert states(server_store) == Counter({"pending": 200, "sent": 10})  # accumulate
            with server_store.begin() as conn:
                attempts = conn.execute(sa.select(sa.func.max(outbox_t.c.attempts))
                                        .where(outbox_t.c.state == "pending")).scalar_one()
            assert attempts <= 1  # an outage is not charged to the rows (0 or one in flight)
            server.start()  # same port
            wait_for(lambda: states(server_store)["sent"] == 210, 60, "delivery after the outage")
        published = redis_queue.message_ids(server.url)
        assert set(ids) <= set(published)  # none lost
        assert Counter(published).most_common(1)[0][1] == 1  # and nothing published twice
        with server_store.begin() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 0
    finally:
        app.close()
        server.stop()


def test_two_relays_1000_rows_no_duplicates_from_claim(server_store: Store, server_url: str,
                                                       redis_url: str) -> None:
    redis_queue.flush(redis_url)
    ids = add_celery_rows(server_store, 1000)
    app = Celery("two", broker=redis_url)
    store2 = Store.from_url(server_url, role="relay")
    relays = [
        Relay(server_store, handlers={"celery": CeleryHandler(app)}, settings=FAST, owner="r1",
              batch_size=37),
        Relay(store2, handlers={"celery": CeleryHandler(app)}, settings=FAST, owner="r2",
              batch_size=37),
    ]
    try:
        with Running(*relays):
            wait_for(lambda: states(server_store)["sent"] == 1000, 120, "1000 rows sent")
    finally:
        app.close()
        store2.dispose()
    per_row = Counter(redis_queue.message_ids(redis_url))
    assert set(per_row) == set(ids)  # every row delivered
    assert max(per_row.values()) == 1  # no duplicates (no crash in this test)
    with server_store.begin() as conn:
        by_owner = conn.execute(sa.select(sa.func.count()).select_from(outbox_t)
                                .where(outbox_t.c.attempts != 1)).scalar()
    assert by_owner == 0


def test_poison_row_dead_lettered_others_delivered(server_store: Store) -> None:
    delivered: list[str] = []

    def handler(m: OutboxMessage) -> None:
        if m.message_id == "poison":
            raise DeliveryError("always fails")
        delivered.append(m.message_id)

    with server_store.begin() as conn:
        outbox.add(conn, "rec", {}, key="poison")
        for i in range(100):
            outbox.add(conn, "rec", {"i": i}, key=f"ok{i}")
    relay = Relay(server_store, handlers={"rec": handler}, settings=FAST, owner="r")
    assert relay.run_once() == 101  # one batch: the 100 go out on the first pass
    assert len(delivered) == 100 and states(server_store)["sent"] == 100
    with Running(relay):
        wait_for(lambda: states(server_store)["dead"] == 1, 30, "the poison row to die")
    with server_store.begin() as conn:
        dl = conn.execute(sa.select(dead_letters)).one()
    assert (dl.key, dl.reason, dl.attempts) == ("poison", "exhausted", FAST.outbox_max_attempts)
    assert len(delivered) == 100


def test_ordering_key_respected_under_two_relays(server_store: Store, server_url: str) -> None:
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()
    failed_once: set[str] = set()
    rng = random.Random(7)

    def handler(m: OutboxMessage) -> None:
        time.sleep(rng.random() * 0.003)
        with lock:
            if m.payload["seq"] % 7 == 3 and m.message_id not in failed_once:
                failed_once.add(m.message_id)
                raise DeliveryError("first attempt of every 7th row fails")
            seen.append((m.ordering_key or "", m.payload["seq"]))

    keys = ["A", "B", "C", "D"]
    with server_store.begin() as conn:
        for seq in range(30):
            for k in keys:
                outbox.add(conn, "rec", {"seq": seq}, key=f"{k}{seq}", ordering_key=k)
    store2 = Store.from_url(server_url, role="relay")
    relays = [Relay(s, handlers={"rec": handler}, settings=FAST, owner=o, batch_size=3)
              for s, o in ((server_store, "r1"), (store2, "r2"))]
    try:
        with Running(*relays):
            wait_for(lambda: states(server_store)["sent"] == 120, 60, "120 rows sent")
    finally:
        store2.dispose()
    for k in keys:
        assert [seq for key, seq in seen if key == k] == list(range(30)), k


def test_webhook_idempotency_key_retry_and_permanent(server_store: Store) -> None:
    with HttpRecorder() as http:
        http.statuses = {"/flaky": [503, 429], "/bad": [400]}
        with server_store.begin() as conn:
            ok = outbox.add(conn, "webhook", {"destination": "far", "path": "/ok",
                                              "body": {"a": 1}}, key="payout:42:email")
            flaky = outbox.add(conn, "webhook", {"destination": "far", "path": "/flaky",
                                                 "body": {}})
            bad = outbox.add(conn, "webhook", {"destination": "far", "path": "/bad", "body": {}})
        hook = WebhookHandler(settings=Settings(webhook_destinations={
            "far": {"base_url": http.url}}))
        relay = Relay(server_store, handlers={"webhook": hook}, settings=FAST, owner="r")
        with Running(relay):
            wait_for(lambda: states(server_store) == Counter({"sent": 2, "dead": 1}), 30, "settled")
        hook.close()
    by_path: dict[str, list[str]] = {}
    for req in http.requests:
        by_path.setdefault(req.path, []).append(req.headers["Idempotency-Key"])
    assert by_path["/ok"] == [ok] and http.requests[0].body in ({"a": 1}, {})
    assert by_path["/flaky"] == [flaky] * 3  # 503, 429, 200: same key every time
    assert by_path["/bad"] == [bad]  # 400: permanent, dead-lettered at once
    with server_store.begin() as conn:
        assert conn.execute(sa.select(dead_letters.c.key, dead_letters.c.reason)).one() == (
            bad, "permanent")


def test_smtp_message_id(server_store: Store) -> None:
    with SmtpSink() as sink:
        with server_store.begin() as conn:
            for i in range(3):
                outbox.add(conn, "smtp", {"from": "app@example.com", "to": ["u@example.com"],
                                          "subject": f"payout {i}", "text": "paid"},
                           key=f"payout:{i}:mail")
        smtp = SmtpHandler({"host": "127.0.0.1", "port": sink.port, "starttls": False,
                            "from": "app@example.com"})
        relay = Relay(server_store, handlers={"smtp": smtp}, settings=FAST, owner="r")
        relay.run_once()
    assert states(server_store) == Counter({"sent": 3})
    # ':' is not RFC 5322 atext, so it is %-escaped; the mapping is stable
    assert sorted(m["Message-ID"] for m in sink.messages) == [
        "<payout%3A0%3Amail@reliable-beat>", "<payout%3A1%3Amail@reliable-beat>",
        "<payout%3A2%3Amail@reliable-beat>"]
    assert smtp_message_id("a b<c>") == "<a%20b%3Cc%3E@reliable-beat>"
    assert sink.envelopes[0] == ("app@example.com", ["u@example.com"])


@pytest.mark.parametrize("use_app", [True, False])
def test_kombu_raw_publish(server_store: Store, redis_url: str, use_app: bool) -> None:
    redis_queue.flush(redis_url)
    app = Celery("raw", broker=redis_url)
    handler = KombuHandler(app) if use_app else KombuHandler(url=redis_url)
    with server_store.begin() as conn:
        for i in range(3):
            outbox.add(conn, "kombu", {"routing_key": "events", "body": {"i": i}}, key=f"ev{i}")
    Relay(server_store, handlers={"kombu": handler}, settings=FAST, owner="r").run_once()
    app.close()
    got = redis_queue.queued(redis_url, "events")
    assert [m["properties"].get("message_id") or m["headers"]["reliable_beat_message_id"]
            for m in got] == ["ev0", "ev1", "ev2"]
    assert states(server_store) == Counter({"sent": 3})
