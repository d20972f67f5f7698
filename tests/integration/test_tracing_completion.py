"""The fenced completion's ``reliable_beat.complete`` event on the execution's ``process`` span
on every path of the body's transaction: the store's own (``self.transaction()``), ``bind=`` an
Engine, a Connection (a transaction begun here, or the caller's joined), ``session=``, and
Dramatiq's ``current().transaction()``; a fenced-out completion on a joined path shows
``fenced_out``. One execution is one span: the claim and the completion are its events.
Celery in process (``apply``) and Dramatiq's ``StubBroker`` with a real ``Worker``, on SQLite.
(Django's ``using=`` path: tests/django/test_tracing_join.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sqlalchemy.orm import Session

from reliable_beat import runs, tracing
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.errors import StaleFenceToken
from tests.integration.test_dramatiq_core import stub  # noqa: F401 (fixture)
from tests.memory_spans import exporter  # noqa: F401 (fixture)

effects = sa.Table("traced_effects", sa.MetaData(),
                   sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
                   sa.Column("key", sa.String(200)))


@pytest.fixture
def app(sqlite_store: Store) -> Celery:
    effects.create(sqlite_store.engine)
    app = Celery("traced", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_lease_seconds=5,
                    reliable_beat_database_url=sqlite_store.engine.url.render_as_string(
                        hide_password=False))
    return app


def _process(spans: InMemorySpanExporter, key: str) -> ReadableSpan:
    """The one ``process`` span of the execution of ``key``."""
    [found] = [s for s in spans.get_finished_spans() if s.name.startswith("process ")
               and (s.attributes or {}).get(tracing.KEY) == key]
    return found


def _completions(span: ReadableSpan) -> list[str]:
    """The span's outcome once per ``reliable_beat.complete`` event (a bare event: its instant;
    the outcome is the span's)."""
    assert all(not e.attributes for e in span.events if e.name.startswith("reliable_beat."))
    return [str((span.attributes or {}).get(tracing.OUTCOME)) for e in span.events
            if e.name == "reliable_beat.complete"]


MODES = ["store", "engine", "connection", "joined", "session"]


@pytest.mark.parametrize("mode", MODES)
def test_every_transaction_path_has_the_completion_event(
    mode: str, app: Celery, sqlite_store: Store, exporter: InMemorySpanExporter,  # noqa: F811
) -> None:
    engine = sqlite_store.engine

    @app.task(shared=False, base=IdempotentTask, bind=True, name=f"traced.{mode}")
    def body(self: IdempotentTask) -> None:
        if mode == "store":
            with self.transaction() as tx:
                tx.execute(effects.insert().values(key=self.idempotency_key))
        elif mode == "engine":
            with self.transaction(bind=engine) as tx:
                tx.execute(effects.insert().values(key=self.idempotency_key))
        elif mode == "connection":
            with engine.connect() as conn, self.transaction(bind=conn) as tx:
                tx.execute(effects.insert().values(key=self.idempotency_key))
        elif mode == "joined":
            with engine.connect() as conn, conn.begin(), self.transaction(bind=conn) as tx:
                tx.execute(effects.insert().values(key=self.idempotency_key))
        else:
            with Session(engine) as session, self.transaction(session=session) as tx:
                tx.execute(effects.insert().values(key=self.idempotency_key))

    key = f"c:{mode}"
    res = body.apply(headers={KEY_HEADER: key})
    assert res.successful(), res.traceback
    assert runs.get_run(sqlite_store, key)["state"] == "succeeded"
    process = _process(exporter, key)
    assert _completions(process) == ["succeeded"]
    assert [e.name for e in process.events] == ["reliable_beat.claim", "reliable_beat.complete"]
    assert process.attributes is not None
    assert process.attributes[tracing.OUTCOME] == "succeeded"
    assert process.attributes[tracing.FENCE_TOKEN] == 1
    assert process.attributes[tracing.ATTEMPT] == 1
    # the execution is this one span: no span of its own for the claim, body or completion
    assert [s.name for s in exporter.get_finished_spans()] == [f"process {body.name}"]


def test_a_fenced_out_session_completion_is_visible(
    app: Celery, sqlite_store: Store, exporter: InMemorySpanExporter,  # noqa: F811
) -> None:
    """A zombie on the ``session=`` path: its completion says ``fenced_out``, and its span is
    an error."""
    @app.task(shared=False, base=IdempotentTask, bind=True, name="traced.zombie")
    def zombie(self: IdempotentTask) -> None:
        with sqlite_store.engine.begin() as other:  # a newer runner takes the run over
            other.execute(sa.text("UPDATE reliable_beat_runs SET fence_token = "
                                  "fence_token + 1 WHERE idempotency_key = 'c:zombie'"))
        with Session(sqlite_store.engine) as session, \
                self.transaction(session=session) as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key))

    res = zombie.apply(headers={KEY_HEADER: "c:zombie"})
    assert isinstance(res.result, StaleFenceToken)
    process = _process(exporter, "c:zombie")
    assert _completions(process) == ["fenced_out"]
    assert process.attributes is not None
    assert process.attributes[tracing.OUTCOME] == "fenced_out"
    assert process.status.status_code == StatusCode.ERROR


def test_dramatiq_transaction_has_the_completion_event(
    stub: Any, sqlite_store: Store, exporter: InMemorySpanExporter,  # noqa: F811
) -> None:
    import dramatiq

    from reliable_beat.dramatiq import IdempotentActor, current

    effects.create(sqlite_store.engine)

    @dramatiq.actor(actor_class=IdempotentActor, idempotency_key=lambda n: f"dq:{n}")
    def traced_act(n: int) -> None:
        with current().transaction() as tx:
            tx.execute(effects.insert().values(key=f"dq:{n}"))

    traced_act.send(1)
    stub.join(traced_act.queue_name, fail_fast=True)
    assert runs.get_run(sqlite_store, "dq:1")["state"] == "succeeded"
    process = _process(exporter, "dq:1")
    assert process.name == "process traced_act"
    assert _completions(process) == ["succeeded"]
    assert process.attributes is not None
    assert process.attributes[tracing.OUTCOME] == "succeeded"
