"""The start-up check of the broker's timeouts against the retry cap (no broker needed:
the check reads the configuration only)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery

from reliable_beat.celery.brokers import broker_timeout_problems, warn_broker_timeouts
from reliable_beat.settings import Settings


@pytest.fixture
def amqp_app() -> Iterator[Celery]:
    app = Celery("t", broker="amqp://guest@127.0.0.1:1//")
    app.conf.broker_transport_options = {"confirm_publish": True}
    yield app
    app.close()


def test_retry_cap_below_consumer_timeout_is_fine(amqp_app: Celery) -> None:
    assert broker_timeout_problems(amqp_app, Settings(retry_cap_seconds=600)) == []


def test_retry_cap_reaching_consumer_timeout_is_reported(amqp_app: Celery) -> None:
    problems = broker_timeout_problems(amqp_app, Settings(retry_cap_seconds=3600))
    assert len(problems) == 1
    assert "reliable_beat_retry_cap_seconds=3600" in problems[0]
    assert "consumer_timeout" in problems[0]
    # the broker's timeout raised, and said so: fine again
    assert broker_timeout_problems(amqp_app, Settings(
        retry_cap_seconds=3600, broker_consumer_timeout_seconds=7200)) == []


def test_a_task_of_its_own_with_a_longer_cap_is_named(amqp_app: Celery) -> None:
    from reliable_beat.celery.task import IdempotentTask

    class Slow(IdempotentTask):
        retry_cap_seconds = 2400.0

    @amqp_app.task(base=Slow, bind=True, name="billing.slow")
    def slow(self: IdempotentTask) -> None: ...

    problems = broker_timeout_problems(amqp_app, Settings(retry_cap_seconds=60))
    assert len(problems) == 1 and "billing.slow.retry_cap_seconds=2400" in problems[0], problems


def test_acks_late_time_limit_and_missing_confirms(amqp_app: Celery) -> None:
    amqp_app.conf.task_acks_late = True
    amqp_app.conf.task_time_limit = 7200
    amqp_app.conf.broker_transport_options = {}
    problems = broker_timeout_problems(amqp_app, Settings(retry_cap_seconds=60))
    assert any("task_time_limit=7200" in p for p in problems), problems
    assert any("confirm_publish" in p for p in problems), problems


def test_redis_visibility_timeout(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("t", broker="redis://127.0.0.1:1/0")
    try:
        assert broker_timeout_problems(app, Settings(retry_cap_seconds=600)) == []
        app.conf.broker_transport_options = {"visibility_timeout": 300}
        with caplog.at_level(logging.WARNING, logger="reliable_beat.brokers"):
            problems = warn_broker_timeouts(app, Settings(retry_cap_seconds=600))
        assert len(problems) == 1 and "visibility_timeout (300 s)" in problems[0]
        assert "broker_timeouts:" in caplog.text
    finally:
        app.close()


def test_unknown_broker_is_not_checked() -> None:
    app = Celery("t", broker="memory://")
    try:
        assert broker_timeout_problems(app, Settings(retry_cap_seconds=10**6)) == []
    finally:
        app.close()
