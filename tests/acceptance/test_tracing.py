"""Traces from real processes: ``celery beat``, a ``celery worker`` and ``reliable-beat relay``
on PostgreSQL and Redis, each exporting its spans with the OpenTelemetry SDK to a JSON-lines
file (tests/apps/trace_app.py), and a far end that records the ``traceparent`` it receives.

One slot of ``pay`` (attempt 1 fails, attempt 2 writes a webhook row): every span from the
beat's firing to the webhook request shares one trace id and nests as the protocol runs, both
attempts are in it (each one ``process`` span, its claim and completion as events), and the far
end's ``traceparent`` names the webhook request span. One slot of ``zombie``: its attempt's
completion is fenced out and says so (event, outcome, the span's error status). No span shows a
secret put in kwargs, the webhook URL or an error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from reliable_beat.db.dialects import Store

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from procs import wait_for  # noqa: E402
from trace_app import ERROR_SECRET, KWARG_SECRET, PATH_SECRET  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(120)]


class _FarEnd(BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _FarEnd.seen.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def far_end() -> Iterator[tuple[str, list[dict[str, str]]]]:
    _FarEnd.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FarEnd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FarEnd.seen
    server.shutdown()


def _spans(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.glob("spans-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def _children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s["parent_id"] == parent["span_id"]
            and s["trace_id"] == parent["trace_id"]]


def _events(span: dict[str, Any]) -> list[str]:
    """The names of the span's events (the claim and the completion are bare: the outcome is
    the span's ``reliable_beat.outcome``)."""
    assert all(not e["attributes"] for e in span["events"]
               if e["name"].startswith("reliable_beat.")), span["events"]
    return [e["name"] for e in span["events"]]


def _completed(span: dict[str, Any], outcome: str) -> bool:
    """The span has a ``reliable_beat.complete`` event and the execution's outcome."""
    return ("reliable_beat.complete" in _events(span)
            and span["attributes"].get("reliable_beat.outcome") == outcome)


def _one(spans: list[dict[str, Any]], name: str, **attrs: Any) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name
             and all(s["attributes"].get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, [(s["name"], s["attributes"]) for s in spans])
    return found[0]


def test_one_trace_per_slot_from_claim_to_webhook(
    pg_store: Store, pg_url: str, redis_url: str, tmp_path: Path,
    far_end: tuple[str, list[dict[str, str]]],
) -> None:
    hook_url, seen = far_end
    traces = tmp_path / "spans"
    traces.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(APPS)]),
           "PYTHONUNBUFFERED": "1", "RB_BROKER_URL": redis_url, "RB_DATABASE_URL": pg_url,
           "RB_TRACE_DIR": str(traces), "RB_QUEUE": f"trace-{uuid.uuid4().hex[:8]}",
           "RB_HOOK_URL": hook_url, "RB_SCHEDULE": "1"}
    env.pop("CELERY_CONFIG_MODULE", None)
    commands = {
        "worker": [sys.executable, "-m", "celery", "-A", "trace_app", "worker", "--pool",
                   "solo", "-Q", env["RB_QUEUE"], "--without-gossip", "--without-mingle",
                   "--without-heartbeat", "-l", "INFO"],
        "relay": [sys.executable, "-m", "reliable_beat.cli", "-A", "trace_app", "relay"],
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
            fenced = any(_completed(s, "fenced_out") for s in spans)
            hooked = any(s["name"] == "deliver webhook" for s in spans)
            return bool(seen) and fenced and hooked

        wait_for(done, 35, "a webhook delivered and a fenced-out completion, traced")
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

    # --- the pay slot: the far end's traceparent names the webhook request span
    traceparent = seen[0].get("traceparent")
    assert traceparent, (seen[0], logs)
    _, trace_id, request_id, _ = traceparent.split("-")
    slot = [s for s in spans if s["trace_id"] == trace_id]
    by_id = {s["span_id"]: s for s in slot}
    fire = _one(slot, "fire pay")
    assert fire["parent_id"] is None and fire["process"] == "beat" and fire["kind"] == "PRODUCER"
    assert fire["links"], "the fire span links to the tick that claimed it"
    assert fire["attributes"]["reliable_beat.entry"] == "pay"
    assert fire["attributes"]["reliable_beat.slot"].endswith("Z")
    key = fire["attributes"]["reliable_beat.key"]
    assert key.startswith("pay@")
    tick = [s for s in spans if s["span_id"] == fire["links"][0]["span_id"]]
    assert tick and tick[0]["name"] == "reliable_beat.tick"

    send = _one(_children(slot, fire), "send trace_app.pay")
    assert send["process"] == "beat"
    processes = sorted((s for s in _children(slot, fire) if s["name"] == "process trace_app.pay"),
                       key=lambda s: s["start"])
    assert len(processes) == 2, [(s["name"], s["process"]) for s in slot]  # both attempts
    first, second = processes
    assert {first["process"], second["process"]} == {"worker"}
    assert first["kind"] == "CONSUMER"

    # the claim and the completion are events of the execution's span, with its attributes
    assert _events(first)[0] == "reliable_beat.claim"
    assert first["attributes"]["reliable_beat.attempt"] == 1
    assert first["attributes"]["reliable_beat.key"] == key
    assert first["attributes"]["reliable_beat.outcome"] == "retrying"
    fence1 = first["attributes"]["reliable_beat.fence_token"]
    retry = _one(_children(slot, first), "reliable_beat.retry")
    assert retry["attributes"]["reliable_beat.outcome"] == "retrying"
    assert retry["events"] and retry["events"][0]["name"] == "exception"
    assert "password=***" in retry["events"][0]["attributes"]["exception.message"]
    assert first["status"] != "ERROR"  # a retry is not the execution's error

    assert _events(second) == ["reliable_beat.claim", "reliable_beat.complete"]
    assert second["attributes"]["reliable_beat.attempt"] == 2
    assert second["attributes"]["reliable_beat.fence_token"] > fence1
    assert second["attributes"]["reliable_beat.outcome"] == "succeeded"
    assert not [s for s in slot if s["name"].startswith("reliable_beat.")
                and s["name"] != "reliable_beat.retry"], "steps are events, not spans"

    # the outbox row written by the body: the relay's delivery joins the body's trace
    deliver = _one(slot, "deliver webhook")
    assert deliver["process"] == "relay" and by_id[deliver["parent_id"]] is second
    assert deliver["attributes"]["reliable_beat.outcome"] == "sent"
    request = _one(_children(slot, deliver), "POST")
    assert request["span_id"] == request_id and request["kind"] == "CLIENT"
    assert request["attributes"]["http.response.status_code"] == 200
    assert PATH_SECRET not in request["attributes"]["url.full"]
    assert request["attributes"]["url.full"].startswith(hook_url)

    # every span of the slot chains up to the fire span
    for s in slot:
        hops = 0
        while s["parent_id"] is not None:
            s = by_id[s["parent_id"]]
            hops += 1
            assert hops < 10
        assert s is fire

    # --- the zombie slot: the fenced-out attempt is visible as such
    zombie_fire = next(s for s in spans if s["name"] == "fire zombie")
    ztrace = [s for s in spans if s["trace_id"] == zombie_fire["trace_id"]]
    zprocess = _one(ztrace, "process trace_app.zombie")
    assert _events(zprocess)[-2:] == ["reliable_beat.complete", "exception"]
    assert zprocess["attributes"]["reliable_beat.outcome"] == "fenced_out"
    assert zprocess["status"] == "ERROR"
    assert "StaleFenceToken" in zprocess["status_description"]

    # --- no secret anywhere in any span
    dump = json.dumps(spans)
    for secret in (KWARG_SECRET, ERROR_SECRET, PATH_SECRET):
        assert secret not in dump, secret
