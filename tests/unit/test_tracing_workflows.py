"""A workflow's trace: its start span stored with it, every advance and every compensation of
its saga a span of that one trace (SQLite and MariaDB, the in-process driver)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reliable_beat import tracing
from reliable_beat.db.dialects import Store
from reliable_beat.workflows import WorkflowFailed, engine
from tests.unit.test_workflow_sagas import app, drain, store  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing._tracer = provider.get_tracer("reliable_beat")
    try:
        yield memory
    finally:
        tracing._reset()


def test_saga_compensations_in_the_workflow_trace(
    app: Celery, store: Store, exporter: InMemorySpanExporter  # noqa: F811
) -> None:
    handle = engine.start(store, "t.three", "o1", ["o1"])
    drain(Driver(store, app))
    with pytest.raises(WorkflowFailed):
        handle.result(timeout=1)
    spans = exporter.get_finished_spans()
    start = next(s for s in spans if s.name == "start workflow t.three")
    trace_id = start.context.trace_id
    advances = [s for s in spans if s.name == "advance workflow t.three"]
    assert len(advances) >= 2
    assert {s.context.trace_id for s in advances} == {trace_id}
    assert all(s.parent is not None and s.parent.span_id == start.context.span_id
               for s in advances)
    assert advances[-1].attributes is not None
    assert advances[-1].attributes[tracing.OUTCOME] == "failed"
    assert advances[0].attributes is not None
    assert advances[0].attributes[tracing.WORKFLOW_ID] == "o1"
    in_trace = [s for s in spans if s.context.trace_id == trace_id]
    undo = [s for s in in_trace if s.name == "process saga.undo"]
    assert len(undo) == 3, sorted({(s.name, s.context.trace_id == trace_id) for s in spans})
    done = [s for s in in_trace if s.name == "process saga.do"]
    assert len(done) >= 3
