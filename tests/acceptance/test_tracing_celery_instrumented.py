"""Under ``opentelemetry-instrumentation-celery``: real ``celery beat`` and ``celery worker``
processes, both instrumented by Celery's own instrumentation (``CeleryInstrumentor``) beside
reliable_beat's spans, exporting to JSON lines (tests/apps/trace_app.py), on PostgreSQL and
Redis.

Celery's ``run/<task>`` span joins the slot's trace (the ``traceparent`` the trigger carries);
no ``process <task>`` span of ours duplicates it: the execution's events (claim, completion)
and attributes (fence token, attempt, outcome) land on Celery's span; a retry shows both
attempts (its ``reliable_beat.retry`` span under the first), a fenced-out completion says so;
Celery's ``celery.retry.reason`` holds the error's text redacted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from reliable_beat.db.dialects import Store
from tests.acceptance.test_tracing import (
    APPS,
    ROOT,
    _children,
    _completed,
    _events,
    _one,
    _spans,
)

sys.path.insert(0, str(APPS))
from procs import wait_for
from trace_app import ERROR_SECRET

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]
pytest.importorskip("opentelemetry.instrumentation.celery",
                    reason="pip install opentelemetry-instrumentation-celery")


def _run_spans(spans: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    return sorted((s for s in spans if s["name"] == f"run/{task}"), key=lambda s: s["start"])


def _first(spans: list[dict[str, Any]], outcome: str) -> dict[str, Any]:
    """The earliest span with a ``reliable_beat.complete`` event of that outcome (a slow machine
    may fire a slot twice)."""
    return min((s for s in spans if _completed(s, outcome)),
               key=lambda s: s["start"])


def test_worker_spans_nest_under_celerys_task_span(
    pg_store: Store, pg_url: str, redis_url: str, tmp_path: Path,
) -> None:
    traces = tmp_path / "spans"
    traces.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(APPS)]),
           "PYTHONUNBUFFERED": "1", "RB_BROKER_URL": redis_url, "RB_DATABASE_URL": pg_url,
           "RB_TRACE_DIR": str(traces), "RB_QUEUE": f"otelc-{uuid.uuid4().hex[:8]}",
           "RB_SCHEDULE": "1", "RB_CELERY_INSTRUMENT": "1"}
    env.pop("CELERY_CONFIG_MODULE", None)
    commands = {
        "worker": [sys.executable, "-m", "celery", "-A", "trace_app", "worker", "--pool",
                   "solo", "-Q", env["RB_QUEUE"], "--without-gossip", "--without-mingle",
                   "--without-heartbeat", "-l", "INFO"],
        "beat": [sys.executable, "-m", "celery", "-A", "trace_app", "beat", "-l", "INFO",
                 "--pidfile=", "-s", str(tmp_path / "beat-schedule")],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for role, cmd in commands.items():
            with open(tmp_path / f"{role}.log", "wb") as log:
                procs[role] = subprocess.Popen(
                    cmd, env={**env, "RB_PROCESS_ROLE": role}, cwd=tmp_path, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)

        def done() -> bool:
            spans = _spans(traces)
            outcomes = {s["attributes"].get("reliable_beat.outcome") for s in spans
                        if "reliable_beat.complete" in _events(s)}
            return {"succeeded", "fenced_out"} <= outcomes

        wait_for(done, 35, "a succeeded (second attempt) and a fenced-out completion, traced")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    logs = "\n".join(f"--- {r}\n" + (tmp_path / f"{r}.log").read_text(errors="replace")
                     for r in commands)
    spans = _spans(traces)
    names = sorted({(s["process"], s["name"]) for s in spans})

    # Celery's instrumentation made its task spans; ours made no second one
    assert not [s for s in spans if s["name"].startswith("process ")], names
    completed = _first(spans, "succeeded")  # the first slot's second attempt
    slot = [s for s in spans if s["trace_id"] == completed["trace_id"]]
    by_id = {s["span_id"]: s for s in slot}
    fire = _one(slot, "fire pay")
    assert fire["parent_id"] is None and fire["process"] == "beat"

    # both attempts: Celery's run/ span in the slot's trace, our protocol's events on it
    runs = _run_spans(slot, "trace_app.pay")
    assert len(runs) == 2, (names, logs[-4000:])
    first, second = runs
    assert second is completed
    assert {first["process"], second["process"]} == {"worker"}
    for run in runs:  # joined from the trigger's traceparent
        up = run
        while up["parent_id"] is not None:
            up = by_id[up["parent_id"]]
        assert up is fire, (run, up)
    assert _events(first)[0] == "reliable_beat.claim"
    assert first["attributes"]["reliable_beat.attempt"] == 1
    retry = _one(_children(slot, first), "reliable_beat.retry")
    assert retry["attributes"]["reliable_beat.outcome"] == "retrying"
    assert [e for e in _events(second) if e.startswith("reliable_beat.")] == [
        "reliable_beat.claim", "reliable_beat.complete"]
    assert second["attributes"]["reliable_beat.attempt"] == 2
    # the execution's attributes are set on Celery's span
    assert first["attributes"]["reliable_beat.outcome"] == "retrying"
    assert second["attributes"]["reliable_beat.outcome"] == "succeeded"
    assert second["attributes"]["reliable_beat.fence_token"] \
        > first["attributes"]["reliable_beat.fence_token"]

    # the zombie: its fenced-out completion an event of Celery's span, which says so too
    fenced = _first(spans, "fenced_out")
    zslot = [s for s in spans if s["trace_id"] == fenced["trace_id"]]
    _one(zslot, "fire zombie")
    [zrun] = _run_spans(zslot, "trace_app.zombie")
    assert zrun is fenced
    assert zrun["attributes"]["reliable_beat.outcome"] == "fenced_out"
    assert zrun["status"] == "ERROR"

    # Celery's retry reason is handed over redacted: no secret of the error in any span
    reasons = [s["attributes"]["celery.retry.reason"] for s in spans
               if "celery.retry.reason" in s["attributes"]]
    assert reasons and all("password=***" in r for r in reasons), reasons
    assert ERROR_SECRET not in json.dumps(spans)
