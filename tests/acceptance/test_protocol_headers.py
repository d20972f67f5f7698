"""Celery protocol headers in a row never override the message's own (issue 13).

A real ``celery worker`` (tests/apps/headers_app.py) on Redis; an outbox ``celery`` row for
task ``ha.a`` carrying ``task=ha.b``, ``id``, ``retries``, ``eta`` and a custom header. On
main the worker ran ``ha.b`` under the forged id; now it runs ``ha.a`` under the row's own
task id, the protocol headers are dropped (logged at WARNING) and the custom header kept.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from celery import Celery

from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.handlers import celery_task_id
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from procs import wait_for  # noqa: E402

CELERY = Path(sys.executable).parent / "celery"
pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


def test_row_cannot_override_protocol_headers(
        sqlite_store: Store, redis_url: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "ran.jsonl"
    queue = f"q-headers-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
           "RB_BROKER_URL": redis_url, "RB_TEST_OUT": str(out)}
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [str(CELERY), "-A", "headers_app", "worker", "--pool", "solo", "-Q", queue,
             "-n", f"{queue}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-l", "INFO"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        with sqlite_store.begin() as conn:
            key = outbox.add(conn, "celery", {
                "task": "ha.a", "options": {"queue": queue},
                "headers": {"task": "ha.b", "id": "forged-id", "retries": 7,
                            "eta": "2020-01-01T00:00:00+00:00", "x-custom": "kept"},
            }, key="row-with-forged-headers")
        app = Celery("client", broker=redis_url, set_as_current=False)
        app.conf.broker_connection_retry_on_startup = True
        relay = Relay(sqlite_store, app=app, settings=Settings(database_url="unused://"),
                      owner="r")
        with caplog.at_level(logging.WARNING, logger="reliable_beat.handlers"):
            assert relay.run_once() == 1
        wait_for(lambda: out.exists() and out.read_text().strip(), 90,
                 "the worker to run the task")
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    [ran] = [json.loads(line) for line in out.read_text().splitlines()]
    expected_id = celery_task_id(OutboxMessage(0, key, "celery", {"task": "ha.a"}))
    assert ran == {"ran": "a", "id": expected_id, "retries": 0, "eta": None, "custom": "kept"}
    assert "Celery protocol header(s) eta, id, retries, task ignored" in caplog.text
