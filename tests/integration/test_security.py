"""Nothing exposed by default, nothing secret in errors: metrics bind and idle clients, the
SQLite file mode, a store in its own PostgreSQL schema, lock timeouts, bound parameters."""

from __future__ import annotations

import os
import socket
import stat
import urllib.request
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import entries
from reliable_beat.errors import StoreUnavailableError

SECRET = "ArgLEAK7731"


def test_metrics_server_binds_loopback_and_an_idle_connection_does_not_block_scrapes(
    sqlite_store: Store,
) -> None:
    pytest.importorskip("prometheus_client")
    from reliable_beat.metrics import serve

    server = serve(0, sqlite_store)
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        assert server.server.server_address[0] == "127.0.0.1"
        idle.sendall(b"GET /metr")  # a client that sends half a request line and stalls
        for _ in range(3):
            with urllib.request.urlopen(
                f"http://127.0.0.1:{server.port}/metrics", timeout=5
            ) as resp:
                assert b"reliable_beat_up 1.0" in resp.read()
    finally:
        idle.close()
        server.stop()


def test_metrics_in_a_fresh_process_without_the_cli(sqlite_store: Store) -> None:
    """An application serving metrics from its own process (no CLI module imported first)
    reads the store: old code imported the CLI's status module from the collector, which hit
    an import cycle and reported reliable_beat_up 0 on every scrape."""
    pytest.importorskip("prometheus_client")
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from prometheus_client import generate_latest\n"
        "from reliable_beat.db.dialects import Store\n"
        "from reliable_beat.metrics import make_registry\n"
        "out = generate_latest(make_registry(Store.from_url(sys.argv[1]))).decode()\n"
        "assert not [m for m in sys.modules if m.startswith('reliable_beat.cli')], 'cli'\n"
        "print([line for line in out.splitlines() if line.startswith('reliable_beat_up')])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, sqlite_store.url], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "reliable_beat_up 1.0" in done.stdout, done.stdout + done.stderr


def test_metrics_server_caps_its_connections_and_recovers(sqlite_store: Store) -> None:
    """A flood of stalled clients holds at most MAX_CONNECTIONS threads; the next client is
    answered 503 at once; when they go, scrapes work again. Old code started one thread per
    connection without a bound (and the flood's threads all hit the store)."""
    pytest.importorskip("prometheus_client")
    import threading
    import time
    import urllib.error

    from reliable_beat.metrics import MAX_CONNECTIONS, serve

    server = serve(0, sqlite_store)
    before = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", server.port), timeout=5)
             for _ in range(MAX_CONNECTIONS + 20)]
    try:
        for s in flood:
            s.sendall(b"GET /metr")
        time.sleep(0.5)
        assert threading.active_count() - before <= MAX_CONNECTIONS
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
        assert refused.value.code == 503
    finally:
        for s in flood:
            s.close()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
                    assert b"reliable_beat_up 1.0" in resp.read()
                break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        server.stop()


def test_sqlite_store_file_is_created_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        store = Store.from_url(f"sqlite:///{tmp_path / 'rb.sqlite3'}")
        upgrade(store)
        store.dispose()
    finally:
        os.umask(old)
    for path in tmp_path.iterdir():  # the database and its -wal / -shm files
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.mark.postgres
def test_store_in_its_own_schema_keeps_the_url_options(pg_url: str) -> None:
    admin = Store.from_url(pg_url)
    with admin.begin() as conn:
        conn.execute(sa.text("CREATE SCHEMA tenant_a"))
    url = sa.engine.make_url(pg_url).update_query_dict(
        {"options": "-csearch_path=tenant_a"}).render_as_string(False)
    store = Store.from_url(url, role="beat")
    try:
        upgrade(store)
        with store.connect() as conn:
            assert conn.execute(sa.text("SHOW search_path")).scalar_one() == "tenant_a"
            # our own server-side bounds still apply (merged, not replaced)
            assert conn.execute(sa.text("SHOW lock_timeout")).scalar_one() == "5s"
            conn.execute(entries.select()).all()
        with admin.connect() as conn:
            where = conn.execute(sa.text(
                "SELECT table_schema FROM information_schema.tables "
                "WHERE table_name = 'reliable_beat_entries'")).scalars().all()
        assert where == ["tenant_a"]
    finally:
        store.dispose()
        admin.dispose()


@pytest.mark.postgres
def test_a_lock_timeout_is_not_reported_as_database_unavailable(pg_store: Store) -> None:
    url = sa.engine.make_url(pg_store.url).update_query_dict(
        {"options": "-clock_timeout=200"}).render_as_string(False)
    impatient = Store.from_url(url, role="beat")
    try:
        with pg_store.begin() as holder:
            holder.execute(sa.text("LOCK TABLE reliable_beat_entries IN ACCESS EXCLUSIVE MODE"))
            with pytest.raises(sa.exc.OperationalError) as info, impatient.begin() as conn:
                conn.execute(sa.select(entries.c.name)).all()
        assert not isinstance(info.value, StoreUnavailableError)
        line = impatient.describe_failure(info.value)
        assert line.startswith("lock wait timed out on database ")
        assert "unavailable" not in line
    finally:
        impatient.dispose()


@pytest.mark.postgres
def test_database_errors_carry_no_bound_parameters(pg_store: Store) -> None:
    with pytest.raises(sa.exc.DBAPIError) as info, pg_store.begin() as conn:
        conn.execute(sa.text("SELECT :v, 1 / 0"), {"v": f"task args {SECRET}"})
    assert "division by zero" in str(info.value)
    assert SECRET not in str(info.value)
