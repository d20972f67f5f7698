"""A trigger's fire time without a zone is UTC, in both adapters, whatever the host's zone.

Every writer of a trigger writes ``2026-01-10T10:05:00Z`` (``slots.format_fire_at``), but a
value that lost its ``Z`` (hand-made, another tool) was read three ways: the Dramatiq actor
and publisher read it as the host's local time (a run recorded hours off its slot), the
Celery task refused the message. One parser now, ``slots.parse_fire_at``: no zone is UTC.

The host zone is set for the test (``TZ`` + ``time.tzset``: a POSIX rule, no tz database
needed) and restored after. Real SQLite store; Dramatiq's ``StubBroker`` with a real
``Worker``; Celery's eager ``apply``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.slots import parse_fire_at

SLOT = datetime(2026, 1, 10, 10, 5, tzinfo=timezone.utc)
KEY = "nightly@2026-01-10T10:05:00Z"
ZONELESS = "2026-01-10T10:05:00"


@pytest.fixture
def host_in_tokyo() -> Iterator[None]:
    """The process's local zone is UTC+9 (no DST) for the test."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "JST-9"
    time.tzset()
    try:
        assert datetime(2026, 1, 10, 10, 5).astimezone().utcoffset().total_seconds() == 9 * 3600
        yield
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()


@pytest.mark.parametrize(("value", "expected"), [
    ("2026-01-10T10:05:00Z", SLOT),
    ("2026-01-10T11:05:00+01:00", SLOT),
    (ZONELESS, SLOT),
    ("2026-01-10T10:05:00.250000", SLOT.replace(microsecond=250000)),
    (SLOT, SLOT),
    (datetime(2026, 1, 10, 10, 5), SLOT),
    (None, None),
    ("", None),
])
def test_the_rule(host_in_tokyo: None, value: Any, expected: datetime | None) -> None:
    got = parse_fire_at(value)
    assert got == expected
    assert got is None or got.tzinfo is timezone.utc


@pytest.mark.parametrize("value", ["tomorrow", "2026-13-01T00:00:00Z", 1736503500, ["x"],
                                   "0001-01-01T00:00:00+05:00"])
def test_a_malformed_instant_is_named(value: Any) -> None:
    with pytest.raises(ValueError, match=r"reliable_beat_fire_at=") as got:
        parse_fire_at(value, "reliable_beat_fire_at")
    assert repr(value) in str(got.value)


def test_a_dramatiq_message_without_a_zone_records_the_utc_slot(
        host_in_tokyo: None, sqlite_url: str, sqlite_store: Store) -> None:
    dramatiq = pytest.importorskip("dramatiq")
    from dramatiq.brokers.stub import StubBroker

    from reliable_beat.dramatiq import OPTION, IdempotentActor, ReliableBeat

    broker = StubBroker()
    broker.add_middleware(ReliableBeat(settings={"database_url": sqlite_url}))
    dramatiq.set_broker(broker)
    worker = dramatiq.Worker(broker, worker_timeout=50)
    worker.start()
    try:
        @dramatiq.actor(actor_class=IdempotentActor, actor_name="nightly", broker=broker)
        def nightly() -> None: ...

        nightly.send_with_options(**{OPTION: {"key": KEY, "entry": "nightly",
                                              "fire_at": ZONELESS, "trigger": "schedule"}})
        broker.join(nightly.queue_name, fail_fast=True)
    finally:
        worker.stop()
        broker.close()
    run = runs.get_run(sqlite_store, KEY)
    assert run is not None and run["state"] == "succeeded"
    assert run["fire_at"] == SLOT  # not 01:05 UTC (10:05 in Tokyo)


def test_a_dramatiq_trigger_without_a_zone_is_timed_from_the_utc_slot(
        host_in_tokyo: None, sqlite_url: str) -> None:
    pytest.importorskip("dramatiq")
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from reliable_beat.beat import build_trigger_payload
    from reliable_beat.dramatiq import IdempotentActor, ReliableBeat, message_for_trigger

    broker = StubBroker()
    broker.add_middleware(ReliableBeat(settings={"database_url": sqlite_url}))

    @dramatiq.actor(actor_class=IdempotentActor, actor_name="nightly", broker=broker)
    def nightly() -> None: ...

    payload = build_trigger_payload(
        task="nightly", args=[], kwargs={}, options={"expires": 60}, key=KEY, entry="nightly",
        fire_at=SLOT, trigger="schedule", destination="dramatiq")
    payload["reliable_beat"]["fire_at"] = ZONELESS
    payload["expires_at"] = "2026-01-10T10:06:00"
    message = message_for_trigger(broker, payload)
    assert message.message_timestamp == int(SLOT.timestamp() * 1000)
    assert message.options["max_age"] == 60_000


def test_a_celery_header_without_a_zone_records_the_utc_slot(
        host_in_tokyo: None, sqlite_url: str, sqlite_store: Store) -> None:
    celery = pytest.importorskip("celery")
    from reliable_beat.celery.task import (
        ENTRY_HEADER,
        FIRE_AT_HEADER,
        KEY_HEADER,
        IdempotentTask,
    )

    app = celery.Celery("zoneless", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_database_url=sqlite_url)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="nightly")
    def nightly(self: IdempotentTask) -> str:
        return "ran"

    result = nightly.apply(headers={KEY_HEADER: KEY, ENTRY_HEADER: "nightly",
                                    FIRE_AT_HEADER: ZONELESS})
    assert result.get() == "ran"  # was refused: "reliable_beat_fire_at=... has no time zone"
    run = runs.get_run(sqlite_store, KEY)
    assert run is not None and run["fire_at"] == SLOT


def test_a_celery_header_that_is_not_an_instant_is_refused_by_name(
        sqlite_url: str, sqlite_store: Store) -> None:
    celery = pytest.importorskip("celery")
    from sqlalchemy import select

    from reliable_beat.celery.task import (
        ENTRY_HEADER,
        FIRE_AT_HEADER,
        KEY_HEADER,
        IdempotentTask,
    )
    from reliable_beat.db.tables import dead_letters

    app = celery.Celery("badslot", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_database_url=sqlite_url)
    ran: list[str] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="nightly")
    def nightly(self: IdempotentTask) -> None:
        ran.append("body")

    result = nightly.apply(headers={KEY_HEADER: KEY, ENTRY_HEADER: "nightly",
                                    FIRE_AT_HEADER: "tomorrow"})
    assert isinstance(result.result, ValueError) and not ran
    with sqlite_store.engine.connect() as conn:
        letters = conn.execute(select(dead_letters.c.kind, dead_letters.c.error)).all()
    assert [kind for kind, _ in letters] == ["message"]
    assert "reliable_beat_fire_at='tomorrow': not an ISO 8601 instant" in letters[0].error
