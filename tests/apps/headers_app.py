"""Two plain tasks that record who ran, with which id, retries and custom header (issue 13:
a row's ``task=B`` header must not turn a message for A into B).

Environment: ``RB_BROKER_URL``; ``RB_TEST_OUT`` (a file each run appends one JSON line to).
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

app = Celery("headers_app", broker=os.environ.get("RB_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.broker_connection_retry_on_startup = True
app.conf.task_ignore_result = True


def _record(task: Any, name: str) -> None:
    headers = getattr(task.request, "headers", None) or {}
    line = {"ran": name, "id": task.request.id, "retries": task.request.retries,
            "eta": task.request.eta, "custom": headers.get("x-custom")
            or getattr(task.request, "x-custom", None)}
    with open(os.environ["RB_TEST_OUT"], "a") as fh:
        fh.write(json.dumps(line) + "\n")


@app.task(bind=True, name="ha.a")
def task_a(self: Any) -> None:
    _record(self, "a")


@app.task(bind=True, name="ha.b")
def task_b(self: Any) -> None:
    _record(self, "b")
