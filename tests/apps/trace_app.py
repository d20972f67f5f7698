"""A Celery app whose processes (beat, worker, relay) export their spans to JSON lines.

The OpenTelemetry SDK is set up at import: a ``TracerProvider`` with a
``SimpleSpanProcessor`` and :class:`JsonLinesExporter`, which appends each ended span as one
JSON object to ``$RB_TRACE_DIR/spans-<pid>.jsonl`` (one file per process: no interleaving).
Workers run ``--pool solo`` (the provider set at import is the one the task runs under).

Environment: ``RB_BROKER_URL``, ``RB_DATABASE_URL``, ``RB_TRACE_DIR``, ``RB_QUEUE``,
``RB_HOOK_URL`` (the far end's base URL: the webhook destination ``far``, whose path holds a
token), ``RB_SCHEDULE`` (``1``: the entries below fire every 2 s; else none),
``RB_CELERY_INSTRUMENT`` (``1``: ``opentelemetry-instrumentation-celery`` instruments the
process too).

Tasks:

* ``trace_app.pay`` (entry ``pay``): attempt 1 fails transiently with a secret in the error;
  attempt 2 writes a webhook outbox row in its transaction and succeeds.
* ``trace_app.zombie`` (entry ``zombie``): another runner takes the run over during the body
  (its lease is expired and the run claimed again with a new fence, as after a pause), so this
  attempt's completion is fenced out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from celery import Celery
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from reliable_beat import runs
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.tables import runs as runs_table

#: secrets the spans must never show
KWARG_SECRET = "TrKwargSecret7f3a91"
ERROR_SECRET = "TrErrorSecret2b8c44"
PATH_SECRET = "TrPathToken9d1e5a7c3b"


class JsonLinesExporter(SpanExporter):
    """Each span as one JSON line: names, ids, parent, kind, status, attributes, events,
    links and times (what the tests assert on and the docs render)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        path = os.path.join(self.directory, f"spans-{os.getpid()}.jsonl")
        with open(path, "a") as fh:
            for s in spans:
                ctx = s.get_span_context()
                assert ctx is not None
                fh.write(json.dumps({
                    "name": s.name,
                    "trace_id": f"{ctx.trace_id:032x}",
                    "span_id": f"{ctx.span_id:016x}",
                    "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
                    "kind": s.kind.name,
                    "status": s.status.status_code.name,
                    "status_description": s.status.description,
                    "attributes": dict(s.attributes or {}),
                    "events": [{"name": e.name, "attributes": dict(e.attributes or {}),
                                "time": e.timestamp} for e in s.events],
                    "links": [{"trace_id": f"{link.context.trace_id:032x}",
                               "span_id": f"{link.context.span_id:016x}"} for link in s.links],
                    "start": s.start_time, "end": s.end_time,
                    "process": os.environ.get("RB_PROCESS_ROLE", str(os.getpid())),
                }, default=str) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


if os.environ.get("RB_TRACE_DIR"):
    _provider = TracerProvider()
    _provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ["RB_TRACE_DIR"])))
    trace.set_tracer_provider(_provider)
    if os.environ.get("RB_CELERY_INSTRUMENT") == "1":  # Celery's own task spans as well
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument()

app = Celery("trace_app", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    timezone="UTC",
    beat_scheduler="reliable_beat.celery:ReliableScheduler",
    beat_max_loop_interval=1.0,
    task_default_queue=os.environ.get("RB_QUEUE", "celery"),
    reliable_beat_database_url=os.environ.get("RB_DATABASE_URL", "sqlite:///trace.sqlite3"),
    reliable_beat_lease_seconds=5.0,
    reliable_beat_retry_max_attempts=4,
    reliable_beat_retry_base_seconds=0.2,
    reliable_beat_retry_cap_seconds=0.5,
    reliable_beat_relay_poll_seconds=0.2,
    reliable_beat_webhook_destinations={
        "far": {"base_url": os.environ.get("RB_HOOK_URL", "http://127.0.0.1:9") + "/hook/"
                + PATH_SECRET},
    },
)
if os.environ.get("RB_SCHEDULE") == "1":
    app.conf.beat_schedule = {
        "pay": {"task": "trace_app.pay", "schedule": timedelta(seconds=2),
                "kwargs": {"api_token": KWARG_SECRET}},
        "zombie": {"task": "trace_app.zombie", "schedule": timedelta(seconds=2)},
    }


@app.task(base=IdempotentTask, bind=True, name="trace_app.pay")
def pay(self: Any, api_token: str = "") -> str:
    if self.attempt == 1:
        raise ConnectionError(f"upstream refused the call: password={ERROR_SECRET}")
    with self.transaction() as tx:
        self.outbox.add(tx, "webhook", {"destination": "far", "path": "/paid",
                                    "body": {"key": self.idempotency_key}})
    return "paid"


@app.task(base=IdempotentTask, bind=True, name="trace_app.zombie")
def zombie(self: Any) -> str:
    store = self.store
    key = self.idempotency_key
    # another runner takes the run over (this one paused past its lease): a new fence
    with store.begin() as conn:
        conn.execute(sa.update(runs_table).where(runs_table.c.idempotency_key == key)
                     .values(lease_expires_at=sa.func.now() - sa.text("interval '1 second'")))
    runs.claim_run(store, key, owner="the-other-runner", lease=timedelta(seconds=60),
                   task=self.name)
    return "too late"
