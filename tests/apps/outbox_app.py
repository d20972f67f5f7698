"""A Celery app for relay subprocesses in the outbox tests.

Environment:
    RB_TEST_REDIS_URL: the broker (a Redis or an ``amqp://`` RabbitMQ URL).
    RB_TEST_SLEEP_AFTER_DELIVER: seconds the ``celery`` handler sleeps after publishing a
        batch and before returning (so a test can SIGKILL the relay between publish and
        mark-sent).
    RB_TEST_DELIVERED_FILE: a file the handler appends one line per published message id to,
        after publishing and before sleeping.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from celery import Celery

from reliable_beat.handlers import CeleryHandler
from reliable_beat.outbox import OutboxMessage

app = Celery("outbox_app", broker=os.environ.get("RB_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
app.conf.reliable_beat_outbox_handlers = {"celery": "outbox_app:SlowCeleryHandler"}
app.conf.reliable_beat_relay_poll_seconds = 0.2


class SlowCeleryHandler(CeleryHandler):
    """The built-in celery handler, plus a marker file and a sleep after publishing."""

    def __init__(self) -> None:
        super().__init__(app)

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[BaseException | None]:
        results = super().deliver_batch(messages)
        marker = os.environ.get("RB_TEST_DELIVERED_FILE")
        if marker:
            with open(marker, "a") as fh:
                for m, err in zip(messages, results, strict=True):
                    if err is None:
                        fh.write(m.message_id + "\n")
        time.sleep(float(os.environ.get("RB_TEST_SLEEP_AFTER_DELIVER", "0")))
        return results
