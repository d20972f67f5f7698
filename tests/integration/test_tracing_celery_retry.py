"""Under ``opentelemetry-instrumentation-celery``, a retried IdempotentTask whose exception holds
a secret: Celery copies the retry's text into its span (``celery.retry.reason``) and its log
line; reliable_beat hands Celery the text redacted, so no exported span attribute or event holds
the secret. Celery in process (``apply``: the retry runs at once), on SQLite."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from celery import Celery
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reliable_beat import runs, tracing
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.db.dialects import Store

instrumentation = pytest.importorskip(
    "opentelemetry.instrumentation.celery",
    reason="pip install opentelemetry-instrumentation-celery")

SECRET = "RtRetrySecret5e0b7d"


@pytest.fixture
def instrumented() -> Iterator[InMemorySpanExporter]:
    """Celery's instrumentation and reliable_beat's tracer on one in-memory SDK provider."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    instrumentor = instrumentation.CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    tracing._tracer = provider.get_tracer("reliable_beat")
    try:
        yield memory
    finally:
        tracing._reset()
        instrumentor.uninstrument()


def test_a_retry_reason_reaches_celerys_span_redacted(
    sqlite_store: Store, instrumented: InMemorySpanExporter, caplog: pytest.LogCaptureFixture,
) -> None:
    app = Celery("retried", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_retry_base_seconds=0.01,
                    reliable_beat_database_url=sqlite_store.engine.url.render_as_string(
                        hide_password=False))
    tries: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="retried.pay")
    def pay(self: IdempotentTask) -> str:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError(f"upstream refused the call: password={SECRET}")
        return "paid"

    with caplog.at_level(logging.INFO):
        pay.apply(headers={KEY_HEADER: "r:1"})
    assert len(tries) == 2
    assert runs.get_run(sqlite_store, "r:1")["state"] == "succeeded"
    spans = instrumented.get_finished_spans()
    reasons = [s.attributes["celery.retry.reason"] for s in spans
               if s.attributes and "celery.retry.reason" in s.attributes]
    assert reasons, [(s.name, dict(s.attributes or {})) for s in spans]  # Celery's span says it
    assert "ConnectionError" in str(reasons[0]) and "password=***" in str(reasons[0])
    exported = json.dumps([(s.name, dict(s.attributes or {}),
                            [(e.name, dict(e.attributes or {})) for e in s.events],
                            s.status.description) for s in spans], default=str)
    assert SECRET not in exported
    assert SECRET not in caplog.text  # Celery's own "retry:" log line
