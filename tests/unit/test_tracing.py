"""reliable_beat.tracing: a no-op without a tracer provider (or without the API), and spans
that never show a secret of an error, a URL or a key (the logs' redaction)."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from reliable_beat import runs, tracing
from reliable_beat.errors import StaleFenceToken
from reliable_beat.triggers import build_trigger_payload
from tests.memory_spans import exporter  # noqa: F401 (fixture)

SECRET = "UtSecret7c41d9e2"


def test_off_without_a_provider() -> None:
    tracing._reset()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.tracer() is None
    with tracing.span("x") as s:
        assert s is None
    assert tracing.current_traceparent() is None
    assert tracing.BeatTrace.start("celery") is None
    carrier: dict[str, str] = {}
    tracing.inject(carrier)
    assert carrier == {}


def test_off_without_the_api() -> None:
    """With ``opentelemetry`` not importable, the module loads and every call is a no-op."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from reliable_beat import tracing\n"
        "assert tracing.tracer() is None\n"
        "with tracing.span('x') as s: assert s is None\n"
        "with tracing.process_span('t', traceparent=None, system='celery') as s: assert s is None\n"
        "with tracing.completion() as s: assert s is None\n"
        "with tracing.attached('00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'): pass\n"
        "assert tracing.current_traceparent() is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "ok"


def test_error_and_url_redacted(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    with pytest.raises(ConnectionError), tracing.span("body"):
        raise ConnectionError(f"refused https://u:{SECRET}@db.example/x?token={SECRET} "
                              f"password={SECRET}")
    with tracing.span("POST", kind="client", attributes=tracing.http_attributes(
            "POST", f"https://hooks.example/hook/{SECRET}?sig={SECRET}")):
        pass
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["body", "POST"]
    body, post = spans
    assert body.status.status_code == trace.StatusCode.ERROR
    assert body.events[0].name == "exception"
    assert "ConnectionError" in str(body.events[0].attributes)
    assert post.attributes is not None
    assert post.attributes["url.full"].startswith("https://hooks.example/")
    for s in spans:
        text = repr((s.attributes, [e.attributes for e in s.events], s.status.description))
        assert SECRET not in text


def test_attributes_redacted_like_logs(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    attrs = tracing.attributes(key=f"sync?token={SECRET}", entry="e", workflow_id="w:1",
                               workflow_run=2, fence_token=None)
    assert SECRET not in repr(attrs)
    assert attrs["reliable_beat.workflow.id"] == "w:1"
    assert attrs["reliable_beat.workflow.run"] == 2
    assert "reliable_beat.fence_token" not in attrs


def test_an_execution_is_one_span_with_events(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    """The claim and the fenced completion are bare events of the ``process`` span (their
    instants), with the claim's attributes and the outcome set on it: one span per execution
    (a span costs the SDK five times a bare event: four of them were a fifth of a task's
    CPU; an attribute on an event costs more than the event)."""
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    claim = runs.Claim(outcome=runs.ACQUIRED, key="k", run_id=1, fence_token=3, attempt=2,
                      attempt_id=1)
    with tracing.process_span("t", traceparent=tp, system="celery", message_id="m1",
                              queue="q") as process:
        assert process is not None
        assert tracing.current_traceparent() == tracing.traceparent_of(process)
        tracing.claimed(claim, key=f"k?token={SECRET}", entry="e", slot="2026-01-01T00:00:00Z")
        with tracing.completion():
            pass
    [span] = exporter.get_finished_spans()
    assert span.name == "process t" and span.kind == trace.SpanKind.CONSUMER
    assert span.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c
    assert span.parent is not None and span.parent.span_id == 0xb7ad6b7169203331
    assert span.parent.is_remote
    assert [(e.name, dict(e.attributes or {})) for e in span.events] == [
        ("reliable_beat.claim", {}), ("reliable_beat.complete", {})]
    attrs = dict(span.attributes or {})
    assert attrs[tracing.FENCE_TOKEN] == 3 and attrs[tracing.ATTEMPT] == 2
    assert attrs[tracing.ENTRY] == "e" and attrs[tracing.SLOT] == "2026-01-01T00:00:00Z"
    assert attrs[tracing.OUTCOME] == "succeeded"
    assert attrs["messaging.message.id"] == "m1"
    assert attrs["messaging.destination.name"] == "q"
    assert SECRET not in attrs[tracing.KEY]
    assert span.status.status_code == trace.StatusCode.UNSET


def test_a_claim_not_acquired_is_the_executions_outcome(
        exporter: InMemorySpanExporter) -> None:  # noqa: F811
    claim = runs.Claim(outcome=runs.ALREADY_SUCCEEDED, key="k", run_id=1, fence_token=1,
                      attempt=1, attempt_id=1)
    with tracing.process_span("t", traceparent=None, system="celery"):
        tracing.claimed(claim, key="k", entry=None, slot=None)
    [span] = exporter.get_finished_spans()
    assert span.parent is None  # no traceparent: a trace of its own
    assert dict(span.attributes or {})[tracing.OUTCOME] == "already_succeeded"
    assert [e.name for e in span.events] == ["reliable_beat.claim"]


def test_claim_attributes_reach_the_span_when_the_body_fails(
        exporter: InMemorySpanExporter) -> None:  # noqa: F811
    """The ``reliable_beat.*`` attributes an execution's steps found are set as its span ends
    (one call to the SDK): also when the body raises, and on the framework's task span when
    one is current (it ends after the execution)."""
    claim = runs.Claim(outcome=runs.ACQUIRED, key="k", run_id=1, fence_token=4, attempt=3,
                      attempt_id=1)
    with pytest.raises(ValueError), tracing.process_span("t", traceparent=None,
                                                         system="celery"):
        tracing.claimed(claim, key="k", entry="e", slot=None)
        tracing.annotate({tracing.OUTCOME: "retrying"})
        raise ValueError("body failed")
    t = tracing.tracer()
    with t.start_as_current_span("run/t") as framework:
        with tracing.process_span("t", traceparent=None, system="celery") as inner:
            assert inner is None  # no second span: the framework's gets the attributes
            tracing.claimed(claim, key="k2", entry=None, slot=None)
            with tracing.completion():
                pass
        assert dict(framework.attributes or {})[tracing.OUTCOME] == "succeeded"
    failed, wrapped = exporter.get_finished_spans()
    attrs = dict(failed.attributes or {})
    assert (attrs[tracing.KEY], attrs[tracing.ENTRY], attrs[tracing.FENCE_TOKEN],
            attrs[tracing.ATTEMPT], attrs[tracing.OUTCOME]) == ("k", "e", 4, 3, "retrying")
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert [e.name for e in failed.events] == ["reliable_beat.claim", "exception"]
    assert wrapped.name == "run/t"
    attrs = dict(wrapped.attributes or {})
    assert (attrs[tracing.KEY], attrs[tracing.FENCE_TOKEN], attrs[tracing.OUTCOME]) == (
        "k2", 4, "succeeded")
    assert [e.name for e in wrapped.events] == ["reliable_beat.claim", "reliable_beat.complete"]


def test_fenced_out_completion(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    """A zombie's completion: the ``reliable_beat.complete`` event, the span's outcome
    ``fenced_out`` and the execution's span an error, the StaleFenceToken recorded once (not
    again as it leaves the span)."""
    with tracing.process_span("t", traceparent=None, system="celery") as process, \
            pytest.raises(StaleFenceToken), tracing.completion():
        raise StaleFenceToken("k", 3)
    assert process is not None
    [proc] = exporter.get_finished_spans()
    assert proc.attributes is not None
    assert proc.attributes[tracing.OUTCOME] == "fenced_out"
    assert proc.status.status_code == trace.StatusCode.ERROR
    assert "StaleFenceToken" in (proc.status.description or "")
    assert [e.name for e in proc.events] == ["reliable_beat.complete", "exception"]


def test_expected_signal_is_not_an_error(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    """A framework's retry signal leaving the span is an event, not the span's error."""
    class Signal(Exception):
        pass

    with pytest.raises(Signal), tracing.process_span("t", traceparent=None, system="celery",
                                                     expected=(Signal,)):
        raise Signal("again")
    [proc] = exporter.get_finished_spans()
    assert proc.status.status_code == trace.StatusCode.UNSET
    assert [e.name for e in proc.events] == ["exception"]


@pytest.mark.parametrize("tp", [
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-later",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-",
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "not a traceparent",
])
def test_a_traceparent_reads_as_the_w3c_propagator_reads_it(tp: str) -> None:
    ours = trace.get_current_span(tracing._parent(tp)).get_span_context()
    theirs = trace.get_current_span(TraceContextTextMapPropagator().extract(
        {"traceparent": tp})).get_span_context()
    assert ours.is_valid == theirs.is_valid
    if theirs.is_valid:
        assert (ours.trace_id, ours.span_id, ours.trace_flags, ours.is_remote) == (
            theirs.trace_id, theirs.span_id, theirs.trace_flags, theirs.is_remote)


def test_trigger_carries_the_fire_span(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    beat = tracing.BeatTrace.start("celery")
    assert beat is not None
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    tp = beat.fire(entry="e", slot="2026-01-01T00:00:00Z", key="e@2026-01-01T00:00:00Z",
                   task="t", trigger="schedule")
    assert tp is not None
    celery = build_trigger_payload(task="t", args=[], kwargs={}, options={}, key="k",
                                   entry="e", fire_at=at, trigger="schedule", traceparent=tp)
    neutral = build_trigger_payload(task="t", args=[], kwargs={}, options={}, key="k",
                                    entry="e", fire_at=at, trigger="schedule", traceparent=tp,
                                    destination="dramatiq")
    assert celery["headers"]["traceparent"] == tp
    assert neutral["reliable_beat"]["traceparent"] == tp
    beat.end()
    fire, tick = exporter.get_finished_spans()
    assert fire.name == "fire e" and tick.name == "reliable_beat.tick"
    assert fire.parent is None and fire.links[0].context.span_id == tick.context.span_id
    assert tp.split("-")[2] == f"{fire.context.span_id:016x}"


def test_attached_makes_a_traceparent_current(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    """A publish traced by another instrumentation (Celery's ``apply_async`` span) runs in the
    trigger's trace: its context current, no span of ours made."""
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.attached(tp):
        assert tracing.current_traceparent() == tp
        with tracing.span("theirs") as s:
            assert s is not None
    assert tracing.current_traceparent() is None
    with tracing.attached(None), tracing.attached("not a traceparent"):
        assert tracing.current_traceparent() is None
    [theirs] = exporter.get_finished_spans()
    assert theirs.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c
    assert theirs.parent is not None and theirs.parent.span_id == 0xb7ad6b7169203331


def test_add_link_to_a_context_learnt_later(exporter: InMemorySpanExporter) -> None:  # noqa: F811
    """A span links to a traceparent it learns while open (a consumed signal's sender);
    nothing, an invalid one or a value that is not a string (a column edited by SQL) adds
    no link and raises nothing."""
    with tracing.span("sender", root=True) as sender:
        tp = tracing.current_traceparent()
    with tracing.span("receiver", root=True) as s:
        for bad in (None, "", "00-garbage", 12345):
            tracing.add_link(s, bad)  # type: ignore[arg-type]
        tracing.add_link(s, tp)
    tracing.add_link(None, tp)  # tracing off: no span
    [receiver] = [x for x in exporter.get_finished_spans() if x.name == "receiver"]
    assert [(link.context.trace_id, link.context.span_id) for link in receiver.links] == [
        (sender.get_span_context().trace_id, sender.get_span_context().span_id)]
