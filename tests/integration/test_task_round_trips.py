"""What one ``IdempotentTask`` execution costs in database round trips (issue 20).

A fresh key's execution on PostgreSQL is: the claim (one statement, autocommit), then the
body's transaction (``BEGIN``, the effect, the fenced completion, ``COMMIT``). The worker's
pool pings a connection only when it sat idle in the pool (``PING_AFTER_IDLE_SECONDS``), so
the two checkouts of a busy worker's execution add no ``SELECT 1`` round trips; before,
every checkout pinged (7 round trips per execution; 5 now).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.exc import DataError, OperationalError

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.db import dialects
from reliable_beat.db.dialects import Store
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.execution import store_for

effects = sa.Table(
    "rt_effects", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200)),
)


@pytest.fixture
def app(pg_store: Store) -> Iterator[Celery]:
    effects.create(pg_store.engine)
    app = Celery("round_trips", set_as_current=False)
    app.conf.update(broker_url="memory://",
                    reliable_beat_database_url=pg_store.engine.url.render_as_string(False))
    yield app


class _Counter:
    """Statements sent through SQLAlchemy and pings of the worker store's engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.statements: list[str] = []
        self.pings = 0
        self._engine = engine
        self._ping = engine.dialect.do_ping
        sa.event.listen(engine, "before_cursor_execute", self._on_execute)

        def ping(dbapi_conn: Any) -> bool:
            self.pings += 1
            return bool(self._ping(dbapi_conn))

        engine.dialect.do_ping = ping  # type: ignore[method-assign]

    def _on_execute(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.statements.append(statement.split(None, 1)[0].upper())

    def reset(self) -> None:
        self.statements.clear()
        self.pings = 0

    def close(self) -> None:
        sa.event.remove(self._engine, "before_cursor_execute", self._on_execute)
        self._engine.dialect.do_ping = self._ping  # type: ignore[method-assign]


def test_a_fresh_key_costs_three_statements_and_no_ping(app: Celery, pg_store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="rt.effect")
    def effect(self: IdempotentTask, i: int) -> None:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key))

    worker_store = store_for(app.conf.reliable_beat_database_url)
    counter = _Counter(worker_store.engine)
    try:
        effect.apply((0,), headers={KEY_HEADER: "rt:0"}).get()  # warm: connect, ping
        counter.reset()
        effect.apply((1,), headers={KEY_HEADER: "rt:1"}).get()
        # claim (WITH ... INSERT/UPDATE ... RETURNING), the effect, the fenced completion
        assert counter.statements == ["WITH", "INSERT", "WITH"], counter.statements
        # the connection came back to the pool a moment ago: not pinged again (was 2)
        assert counter.pings == 0
        assert runs.get_run(pg_store, "rt:1")["state"] == "succeeded"
        counter.reset()
        # a deduplicated replay is the claim statement alone
        effect.apply((1,), headers={KEY_HEADER: "rt:1"}).get()
        assert counter.statements == ["WITH"] and counter.pings == 0
    finally:
        counter.close()
    with pg_store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar() == 2


def test_a_connection_idle_past_the_window_is_pinged_and_replaced_when_dead(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ping is skipped only for a connection used a moment ago: one that sat in the
    pool longer is pinged, and a dead one is replaced before anyone uses it."""
    monkeypatch.setitem(dialects.PING_AFTER_IDLE_SECONDS, "worker", 0.3)
    store = Store.from_url(pg_store.url, role="worker")
    try:
        with store.connect() as conn:
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with pg_store.engine.connect() as admin:
            admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            admin.commit()
        time.sleep(0.6)  # past the window: the checkout pings, finds it dead, reconnects
        with store.begin() as conn:
            again = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        assert again != pid
    finally:
        store.dispose()


def test_the_claim_never_pools_a_connection_in_autocommit(pg_store: Store) -> None:
    """The one-statement claim runs in autocommit (its own transaction, invariant 6) by
    setting the driver connection's flag; the flag is cleared before the connection goes
    back to the pool, after a claim, after a refused claim and after a lost connection, so
    the next body's effect and completion commit together (invariant 5)."""
    effects.create(pg_store.engine, checkfirst=True)
    store = Store.from_url(pg_store.url, role="worker")
    lease = timedelta(seconds=30)

    def pooled_autocommit() -> bool:
        with store.connect() as conn:
            return bool(conn.connection.dbapi_connection.autocommit)

    try:
        claim = runs.claim_run(store, "ac:1", owner="t", lease=lease, task="t")
        assert claim.outcome == runs.ACQUIRED
        assert pooled_autocommit() is False
        with pytest.raises(DataError):  # the key is longer than the column: refused
            runs.claim_run(store, "ac:" + "x" * 1000, owner="t", lease=lease, task="t")
        assert pooled_autocommit() is False
        with store.connect() as conn:
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with pg_store.engine.connect() as admin:
            admin.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            admin.commit()
        with pytest.raises((OperationalError, StoreUnavailableError)):
            runs.claim_run(store, "ac:2", owner="t", lease=lease, task="t")
        assert runs.claim_run(store, "ac:2", owner="t", lease=lease, task="t").acquired
        assert pooled_autocommit() is False
        # and a transaction on the pooled connection is one: a failure undoes its writes
        with pytest.raises(RuntimeError), store.begin() as conn:
            conn.execute(effects.insert().values(key="ac:undone"))
            raise RuntimeError("rolled back")
        with store.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(effects).where(
                effects.c.key == "ac:undone")).scalar() == 0
    finally:
        store.dispose()
