"""Screenshots of real reliable_beat traces in a trace viewer, for docs/observability.md.

Starts a private PostgreSQL and Redis (harness/servers.py, as the tests do), the trace viewer
Arize Phoenix (an OpenTelemetry trace viewer installed from PyPI; it takes OTLP over HTTP), and
real ``celery beat``, ``celery worker --pool solo`` and ``reliable-beat relay`` processes of
``scripts/trace_demo_app.py``, each exporting its spans over OTLP to the viewer. It then runs

* one slot of the ``pay`` entry from the beat's firing to the webhook's far end (attempt 1
  fails transiently, attempt 2 writes a webhook row, the relay delivers it; the far end, a
  small HTTP server in this script, makes a server span from the ``traceparent`` it gets);
* one ``shop.order`` workflow, started and signalled from "web request" spans of this script,
  whose last step is refused so its saga compensates the two before it;

opens each trace in the viewer in headless Chromium and saves ``trace-slot.png`` and
``trace-workflow.png`` into ``docs/images/`` (``--out``). Not part of CI: run it after a change
to the span tree, and commit the pictures. About two minutes on a small machine, most of it
the viewer's start.

Set-up, once (the viewer gets a venv of its own: it pins libraries the project also uses)::

    python3 -m venv /tmp/phoenix && /tmp/phoenix/bin/pip install arize-phoenix
    .venv/bin/pip install opentelemetry-exporter-otlp-proto-http
    apt-get install chromium chromium-driver   # selenium comes with the dev extra

Run, from the repository root::

    .venv/bin/python scripts/trace_screenshots.py --phoenix /tmp/phoenix/bin/phoenix
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import signal as _signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from opentelemetry import trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import (  # noqa: E402
    TraceContextTextMapPropagator,
)
from sqlalchemy import select  # noqa: E402

from harness.servers import PostgresServer, RedisServer, free_port  # noqa: E402
from reliable_beat.db import migrate  # noqa: E402
from reliable_beat.db.dialects import Store  # noqa: E402
from reliable_beat.db.tables import workflows  # noqa: E402
from reliable_beat.workflows import engine, signal  # noqa: E402

WORKFLOW_ID = "order-7"


def wait_for(what: str, predicate: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.3)


def provider(endpoint: str, service: str) -> TracerProvider:
    p = TracerProvider(resource=Resource.create({"service.name": service}))
    p.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return p


@contextlib.contextmanager
def phoenix(executable: str, workdir: Path) -> Iterator[str]:
    """The viewer on free ports; yields its base URL."""
    port = free_port()
    env = {**os.environ, "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(free_port()),
           "PHOENIX_HOST": "127.0.0.1", "PHOENIX_WORKING_DIR": str(workdir),
           "PHOENIX_TELEMETRY_ENABLED": "false"}
    base = f"http://127.0.0.1:{port}"
    with open(workdir / "phoenix.log", "wb") as log:
        proc = subprocess.Popen([executable, "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise SystemExit(f"the viewer exited; see {workdir / 'phoenix.log'}")
            try:
                with urllib.request.urlopen(base + "/v1/projects", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for("the trace viewer to start", up, 300)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def far_end(endpoint: str) -> tuple[str, list[str], Callable[[], None]]:
    """The webhook's far end: a server span from the request's ``traceparent``."""
    tracer = provider(endpoint, "far-end").get_tracer("far-end")
    seen: list[str] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            ctx = TraceContextTextMapPropagator().extract(dict(self.headers.items()))
            with tracer.start_as_current_span(f"POST {self.path.split('?')[0]}", context=ctx,
                                              kind=SpanKind.SERVER,
                                              attributes={"http.response.status_code": 200}):
                seen.append(self.headers.get("traceparent") or "")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", seen, server.shutdown


def screenshot(base: str, trace_id: str, select: str, nth: str, height: int,
               path: Path, tab: str | None = None) -> None:
    """The trace's page, ``height`` pixels tall, span ``select`` (its ``nth`` in the tree,
    an XPath position) selected, and its detail tab ``tab`` (e.g. ``Events``) open."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        raise SystemExit("chromium / chromedriver not found: apt-get install chromium "
                         "chromium-driver")
    with urllib.request.urlopen(base + "/v1/projects", timeout=10) as r:
        project = next(p["id"] for p in json.load(r)["data"] if p["name"] == "default")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size=1600,{height}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        url = f"{base}/projects/{project}/traces/{trace_id}"

        span = f"(//*[text()='{select}'])[{nth}]"

        def shown() -> bool:
            driver.get(url)  # reloaded every 15 s: the viewer may still be ingesting
            end = time.monotonic() + 15
            while time.monotonic() < end:
                if driver.find_elements(By.XPATH, span):
                    return True
                time.sleep(0.5)
            return False

        wait_for(f"{select!r} shown at {url}", shown, 120)
        time.sleep(2)  # the rest of the tree
        driver.find_element(By.XPATH, span).click()
        time.sleep(2)
        if tab is not None:  # e.g. the span's events: claim, completion, the exception
            tabs = driver.find_elements(By.XPATH, f"//*[starts-with(text(), '{tab}')]")
            if tabs:
                tabs[-1].click()
                time.sleep(1)
        driver.save_screenshot(str(path))
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phoenix", default=shutil.which("phoenix") or "phoenix",
                        help="the viewer's `phoenix` executable (pip install arize-phoenix)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rb-trace-shots-"))
    with PostgresServer() as pg, RedisServer() as redis, phoenix(args.phoenix, work) as base:
        endpoint = base + "/v1/traces"
        hook_url, seen, stop_hook = far_end(endpoint)
        queue = f"demo-{os.getpid()}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]),
               "PYTHONUNBUFFERED": "1", "RB_BROKER_URL": redis.url, "RB_DATABASE_URL": pg.url,
               "RB_QUEUE": queue, "RB_HOOK_URL": hook_url, "RB_OTLP_ENDPOINT": endpoint}
        env.pop("CELERY_CONFIG_MODULE", None)
        os.environ.update({k: env[k] for k in ("RB_BROKER_URL", "RB_DATABASE_URL", "RB_QUEUE")})

        # this process: the "web" that starts and signals the workflow
        web = provider(endpoint, "shop-web")
        trace.set_tracer_provider(web)
        importlib.import_module("trace_demo_app")  # after the environment: registers shop.order
        store = Store.from_url(pg.url)
        migrate.upgrade(store)
        commands = {
            "worker": [sys.executable, "-m", "celery", "-A", "trace_demo_app", "worker",
                       "--pool", "solo", "-Q", queue, "--without-gossip", "--without-mingle",
                       "--without-heartbeat", "-l", "INFO"],
            "relay": [sys.executable, "-m", "reliable_beat.cli", "-A", "trace_demo_app",
                      "relay"],
            "beat": [sys.executable, "-m", "celery", "-A", "trace_demo_app", "beat", "-l",
                     "INFO", "--pidfile=", "-s", str(work / "beat-schedule")],
        }
        procs: dict[str, subprocess.Popen[bytes]] = {}
        web_tracer = web.get_tracer("shop-web")
        try:
            for role, cmd in commands.items():
                with open(work / f"{role}.log", "wb") as log:
                    procs[role] = subprocess.Popen(
                        cmd, env={**env, "RB_PROCESS_ROLE": role}, cwd=work, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True)
            with web_tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER):
                engine.start(store, "shop.order", WORKFLOW_ID, [WORKFLOW_ID])

            def parked() -> bool:
                wf = engine.get_workflow(store, WORKFLOW_ID, events=True)
                return any(e["kind"] == "signal" for e in wf["events"])

            wait_for("the workflow to wait for its signal", parked, 90)
            with web_tracer.start_as_current_span(f"POST /orders/{WORKFLOW_ID}/approve",
                                                  kind=SpanKind.SERVER):
                signal(store, WORKFLOW_ID, "approved", True)
            wait_for("the workflow to fail and compensate", lambda: engine.get_workflow(
                store, WORKFLOW_ID)["state"] == "failed", 90)
            wait_for("a webhook delivered", lambda: seen, 90)
            time.sleep(2)  # the last compensation's completion spans
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(_signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            stop_hook()
            web.shutdown()
        slot_trace = seen[0].split("-")[1]
        with store.connect() as conn:
            wf_trace = conn.execute(select(workflows.c.traceparent).where(
                workflows.c.workflow_id == WORKFLOW_ID)).scalar_one().split("-")[1]
        args.out.mkdir(parents=True, exist_ok=True)
        # the first attempt (failed: its events); the receive span that consumed the signal
        screenshot(base, slot_trace, "process demo.pay", "1", 1000,
                   args.out / "trace-slot.png", tab="Events")
        screenshot(base, wf_trace, "receive signal approved", "last()", 2300,
                   args.out / "trace-workflow.png")
        store.engine.dispose()
    print(f"wrote {args.out / 'trace-slot.png'} and {args.out / 'trace-workflow.png'} "
          f"(logs in {work})")


if __name__ == "__main__":
    main()
