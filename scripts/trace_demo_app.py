"""The Celery app that ``scripts/trace_screenshots.py`` runs in real processes (``celery beat``,
``celery worker --pool solo``, ``reliable-beat relay``), each exporting its spans over OTLP/HTTP
to the trace viewer the script started.

The OpenTelemetry SDK is set up at import when ``RB_OTLP_ENDPOINT`` is set: a
``TracerProvider`` whose resource names the process (``service.name``: ``RB_PROCESS_ROLE``) and
a ``SimpleSpanProcessor`` with the OTLP/HTTP exporter (each span exported when it ends: nothing
is lost when the script stops the process). Environment: ``RB_BROKER_URL``,
``RB_DATABASE_URL``, ``RB_QUEUE``, ``RB_HOOK_URL`` (the far end's base URL),
``RB_OTLP_ENDPOINT`` (``http://host:port/v1/traces``), ``RB_PROCESS_ROLE``.

* entry ``pay`` (every 10 s, task ``demo.pay``): attempt 1 fails with a transient error that
  holds a password (redacted in the spans); attempt 2 adds a webhook outbox row to
  destination ``far`` in its transaction, which the relay delivers.
* workflow ``shop.order``: reserve stock, wait for signal ``approved``, charge the card, ship;
  shipping is refused permanently, so the saga refunds the card and releases the stock.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.workflows import WorkflowContext, workflow

if os.environ.get("RB_OTLP_ENDPOINT"):
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    _provider = TracerProvider(resource=Resource.create(
        {"service.name": os.environ.get("RB_PROCESS_ROLE", "reliable_beat")}))
    _provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=os.environ["RB_OTLP_ENDPOINT"])))
    trace.set_tracer_provider(_provider)

QUEUE = os.environ.get("RB_QUEUE", "celery")

app = Celery("trace_demo_app", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    timezone="UTC",
    task_default_queue=QUEUE,
    beat_scheduler="reliable_beat.celery:ReliableScheduler",
    beat_max_loop_interval=1.0,
    beat_schedule={"pay": {"task": "demo.pay", "schedule": timedelta(seconds=10)}},
    reliable_beat_database_url=os.environ.get("RB_DATABASE_URL", "sqlite:///demo.sqlite3"),
    reliable_beat_lease_seconds=5.0,
    reliable_beat_retry_max_attempts=4,
    reliable_beat_retry_base_seconds=0.2,
    reliable_beat_retry_cap_seconds=0.5,
    reliable_beat_relay_poll_seconds=0.2,
    reliable_beat_webhook_destinations={
        "far": {"base_url": os.environ.get("RB_HOOK_URL", "http://127.0.0.1:9") + "/hook"},
    },
)


@app.task(base=IdempotentTask, bind=True, name="demo.pay")
def pay(self: Any) -> str:
    if self.attempt == 1:
        raise ConnectionError("payment gateway refused the call: password=hunter2")
    with self.transaction() as tx:
        self.outbox.add(tx, "webhook", {"destination": "far", "path": "/paid",
                                        "body": {"key": self.idempotency_key}})
    return "paid"


@app.task(base=IdempotentTask, bind=True, name="shop.step")
def step(self: Any, order: str, what: str, fail: bool = False) -> str:
    """A saga step (or its compensation): ``fail`` refuses permanently (no retry)."""
    if fail:
        raise ValueError(f"{order}: {what} refused by the carrier")
    with self.transaction():
        self.returns(what)
    return what


@workflow(app, name="shop.order", queue=QUEUE)
def order(ctx: WorkflowContext, order_id: str) -> Any:
    with ctx.saga() as saga:
        saga.compensate(step, order_id, "release stock", queue=QUEUE)
        ctx.activity(step, order_id, "reserve stock", queue=QUEUE)
        ctx.wait_signal("approved")
        saga.compensate(step, order_id, "refund card", queue=QUEUE)
        ctx.activity(step, order_id, "charge card", queue=QUEUE)
        ctx.activity(step, order_id, "ship", True, queue=QUEUE)
    return "shipped"
