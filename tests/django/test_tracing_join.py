"""The fenced completion's ``reliable_beat.complete`` event on Django's paths of
``self.transaction()``: ``using=`` an alias, and no argument (the alias whose database is the
store's), on the child's real PostgreSQL (run by tests/integration/test_django.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.management import call_command
from djtables import meta
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reliable_beat import runs, tracing
from reliable_beat.contrib.django import conf


@pytest.fixture(scope="module", autouse=True)
def tables() -> None:
    call_command("migrate", verbosity=0)
    meta.create_all(conf.store().engine)


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


@pytest.mark.parametrize("how", ["using", "default"])
def test_django_join_has_the_completion_event(how: str, exporter: InMemorySpanExporter) -> None:
    from djtask_app import pay_on, pay_plain

    if how == "using":
        res = pay_on.apply(args=["trace-using", "default"])
        key = "pay:trace-using"
    else:
        res = pay_plain.apply(args=["trace-default"])
        key = "pay:trace-default"
    assert res.successful(), res.traceback
    assert runs.get_run(conf.store(), key)["state"] == "succeeded"
    [process] = [s for s in exporter.get_finished_spans() if s.name.startswith("process ")
                 and (s.attributes or {}).get(tracing.KEY) == key]
    assert [(e.name, dict(e.attributes or {})) for e in process.events] == [
        ("reliable_beat.claim", {}), ("reliable_beat.complete", {})]
    assert process.attributes is not None
    assert process.attributes[tracing.OUTCOME] == "succeeded"
    assert process.attributes[tracing.FENCE_TOKEN] == 1
