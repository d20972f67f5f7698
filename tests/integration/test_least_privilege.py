"""Beat, worker and relay need only DML on the reliable_beat_* tables; migrations need DDL.

A role with SELECT/INSERT/UPDATE/DELETE (and sequence USAGE) but no CREATE runs a real
``ReliableScheduler`` tick, an ``IdempotentTask`` and a relay cycle. The same role is refused
``reliable-beat db upgrade``-style DDL, so the test proves the role really lacks it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, outbox, runs
from reliable_beat.relay import Relay

GRANTS = """
CREATE ROLE rb_app LOGIN;
GRANT CONNECT ON DATABASE {db} TO rb_app;
GRANT USAGE ON SCHEMA public TO rb_app;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO rb_app;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO rb_app;
"""


@pytest.fixture
def app_url(pg_store: Store, pg_url: str) -> Iterator[str]:
    """A URL for role ``rb_app`` (DML only) on the migrated database."""
    db = sa.engine.make_url(pg_url).database
    with pg_store.engine.begin() as conn:
        conn.execute(sa.text("DROP ROLE IF EXISTS rb_app"))  # left by an earlier run
    with pg_store.engine.begin() as conn:
        for stmt in GRANTS.format(db=db).strip().split(";\n"):
            conn.execute(sa.text(stmt.strip().rstrip(";")))
    url = sa.engine.make_url(pg_url).set(username="rb_app").render_as_string(False)
    yield url
    pg_store.dispose()
    with pg_store.engine.begin() as conn:
        conn.execute(sa.text("DROP OWNED BY rb_app"))
        conn.execute(sa.text("DROP ROLE rb_app"))


def test_beat_worker_and_relay_run_without_ddl_rights(app_url: str) -> None:
    store = Store.from_url(app_url)
    with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), store.begin() as c:
        c.execute(sa.text("CREATE TABLE rb_should_fail (id int)"))

    app = Celery("lp", broker="memory://")
    app.conf.update(
        reliable_beat_database_url=app_url,
        beat_schedule={"every-second": {"task": "lp.pay", "schedule": timedelta(seconds=1)}},
        task_always_eager=False,
        # one tick, one run: a slow first claim on a loaded machine would also claim the
        # next slot ahead (tests/integration/test_scheduler_hold.py covers that path)
        reliable_beat_claim_ahead_seconds=0,
    )

    @app.task(shared=False, base=IdempotentTask, bind=True, name="lp.pay")
    def pay(self: IdempotentTask) -> str:
        with self.transaction() as tx:
            tx.execute(sa.select(sa.literal(1)))
            self.outbox.add(tx, "celery", {"task": "lp.noop", "args": [], "kwargs": {}})
        return "paid"

    from reliable_beat.celery.scheduler import ReliableScheduler

    scheduler = ReliableScheduler(app=app)  # checks the schema, syncs beat_schedule
    try:
        with store.begin() as conn:  # make the entry due now
            conn.execute(sa.text("UPDATE reliable_beat_entries SET next_fire_at = now()"))
        scheduler.tick()
    finally:
        scheduler.close()
    with store.engine.connect() as conn:
        run = conn.execute(sa.select(runs)).one()
    assert run.state == "dispatched"

    result = pay.apply(headers={"reliable_beat_key": run.idempotency_key})  # the worker side
    assert result.get() == "paid"
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(runs.c.state)).scalar_one() == "succeeded"
        assert conn.execute(sa.select(attempts.c.outcome)).scalar_one() == "succeeded"

    relay = Relay(store, app)
    relay.run_once()  # publishes the task's outbox message through the memory broker
    relay.close()
    with store.engine.connect() as conn:
        states = conn.execute(
            sa.select(outbox.c.state).where(outbox.c.destination == "celery")
        ).scalars().all()
    assert states and set(states) == {"sent"}
    store.dispose()
