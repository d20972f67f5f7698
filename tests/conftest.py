"""Shared fixtures: a real PostgreSQL, MariaDB, Redis and RabbitMQ, started by the session.

Servers come from ``RELIABLE_BEAT_TEST_POSTGRES_URL`` / ``RELIABLE_BEAT_TEST_REDIS_URL`` /
``RELIABLE_BEAT_TEST_AMQP_URL`` when set, else are started from the local binaries
(:mod:`harness.servers`). The RabbitMQ node is started only by a session whose tests ask for
it (Erlang boots in seconds): ``rabbitmq_node`` / ``amqp_url``, or ``broker_url`` with
``--broker rabbitmq`` (or ``RB_TEST_BROKER=rabbitmq``).
Locally, a missing binary skips the tests that need it, with the reason; with ``CI=true`` it
fails them.

Isolation between tests (the servers are shared by the whole session):

* PostgreSQL: ``pg_url`` is a fresh database per test, dropped afterwards.
* MariaDB: ``mariadb_url`` likewise (``RELIABLE_BEAT_TEST_MARIADB_URL`` names a server to use
  instead; its user must be able to create databases). The ``store`` fixture runs each test
  on SQLite, PostgreSQL and MariaDB; ``RELIABLE_BEAT_TEST_DIALECTS`` (comma-separated, e.g.
  ``sqlite,postgresql``) narrows that, e.g. for a CI job without MariaDB.
* Redis: ``redis_url`` is a Redis database (``/N``) of the test's own, flushed before and
  after. kombu keeps its Redis state per database (queues, bindings, ``unacked``,
  ``unacked_index`` and the ``unacked_mutex`` restore lock, which a worker SIGKILLed while
  holding it leaves for ``unacked_mutex_expire``, kombu's default 300 s); a later test on
  the same database would inherit it.
* Processes: every test runs with ``RB_TEST_PROCESS_MARK`` set to a value of its own in the
  environment, which every subprocess inherits (the tests pass ``os.environ`` on). After
  the test (and its own cleanup), any process still carrying the mark, e.g. a grandchild
  of a process the test killed or the children of a runner that timed out, is SIGKILLed
  and listed in the session summary. Linux only (``/proc``).
"""

from __future__ import annotations

import itertools
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import sqlalchemy as sa

from harness.servers import MariaDBServer, PostgresServer, RabbitMQServer, RedisServer
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade

# The users' testing kit, dogfooded (its rb_* fixtures: reliable_beat/testing/pytest.py).
pytest_plugins = ("celery.contrib.pytest", "reliable_beat.testing.pytest")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SHARED_CASES = Path(__file__).resolve().parents[2] / "shared" / "cases"


#: The environment variable that marks a test's subprocesses (see the module docstring).
PROCESS_MARK = "RB_TEST_PROCESS_MARK"
#: Logical databases of the session's private Redis: one per test that uses Redis (reused
#: round-robin past this many, each flushed before use).
REDIS_DATABASES = 1024
_LEFTOVERS: list[str] = []


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@contextmanager
def _unmarked() -> Iterator[None]:
    """Start session-wide servers without the current test's process mark."""
    saved = os.environ.pop(PROCESS_MARK, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[PROCESS_MARK] = saved


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of the superuser's database on a real PostgreSQL (session-wide)."""
    url = os.environ.get("RELIABLE_BEAT_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    try:
        with _unmarked():
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
def mariadb_server() -> Iterator[str]:
    """URL of a database on a real MariaDB as a user that may create databases (session-wide)."""
    url = os.environ.get("RELIABLE_BEAT_TEST_MARIADB_URL")
    if url:
        yield url
        return
    try:
        with _unmarked():
            server = MariaDBServer()
            server.__enter__()
    except (FileNotFoundError, OSError) as exc:
        _unavailable(f"MariaDB not available: {exc}")
        return
    try:
        yield server.url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[tuple[str, int]]:
    """``(url, number of logical databases)`` of a real Redis server (session-wide).

    Tests use :func:`redis_url` (a database of their own), not this.
    """
    url = os.environ.get("RELIABLE_BEAT_TEST_REDIS_URL")
    if url:
        import redis

        client = redis.Redis.from_url(url)
        try:
            databases = int(client.config_get("databases").get("databases", 16))
        except redis.RedisError:
            databases = 16  # CONFIG may be disabled on a managed server
        finally:
            client.close()
        yield url, databases
        return
    try:
        with _unmarked():
            server = RedisServer(databases=REDIS_DATABASES)
            server.__enter__()
    except (FileNotFoundError, OSError) as exc:
        _unavailable(f"Redis not available: {exc}")
        return
    try:
        yield server.url, REDIS_DATABASES
    finally:
        server.__exit__(None, None, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--broker", choices=("redis", "rabbitmq"),
        default=os.environ.get("RB_TEST_BROKER", "redis"),
        help="broker of the tests that take the broker_url fixture (default: redis, or "
             "$RB_TEST_BROKER)")


@pytest.fixture(scope="session")
def rabbitmq_node() -> Iterator[RabbitMQServer | None]:
    """A private RabbitMQ node (session-wide), or None when ``RELIABLE_BEAT_TEST_AMQP_URL``
    names an outside one (tests that restart the broker skip then)."""
    if os.environ.get("RELIABLE_BEAT_TEST_AMQP_URL"):
        yield None
        return
    try:
        with _unmarked():
            server = RabbitMQServer(session_wide=True)
            server.__enter__()
    except (FileNotFoundError, OSError) as exc:
        _unavailable(f"RabbitMQ not available: {exc}")
        return
    try:
        yield server
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def amqp_url(rabbitmq_node: RabbitMQServer | None) -> str:
    """``amqp://`` URL (kombu ``pyamqp``) of the session's RabbitMQ, default vhost. Queues are
    shared by the session: a test names its queues after itself (see ``test_queue``)."""
    if rabbitmq_node is None:
        return os.environ["RELIABLE_BEAT_TEST_AMQP_URL"]
    if rabbitmq_node.proc is None:  # a test stopped it and failed before starting it again
        with _unmarked():
            rabbitmq_node.start()
    return rabbitmq_node.url


@pytest.fixture
def test_queue() -> str:
    """A queue name of this test's own (the RabbitMQ node is shared by the session)."""
    return f"rb-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def broker_url(request: pytest.FixtureRequest) -> str:
    """The broker chosen with ``--broker``: a Redis database of the test's own, or the
    session's RabbitMQ node."""
    if request.config.getoption("--broker") == "rabbitmq":
        return str(request.getfixturevalue("amqp_url"))
    return str(request.getfixturevalue("redis_url"))


_redis_db_numbers = itertools.count(1)


@pytest.fixture
def redis_url(redis_server: tuple[str, int]) -> Iterator[str]:
    """URL of a Redis database of this test's own (``redis://host:port/N``), flushed before
    and after the test: nothing a killed worker or an earlier test left in Redis (queues,
    kombu's ``unacked`` keys and restore lock) is seen by this one."""
    import redis

    base, databases = redis_server
    number = 1 + (next(_redis_db_numbers) - 1) % max(databases - 1, 1)
    parts = urlsplit(base)
    url = urlunsplit(parts._replace(path=f"/{number}"))
    client = redis.Redis.from_url(url, socket_timeout=30)
    try:
        client.flushdb()
        yield url
    finally:
        # the test may have stopped or paused the server: the next user flushes then
        with suppress(redis.RedisError):
            client.flushdb()
        client.close()


@pytest.fixture
def second_redis_url(redis_url: str, redis_server: tuple[str, int]) -> Iterator[str]:
    """Another Redis database than ``redis_url``'s (a second app's broker), flushed before and
    after the test."""
    import redis

    _base, databases = redis_server
    parts = urlsplit(redis_url)
    number = int(parts.path.strip("/") or 0)
    other = 1 + number % max(databases - 1, 1)
    assert other != number
    url = urlunsplit(parts._replace(path=f"/{other}"))
    client = redis.Redis.from_url(url, socket_timeout=30)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


def _marked_processes(mark: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every process whose environment carries ``mark``."""
    needle = f"{PROCESS_MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        found.append((int(entry.name), cmd.strip()[:160]))
    return found


@pytest.fixture(autouse=True)
def _reap_leftover_processes(request: pytest.FixtureRequest,
                             monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Mark this test's subprocesses; after the test, SIGKILL the ones still running."""
    if not Path("/proc/self/environ").exists():
        yield
        return
    mark = uuid.uuid4().hex
    monkeypatch.setenv(PROCESS_MARK, mark)
    yield
    leftovers = _marked_processes(mark)
    for pid, _ in leftovers:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    for pid, cmd in leftovers:
        _LEFTOVERS.append(f"{request.node.nodeid}: pid {pid} {cmd}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFTOVERS:
        terminalreporter.section("leftover processes killed after their test")
        for line in _LEFTOVERS:
            terminalreporter.write_line(line)


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
def mariadb_url(mariadb_server: str) -> Iterator[str]:
    """A fresh, empty MariaDB database for one test; dropped afterwards."""
    try:
        import pymysql  # noqa: F401
    except ImportError:
        _unavailable("PyMySQL not installed (pip install 'reliable-beat[mysql]')")
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(mariadb_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = sa.engine.make_url(mariadb_server).set(database=name).render_as_string(False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            for (pid,) in conn.execute(
                sa.text("SELECT id FROM information_schema.processlist WHERE db = :n"),
                {"n": name},
            ):
                with suppress(sa.exc.DBAPIError):
                    conn.execute(sa.text(f"KILL {int(pid)}"))
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
def mariadb_store(mariadb_url: str) -> Iterator[Store]:
    """A migrated MariaDB store."""
    store = Store.from_url(mariadb_url, role="cli")
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


#: The dialects the ``store`` fixture runs each test on (``RELIABLE_BEAT_TEST_DIALECTS``).
DIALECTS = [d for d in os.environ.get("RELIABLE_BEAT_TEST_DIALECTS",
                                      "sqlite,postgresql,mariadb").split(",") if d]
_STORE_FIXTURE = {"sqlite": "sqlite_store", "postgresql": "pg_store",
                  "mariadb": "mariadb_store"}


@pytest.fixture(params=[pytest.param(d, marks=pytest.mark.mariadb) if d == "mariadb" else d
                        for d in DIALECTS])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """The same test on a migrated SQLite, PostgreSQL and MariaDB store (``-k mariadb``)."""
    yield request.getfixturevalue(_STORE_FIXTURE[request.param])


#: The server databases the acceptance suites' ``server_url`` / ``server_store`` run on.
SERVER_DIALECTS = [
    d if d == "postgresql" else pytest.param(d, marks=pytest.mark.mariadb)
    for d in ("postgresql", "mariadb") if d in DIALECTS
]
_URL_FIXTURE = {"postgresql": "pg_url", "mariadb": "mariadb_url"}


@pytest.fixture(params=SERVER_DIALECTS)
def server_url(request: pytest.FixtureRequest) -> str:
    """A fresh, empty database on PostgreSQL and on MariaDB (for suites with real processes:
    only server databases can be shared by several processes on several hosts)."""
    return str(request.getfixturevalue(_URL_FIXTURE[request.param]))


@pytest.fixture
def server_store(server_url: str) -> Iterator[Store]:
    """A migrated store on :func:`server_url`."""
    store = Store.from_url(server_url, role="cli")
    upgrade(store)
    yield store
    store.dispose()
