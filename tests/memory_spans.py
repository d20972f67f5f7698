"""The ``exporter`` fixture: reliable_beat's spans recorded in memory through the OpenTelemetry
SDK (a real provider and processor), the tracer reset afterwards. Import it into a test
module: ``from tests.memory_spans import exporter  # noqa: F401 (fixture)``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reliable_beat import tracing


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
