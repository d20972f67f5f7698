"""`upgrade head` on an empty database yields exactly the declared tables, on both dialects."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import exists_on, metadata


def test_upgrade_creates_exactly_the_declared_schema(store: Store) -> None:
    insp = sa.inspect(store.engine)
    tables = set(insp.get_table_names())
    assert tables == {t.name for t in metadata.sorted_tables} | {migrate.VERSION_TABLE}
    for table in metadata.sorted_tables:
        cols = {c["name"] for c in insp.get_columns(table.name)}
        assert cols == {c.name for c in table.columns}, table.name
        idx = {i["name"] for i in insp.get_indexes(table.name)}
        declared = {i.name for i in table.indexes if exists_on(i, store.dialect)}
        assert declared <= idx, table.name
        other_dialects = {i.name for i in table.indexes} - declared
        assert not other_dialects & idx, table.name
    assert migrate.check(store)
    assert migrate.current(store) == migrate.head()


def test_autogenerate_finds_no_drift(store: Store) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={
            "version_table": migrate.VERSION_TABLE,
            "include_object": lambda obj, name, type_, reflected, compare_to: (
                reflected or exists_on(obj, store.dialect)),
        })
        diff = [
            d
            for d in compare_metadata(ctx, metadata)
            if not (isinstance(d, tuple) and d[0] == "remove_table")
        ]
    assert diff == []


def test_check_is_false_on_empty_database_and_ensure_refuses_server(pg_url: str) -> None:
    import pytest

    from reliable_beat.errors import SchemaError

    store = Store.from_url(pg_url)
    try:
        assert migrate.current(store) is None
        assert not migrate.check(store)
        with pytest.raises(SchemaError, match="reliable-beat db upgrade"):
            migrate.ensure_schema(store, run_migrations=False)
        migrate.ensure_schema(store, run_migrations=True)
        assert migrate.check(store)
    finally:
        store.dispose()


@pytest.mark.parametrize("url_fixture", ["pg_url", "mariadb_url"])
def test_concurrent_upgrades_do_not_conflict(url_fixture: str,
                                             request: pytest.FixtureRequest) -> None:
    import threading

    pg_url = request.getfixturevalue(url_fixture)

    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def go() -> None:
        s = Store.from_url(pg_url)
        try:
            barrier.wait()
            migrate.upgrade(s)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            s.dispose()

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = Store.from_url(pg_url)
    assert migrate.check(s)
    s.dispose()


def test_mariadb_upgrader_after_the_lock_reads_the_committed_revision(mariadb_url: str) -> None:
    """The named lock is released only after the commit: the last revision's version UPDATE
    is not committed by any later DDL, so a second upgrader taking the lock in between would
    read the previous revision and apply the last one again (``Duplicate column name``).
    The first upgrader pauses right after its RELEASE_LOCK to hold that window open."""
    import threading
    import time

    first, second = Store.from_url(mariadb_url), Store.from_url(mariadb_url)
    locked = threading.Event()

    def after(conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
        if "GET_LOCK" in statement and "RELEASE" not in statement:
            locked.set()
        if "RELEASE_LOCK" in statement:
            time.sleep(1.5)

    sa.event.listen(first.engine, "after_cursor_execute", after)
    errors: list[BaseException] = []

    def run_first() -> None:
        try:
            migrate.upgrade(first, "0017_wfrunaway")
            migrate.upgrade(first)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        migrate.upgrade(second, "0017_wfrunaway")
        locked.clear()
        t = threading.Thread(target=run_first)
        t.start()
        assert locked.wait(30)
        locked.clear()
        assert locked.wait(30)  # the second call (to head) holds the lock now
        migrate.upgrade(second)
        t.join()
        assert errors == []
        assert migrate.check(second)
    finally:
        first.dispose()
        second.dispose()


def test_offline_sql_mentions_every_table() -> None:
    sql = migrate.upgrade_sql("postgresql+psycopg://u@localhost/db")
    for table in metadata.sorted_tables:
        assert f"CREATE TABLE {table.name}" in sql
    assert migrate.VERSION_TABLE in sql


def test_newer_schema_revision_is_tolerated(sqlite_store: Store) -> None:
    """Expand/contract: an older process keeps running after a newer release upgraded."""
    import sqlalchemy as sa

    with sqlite_store.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'f00dfeed'"))
    migrate.ensure_schema(sqlite_store, run_migrations=False)  # no SchemaError
    assert migrate.current(sqlite_store) == "f00dfeed"
    assert not migrate.check(sqlite_store)
