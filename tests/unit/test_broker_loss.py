"""The worker's connection-loss guard (:mod:`reliable_beat.celery.broker_loss`): it says why
Celery stops the worker and changes nothing else. The real worker and Redis restart are in
tests/acceptance/test_worker_broker_restart.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from reliable_beat.celery import broker_loss


class Consumer:
    """What the guard touches of Celery's ``Consumer``: its connection-loss handler."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.calls: list[BaseException] = []

    def on_connection_error_after_connected(self, exc: BaseException) -> Any:
        self.calls.append(exc)
        if self.raises is not None:
            raise self.raises
        return "reconnecting"


class Worker:
    def __init__(self, consumer: Consumer | None) -> None:
        self.consumer = consumer


def test_a_failing_close_is_explained_then_reraised(caplog: pytest.LogCaptureFixture) -> None:
    failure = AttributeError("'NoneType' object has no attribute 'hostname'")
    consumer = Consumer(raises=failure)
    broker_loss.install(Worker(consumer))
    lost = ConnectionError("Connection closed by server.")
    with caplog.at_level(logging.ERROR, logger="reliable_beat.broker_loss"), \
            pytest.raises(AttributeError) as raised:
        consumer.on_connection_error_after_connected(lost)
    assert raised.value is failure  # Celery's behaviour unchanged: it still stops the worker
    assert consumer.calls == [lost]
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    text = record.getMessage()
    assert text.startswith("worker_broker_loss: Celery's consumer failed while closing the "
                           "lost broker connection after ConnectionError: Connection closed")
    assert "(AttributeError: 'NoneType' object has no attribute 'hostname')" in text
    assert "exit code 1" in text and "Restart=always" in text
    assert broker_loss.DOCS_SECTION in text


def test_a_reconnect_that_works_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    consumer = Consumer()
    worker = Worker(consumer)
    broker_loss.install(worker)
    broker_loss.install(worker)  # idempotent: wrapped once
    with caplog.at_level(logging.DEBUG, logger="reliable_beat.broker_loss"):
        assert consumer.on_connection_error_after_connected(OSError("gone")) == "reconnecting"
    assert len(consumer.calls) == 1
    assert caplog.records == []


def test_a_worker_without_a_consumer_is_left_alone() -> None:
    broker_loss.install(Worker(None))
    broker_loss.guard_connection_loss(object())  # nothing to wrap: no error
