"""Shared fixtures: a real PostgreSQL and a real Redis, started by the test session.

Servers come from ``RELIABLE_BEAT_TEST_POSTGRES_URL`` / ``RELIABLE_BEAT_TEST_REDIS_URL`` when
set, else are started from the local binaries (:mod:`reliable_beat.testing.servers`).
Locally, a missing binary skips the tests that need it, with the reason; with ``CI=true`` it
fails them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.testing.servers import PostgresServer, RedisServer

pytest_plugins = ("celery.contrib.pytest",)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SHARED_CASES = Path(__file__).resolve().parents[2] / "shared" / "cases"


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of the superuser's database on a real PostgreSQL (session-wide)."""
    url = os.environ.get("RELIABLE_BEAT_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    try:
        server = PostgresServer()
        server.__enter__()
    except (FileNotFoundError, OSError) as exc:
        _unavailable(f"PostgreSQL not available: {exc}")
        return
    try:
        yield server.url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server (session-wide)."""
    url = os.environ.get("RELIABLE_BEAT_TEST_REDIS_URL")
    if url:
        yield url
        return
    try:
        server = RedisServer()
        server.__enter__()
    except (FileNotFoundError, OSError) as exc:
        _unavailable(f"Redis not available: {exc}")
        return
    try:
        yield server.url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def pg_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = sa.engine.make_url(postgres_server).set(database=name).render_as_string(False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"
                ),
                {"n": name},
            )
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file URL in the test's temp dir."""
    return f"sqlite:///{tmp_path / 'rb.sqlite3'}"


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[Store]:
    """A migrated PostgreSQL store."""
    store = Store.from_url(pg_url, role="cli")
    upgrade(store)
    yield store
    store.dispose()


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[Store]:
    """A migrated SQLite store."""
    store = Store.from_url(sqlite_url, role="cli")
    upgrade(store)
    yield store
    store.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """The same test on a migrated SQLite store and a migrated PostgreSQL store."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_store")
    else:
        yield request.getfixturevalue("pg_store")
