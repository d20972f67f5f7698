"""A workflow's trace: its start span stored with it, every advance, timer firing, signal (sent
and received) and every compensation of its saga a span of that one trace (SQLite and
MariaDB, the in-process driver)."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from reliable_beat import tracing
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflow_signals
from reliable_beat.workflows import WorkflowContext, WorkflowFailed, engine, signal, workflow
from tests.memory_spans import exporter  # noqa: F401 (fixture)
from tests.unit.test_workflow_sagas import app, drain, store  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver


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
    # one `compensate <activity>` span per compensation, each the parent of its activity
    compensate = [s for s in in_trace if s.name == "compensate saga.undo"]
    assert len(compensate) == 3
    assert sorted(s.attributes[tracing.SEQ] for s in compensate  # type: ignore[index]
                  ) == [1, 3, 5]
    assert {s.attributes[tracing.OUTCOME] for s in compensate  # type: ignore[index]
            } == {"scheduled"}
    assert all(s.parent is not None and s.parent.span_id in {a.context.span_id
                                                            for a in advances}
               for s in compensate)
    keys = {s.attributes[tracing.KEY]: s for s in compensate}  # type: ignore[index]
    assert all(k.startswith("wf:o1/") for k in keys)
    by_id = {s.context.span_id: s for s in spans}
    for u in undo:  # the undo's `process` span is under its compensation's span (via deliver)
        up = u
        while up.parent is not None and up.name != "compensate saga.undo":
            up = by_id[up.parent.span_id]
        assert up.name == "compensate saga.undo", u
        assert u.attributes is not None
        assert up.attributes is not None
        assert u.attributes[tracing.KEY] == up.attributes[tracing.KEY]
        assert u.attributes[tracing.OUTCOME] == "succeeded"


def nap_then_wait(ctx: WorkflowContext, order: str) -> object:
    ctx.sleep(timedelta(milliseconds=300))
    first = ctx.wait_signal("go")
    late = ctx.wait_signal("late", timeout=timedelta(milliseconds=300))
    return [first, late]


def test_timer_and_signals_in_the_workflow_trace(
    app: Celery, store: Store, exporter: InMemorySpanExporter  # noqa: F811
) -> None:
    """A timer's firing is a `timer` span of the advance it wakes; `signal()` is a `signal
    <name>` span in the workflow's trace (linked to the sender's span); the advance that
    consumes it has a `receive signal <name>` span (`consumed`; a wait that timed out:
    `timed_out`)."""
    workflow(name="t.nap")(nap_then_wait)
    handle = engine.start(store, "t.nap", "n1", ["n1"])
    driver = Driver(store, app)
    drain(driver)
    spans = exporter.get_finished_spans()
    start = next(s for s in spans if s.name == "start workflow t.nap")
    trace_id = start.context.trace_id
    advances = {s.context.span_id: s for s in spans if s.name == "advance workflow t.nap"}
    [timer] = [s for s in spans if s.name == "timer"]
    assert timer.context.trace_id == trace_id
    assert timer.parent is not None and timer.parent.span_id in advances
    assert timer.attributes == {tracing.SEQ: 1, tracing.OUTCOME: "fired"}
    [waiting] = [s for s in spans if s.name == "receive signal go"]
    assert waiting.attributes is not None
    assert waiting.attributes[tracing.OUTCOME] == "waiting"

    exporter.clear()
    with tracing.span("web request", root=True) as sender:
        assert signal(store, "n1", "go", {"ok": 1}) is True
    with store.begin() as conn:  # in the caller's transaction
        assert signal(conn, "n1", "go", {"ok": 1}, key="k1") is True
    assert signal(store, "n1", "go", {"ok": 1}, key="k1") is False
    drain(driver)
    assert handle.result(timeout=5) == [{"ok": 1}, None]
    spans = exporter.get_finished_spans()
    sent = [s for s in spans if s.name == "signal go"]
    assert [s.attributes[tracing.OUTCOME] for s in sent  # type: ignore[index]
            ] == ["stored", "stored", "duplicate"]
    assert {s.context.trace_id for s in sent} == {trace_id}
    assert all(s.parent is not None and s.parent.span_id == start.context.span_id
               for s in sent)
    assert sent[0].attributes is not None
    assert sent[0].attributes[tracing.WORKFLOW_ID] == "n1"
    assert [link.context.span_id for link in sent[0].links] == [sender.context.span_id]
    received = [s for s in spans if s.name == "receive signal go"]
    assert [s.attributes[tracing.OUTCOME] for s in received  # type: ignore[index]
            ] == ["consumed"]
    advances = {s.context.span_id: s for s in spans if s.name == "advance workflow t.nap"}
    assert received[0].parent is not None and received[0].parent.span_id in advances
    late = [s.attributes[tracing.OUTCOME] for s in spans  # type: ignore[index]
            if s.name == "receive signal late"]
    assert late == ["waiting", "timed_out"]
    # the wake a signal writes is delivered in the workflow's trace, under the signal's span
    assert all(s.context.trace_id == trace_id for s in spans
               if s.name.startswith(("advance ", "receive ", "timer")))


def wait_thrice(ctx: WorkflowContext, order: str) -> object:
    return [ctx.wait_signal("go"), ctx.wait_signal("go"), ctx.wait_signal("go")]


@pytest.mark.parametrize("wf_dialect_store", [
    "sqlite",
    pytest.param("pg", marks=pytest.mark.postgres),  # the INSERT ... RETURNING path
    pytest.param("mariadb", marks=pytest.mark.mariadb),
], indirect=True)
def test_receive_signal_links_to_the_span_that_sent_it(
    app: Celery, store: Store, exporter: InMemorySpanExporter  # noqa: F811
) -> None:
    """The signal row keeps the traceparent of its `signal <name>` span (itself linked to the
    sender's span), so the advance's `receive signal <name>` span links to it (a wait parked
    before the signal came, and one that finds it in the inbox); a signal stored untraced
    (NULL, as every row before 0019_signaltrace) is consumed with no link."""
    workflow(name="t.thrice")(wait_thrice)
    handle = engine.start(store, "t.thrice", "w1", ["w1"])
    driver = Driver(store, app)
    drain(driver)
    with tracing.span("web request", root=True) as sender:
        assert signal(store, "w1", "go", 1) is True
        assert signal(store, "w1", "go", 2) is True
    on = tracing._tracer
    tracing._tracer = None  # tracing off: the row's traceparent stays NULL
    try:
        assert signal(store, "w1", "go", 3) is True
    finally:
        tracing._tracer = on
    with store.connect() as conn:
        stored = [r.traceparent for r in conn.execute(
            select(workflow_signals.c.traceparent).order_by(workflow_signals.c.id))]
    sent = [s for s in exporter.get_finished_spans() if s.name == "signal go"]
    assert stored == [*(tracing.traceparent_of(s) for s in sent), None]
    drain(driver)
    assert handle.result(timeout=5) == [1, 2, 3]
    spans = exporter.get_finished_spans()
    consumed = [s for s in spans if s.name == "receive signal go"
                and s.attributes is not None and s.attributes[tracing.OUTCOME] == "consumed"]
    assert len(consumed) == 3, [(s.name, s.attributes) for s in spans]
    for receive, signalled in zip(consumed, sent, strict=False):
        assert [(link.context.trace_id, link.context.span_id) for link in receive.links] == [
            (signalled.context.trace_id, signalled.context.span_id)]
        # ... and that span's own link is the sender's: receive -> signal -> web request
        assert [link.context.span_id for link in signalled.links] == [sender.context.span_id]
    assert list(consumed[2].links) == []
