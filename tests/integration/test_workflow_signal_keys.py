"""A signal's dedup key deduplicates per workflow, on SQLite, PostgreSQL and MariaDB.

Two workflows may use the same key (``approve`` for each order); the same key re-sent to one
workflow is stored once, and a re-send with another payload is named in a WARNING (the new
payload is not stored). A store whose schema predates ``0016_signalkey`` (one key per store)
refuses a key another workflow holds, naming both, instead of answering False (read as
"already delivered" while the signal was dropped); the migration keeps existing rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflow_signals, workflows
from reliable_beat.outbox import db_now
from reliable_beat.workflows import WorkflowConflict, engine, signal

BEFORE = "0012_wfsweep"  # the schema with one dedup key per store


def _signals(store: Store) -> list[tuple[str, str, object, str | None]]:
    with store.connect() as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            sa.select(workflows.c.workflow_id, workflow_signals.c.name,
                      workflow_signals.c.payload, workflow_signals.c.dedup_key)
            .join(workflows, workflows.c.id == workflow_signals.c.workflow_pk)
            .order_by(workflow_signals.c.id))]


def test_a_key_deduplicates_per_workflow(store: Store, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    engine.start(store, "t.keyed", "order:A")
    engine.start(store, "t.keyed", "order:B")
    assert signal(store, "order:A", "go", 1, key="approve") is True
    assert signal(store, "order:B", "go", 2, key="approve") is True  # another workflow
    with caplog.at_level("WARNING", logger="reliable_beat.workflows"):
        assert signal(store, "order:A", "go", 1, key="approve") is False  # a retry
        assert not caplog.records
        with store.begin() as tx:  # the caller's transaction: the same answer
            assert signal(tx, "order:B", "go", 2, key="approve") is False
        assert not caplog.records
        # the same key with another payload: not stored, and said
        assert signal(store, "order:A", "go", 3, key="approve") is False
    assert _signals(store) == [("order:A", "go", 1, "approve"),
                               ("order:B", "go", 2, "approve")]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "order:A" in warning and "'approve'" in warning and "not stored" in warning
    # a key is the workflow's, whatever the signal's name
    assert signal(store, "order:B", "other", 2, key="approve") is False
    assert signal(store, "order:B", "other", 2, key="approve:other") is True


@pytest.fixture(params=["sqlite", "postgresql",
                        pytest.param("mariadb", marks=pytest.mark.mariadb)])
def old_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A store migrated to the schema before per-workflow keys."""
    url = (request.getfixturevalue("sqlite_url") if request.param == "sqlite"
           else request.getfixturevalue("pg_url" if request.param == "postgresql"
                                        else "mariadb_url"))
    store = Store.from_url(url, role="cli")
    migrate.upgrade(store, BEFORE)
    yield store
    store.dispose()


def test_old_schema_refuses_a_key_of_another_workflow_and_the_upgrade_keeps_the_rows(
        old_store: Store) -> None:
    store = old_store
    engine.start(store, "t.keyed", "order:A")
    engine.start(store, "t.keyed", "order:B")
    assert signal(store, "order:A", "go", 1, key="approve") is True
    assert signal(store, "order:A", "go", None, key=None) is True  # keyless rows stay too
    with pytest.raises(WorkflowConflict) as err:
        signal(store, "order:B", "go", 2, key="approve")
    message = str(err.value)
    assert "'order:A'" in message and "'order:B'" in message and "'approve'" in message
    assert "reliable-beat db upgrade" in message
    assert _signals(store) == [("order:A", "go", 1, "approve"), ("order:A", "go", None, None)]

    migrate.upgrade(store)  # with the rows in place
    assert migrate.check(store)
    assert _signals(store) == [("order:A", "go", 1, "approve"), ("order:A", "go", None, None)]
    assert signal(store, "order:B", "go", 2, key="approve") is True
    assert signal(store, "order:A", "go", 1, key="approve") is False
    assert signal(store, "order:B", "go", 2, key="approve") is False
    assert [s[0] for s in _signals(store)] == ["order:A", "order:A", "order:B"]
    with store.begin() as conn:  # the database itself holds the rule: one key per workflow
        pk_a = conn.execute(sa.select(workflows.c.id)
                            .where(workflows.c.workflow_id == "order:A")).scalar_one()
    with pytest.raises(sa.exc.IntegrityError), store.begin() as conn:
        conn.execute(workflow_signals.insert().values(
            workflow_pk=pk_a, name="go", payload=9, dedup_key="approve",
            created_at=db_now(conn)))
