"""One pool check-out per ``IdempotentTask`` execution (reliable_beat.db.held).

The claim's connection stays checked out for the execution's own transaction (the body's
``self.transaction()``, or the completion after a body that opened none): one check-out
instead of two. What must not move: the claim is committed before the body runs (its lease
is visible to every other runner), the completion is fenced inside the effect's
transaction, and no connection is left checked out after any outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.db import held
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts
from reliable_beat.db.tables import runs as runs_table
from reliable_beat.errors import StaleFenceToken
from reliable_beat.execution import store_for

pytestmark = pytest.mark.postgres

effects = sa.Table(
    "held_effects", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200)),
)


@pytest.fixture
def app(pg_store: Store) -> Iterator[Celery]:
    effects.create(pg_store.engine)
    app = Celery("held", set_as_current=False)
    app.conf.update(broker_url="memory://",
                    reliable_beat_database_url=pg_store.engine.url.render_as_string(False))
    yield app


class _Checkouts:
    def __init__(self, engine: sa.Engine) -> None:
        self.count = 0
        self._engine = engine
        sa.event.listen(engine, "checkout", self._on)

    def _on(self, *_: Any) -> None:
        self.count += 1

    def close(self) -> None:
        sa.event.remove(self._engine, "checkout", self._on)


def _effect_keys(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(effects.c.key).order_by(effects.c.id)).scalars())


def test_an_execution_checks_one_connection_out_and_the_claim_is_committed_first(
    app: Celery, pg_store: Store
) -> None:
    seen: dict[str, Any] = {}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="held.tx")
    def in_tx(self: IdempotentTask) -> None:
        # another runner sees the lease now: the claim committed before the body ran
        seen["run"] = runs.get_run(pg_store, self.idempotency_key)
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="held.after")
    def after(self: IdempotentTask) -> int:
        return 7  # no transaction: the completion runs after the body

    worker = store_for(app.conf.reliable_beat_database_url)
    in_tx.apply(headers={KEY_HEADER: "held:warm"}).get()
    counter = _Checkouts(worker.engine)
    try:
        in_tx.apply(headers={KEY_HEADER: "held:1"}).get()
        assert counter.count == 1  # claim + body's transaction on one check-out (was 2)
        counter.count = 0
        assert after.apply(headers={KEY_HEADER: "held:2"}).get() == 7
        assert counter.count == 1  # claim + completion after the body (was 2)
        counter.count = 0
        in_tx.apply(headers={KEY_HEADER: "held:1"}).get()  # deduplicated: the claim alone
        assert counter.count == 1
    finally:
        counter.close()
    assert seen["run"]["state"] == "running" and seen["run"]["lease_expires_at"] is not None
    assert runs.get_run(pg_store, "held:1")["state"] == "succeeded"
    assert runs.get_run(pg_store, "held:2")["result"] == 7
    assert _effect_keys(pg_store) == ["held:warm", "held:1"]
    assert worker.engine.pool.checkedout() == 0


def test_a_fenced_out_body_on_the_held_connection_rolls_back_and_nothing_stays_checked_out(
    app: Celery, pg_store: Store
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="held.fenced")
    def fenced(self: IdempotentTask) -> None:
        with pg_store.begin() as conn:  # a newer claim moved the fence meanwhile
            conn.execute(sa.update(runs_table)
                         .where(runs_table.c.idempotency_key == self.idempotency_key)
                         .values(fence_token=runs_table.c.fence_token + 1))
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key))

    @app.task(shared=False, base=IdempotentTask, bind=True, name="held.bad")
    def bad(self: IdempotentTask) -> None:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key))
            raise ValueError("permanent")  # dead letter, effect rolled back

    worker = store_for(app.conf.reliable_beat_database_url)
    with pytest.raises(StaleFenceToken):
        fenced.apply(headers={KEY_HEADER: "held:fenced"}).get()
    with pytest.raises(ValueError):
        bad.apply(headers={KEY_HEADER: "held:bad"}).get()
    assert _effect_keys(pg_store) == []
    assert runs.get_run(pg_store, "held:bad")["state"] == "dead"
    with pg_store.engine.connect() as conn:
        outcomes = list(conn.execute(
            sa.select(attempts.c.outcome).join(runs_table, runs_table.c.id == attempts.c.run_id)
            .where(runs_table.c.idempotency_key == "held:fenced")).scalars())
    assert outcomes == ["fenced_out"]
    assert worker.engine.pool.checkedout() == 0
    assert held.current() is None


def test_a_connection_held_past_the_ping_window_goes_back_to_the_pool(
    app: Celery, pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body longer than the worker's ping-after-idle window: its transaction takes a
    connection from the pool (pinged there when it sat too long), not the held one."""
    monkeypatch.setattr(held, "_FRESH_SECONDS", 0.0)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="held.slow")
    def slow(self: IdempotentTask) -> None:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key))

    worker = store_for(app.conf.reliable_beat_database_url)
    slow.apply(headers={KEY_HEADER: "held:warm"}).get()
    counter = _Checkouts(worker.engine)
    try:
        slow.apply(headers={KEY_HEADER: "held:slow"}).get()
        assert counter.count == 2
    finally:
        counter.close()
    assert _effect_keys(pg_store) == ["held:warm", "held:slow"]
    assert worker.engine.pool.checkedout() == 0


def test_nothing_is_held_when_the_pool_has_no_room(pg_store: Store) -> None:
    store = Store.from_url(pg_store.url, role="worker")
    size = store.engine.pool.size()  # type: ignore[attr-defined]
    try:
        taken = [store.engine.connect() for _ in range(size - 1)]
        with held.holding() as slot:
            assert slot.take(store) is None  # would leave no pooled connection for others
        for conn in taken[1:]:
            conn.close()
        with held.holding() as slot:
            assert slot.take(store) is not None
            assert store.engine.pool.checkedout() == 2  # type: ignore[attr-defined]
        assert store.engine.pool.checkedout() == 1  # type: ignore[attr-defined]
        taken[0].close()
    finally:
        store.dispose()
