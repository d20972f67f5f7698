"""Throwaway PostgreSQL, MariaDB and Redis servers started from the local binaries.

Used by the test suite, the fault-injection harness, the benchmarks and the examples.
pytest-postgresql's executor runs ``pg_ctl`` as the current user, and PostgreSQL refuses to
run as root (which CI is), so this module starts it as the ``postgres`` system user with
``runuser`` when running as root, in a data directory that user owns.

MariaDB (Debian's ``mariadb-server``) likewise runs as the ``mysql`` system user when root,
with its own data directory, port and socket; it never touches the system's ``/var/lib/mysql``.

Environment:
    RELIABLE_BEAT_TEST_POSTGRES_URL / RELIABLE_BEAT_TEST_REDIS_URL /
    RELIABLE_BEAT_TEST_MARIADB_URL: use these servers instead.
    RELIABLE_BEAT_PG_BIN: directory of ``initdb``/``pg_ctl`` (default: found on PATH or in
    ``/usr/lib/postgresql/*/bin``).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MariaDBServer", "PostgresServer", "RedisServer", "find_mariadbd", "find_pg_bin",
           "free_port"]


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_pg_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL is absent."""
    env = os.environ.get("RELIABLE_BEAT_PG_BIN")
    if env:
        return Path(env)
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(cand, "pg_ctl")):
            return Path(cand)
    found = shutil.which("pg_ctl")
    return Path(found).resolve().parent if found else None


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@dataclass
class PostgresServer:
    """A private PostgreSQL cluster on 127.0.0.1 (trust auth, fsync off: tests only).

    Use as a context manager; :attr:`url` is a ``postgresql+psycopg://`` URL of database
    ``reliable_beat``. :meth:`restart` and :meth:`stop`/:meth:`start` support fault tests.
    """

    port: int = field(default_factory=free_port)
    datadir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rb-pg-")))
    dbname: str = "reliable_beat"
    extra_conf: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bindir = find_pg_bin()
        if bindir is None:
            raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found")
        self.bindir = bindir
        self._as_root = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.dbname}"

    @property
    def psycopg_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={self.dbname}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=120)

    def __enter__(self) -> PostgresServer:
        self.start(init=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(mode="immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)

    def start(self, *, init: bool = False) -> None:
        data = self.datadir / "data"
        if init:
            if self._as_root:
                shutil.chown(self.datadir, "postgres", "postgres")
            self._run("initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                      "--no-sync")
            conf = {
                "listen_addresses": "'127.0.0.1'",
                "port": str(self.port),
                "unix_socket_directories": f"'{self.datadir}'",
                "fsync": "off",
                "synchronous_commit": "off",
                "full_page_writes": "off",
                "max_connections": "200",
                "shared_buffers": "128MB",
                "timezone": "'UTC'",
                **self.extra_conf,
            }
            with open(data / "postgresql.conf", "a") as fh:
                for k, v in conf.items():
                    fh.write(f"{k} = {v}\n")
        for attempt in range(3):
            started = self._run("pg_ctl", "-D", str(data), "-l", str(self.datadir / "log"),
                                "-w", "-t", "60", "start", check=False)
            if started.returncode == 0:
                break
            log = (self.datadir / "log").read_text(errors="replace")
            if not init or attempt == 2 or "could not bind" not in log:
                raise subprocess.CalledProcessError(started.returncode, started.args,
                                                    started.stdout, started.stderr + log[-2000:])
            # free_port() is check-then-use: another server (e.g. a concurrent test session)
            # took the port meanwhile. A fresh cluster may move; the last `port` line wins.
            self.port = free_port()
            with open(data / "postgresql.conf", "a") as fh:
                fh.write(f"port = {self.port}\n")
        _wait_port(self.port, 30)
        if init:
            self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                      "-d", "postgres", "-c", f"CREATE DATABASE {self.dbname}")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.datadir / "data"), "-m", mode, "-w", "stop",
                  check=False)

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m fast``: every client connection is dropped."""
        self._run("pg_ctl", "-D", str(self.datadir / "data"), "-m", mode, "-w", "-t", "60",
                  "-l", str(self.datadir / "log"), "restart")
        _wait_port(self.port, 30)

    def psql(self, sql: str) -> str:
        """Run ``sql`` with psql as the superuser; returns stdout."""
        return self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                         "-d", self.dbname, "-At", "-c", sql).stdout


def find_mariadbd() -> Path | None:
    """The ``mariadbd`` (or ``mysqld``) server binary, or None when MariaDB is absent.

    ``RELIABLE_BEAT_MARIADBD`` names it explicitly.
    """
    env = os.environ.get("RELIABLE_BEAT_MARIADBD")
    if env:
        return Path(env)
    for name in ("mariadbd", "mysqld"):
        found = shutil.which(name) or (f"/usr/sbin/{name}"
                                       if os.path.exists(f"/usr/sbin/{name}") else None)
        if found:
            return Path(found)
    return None


@dataclass
class MariaDBServer:
    """A private MariaDB server on 127.0.0.1 (no password, no durability: tests only).

    Use as a context manager; :attr:`url` is a ``mysql+pymysql://`` URL of database
    ``reliable_beat`` as ``root`` (which may create and drop the per-test databases).
    The server runs in UTC (``default-time-zone=+00:00``) with the InnoDB defaults that
    matter to reliable_beat left as in production (REPEATABLE READ server default; the
    store sets READ COMMITTED per session, see :mod:`reliable_beat.db.dialects`).
    """

    port: int = field(default_factory=free_port)
    datadir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rb-maria-")))
    dbname: str = "reliable_beat"
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        exe = find_mariadbd()
        if exe is None or not exe.exists():
            raise FileNotFoundError("MariaDB server binary (mariadbd) not found "
                                    "(apt-get install mariadb-server)")
        self.exe = exe
        self._as_root = os.geteuid() == 0

    @property
    def socket(self) -> Path:
        return self.datadir / "mysqld.sock"

    @property
    def url(self) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/{self.dbname}?charset=utf8mb4"

    def _user(self, cmd: list[str]) -> list[str]:
        return ["runuser", "-u", "mysql", "--", *cmd] if self._as_root else cmd

    def __enter__(self) -> MariaDBServer:
        self.start(init=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.datadir, ignore_errors=True)

    def _args(self) -> list[str]:
        data = self.datadir / "data"
        return [
            str(self.exe), "--no-defaults", f"--datadir={data}", f"--port={self.port}",
            "--bind-address=127.0.0.1", f"--socket={self.socket}",
            f"--pid-file={self.datadir / 'mysqld.pid'}", f"--log-error={self.datadir / 'log'}",
            "--skip-name-resolve", "--default-time-zone=+00:00", "--max-connections=300",
            "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=32M",
            "--innodb-flush-log-at-trx-commit=0", "--sync-binlog=0", "--skip-log-bin",
            "--innodb-doublewrite=0", "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_bin", "--performance-schema=0",
        ]

    def start(self, *, init: bool = False) -> None:
        data = self.datadir / "data"
        if init:
            if self._as_root:
                shutil.chown(self.datadir, "mysql", "mysql")
            installer = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
            if installer is None:
                raise FileNotFoundError("mariadb-install-db not found")
            subprocess.run(
                self._user([installer, "--no-defaults", f"--datadir={data}",
                            "--auth-root-authentication-method=normal", "--skip-test-db",
                            "--skip-name-resolve", "--innodb-log-file-size=32M"]),
                check=True, capture_output=True, text=True, timeout=180,
            )
        for attempt in range(3):
            self.proc = subprocess.Popen(self._user(self._args()),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(90):
                break
            log = (self.datadir / "log").read_text(errors="replace")
            if not init or attempt == 2 or "Address already in use" not in log:
                raise OSError(f"mariadbd did not start on 127.0.0.1:{self.port}: "
                              f"{log[-2000:]}")
            self.port = free_port()  # free_port() is check-then-use: another server took it
        if init:
            self.sql(f"CREATE DATABASE {self.dbname}; "
                     "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'; "
                     "GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION")

    def _wait_ready(self, timeout: float) -> bool:
        """True once our server accepts connections on its socket; False if it exited."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.socket.exists():
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", self.port)) == 0:
                        return True
            time.sleep(0.1)
        raise TimeoutError(f"mariadbd not ready on 127.0.0.1:{self.port} after {timeout} s")

    def sql(self, statements: str) -> str:
        """Run ``statements`` as root over the server's socket; returns stdout (tab-separated)."""
        client = shutil.which("mariadb") or shutil.which("mysql") or "mariadb"
        return subprocess.run(
            [client, "--no-defaults", f"--socket={self.socket}", "-uroot", "-N", "-B",
             "-e", statements],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """Stop (clients lose their connections) and start again on the same port."""
        self.stop()
        self.start()


@dataclass
class RedisServer:
    """A private ``redis-server`` on 127.0.0.1 with persistence off. Context manager.

    ``databases`` is Redis's number of logical databases (``--databases``; Redis's default
    16): the test suite gives every test its own, so kombu's per-database keys (queues,
    ``unacked``, ``unacked_index``, the ``unacked_mutex`` restore lock) never leak from one
    test into the next. :attr:`url` is database 0.
    """

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    databases: int = 16
    _started_once: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until *this* process answers on :attr:`port`.

        ``free_port()`` is check-then-use: if another server took the port meanwhile (a
        concurrent test session), ours exits and the other one would answer the port
        check; then a fresh port is tried (up to three), unless this is a restart, which
        must keep its port.
        """
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(exe):
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        restart = self._started_once
        self._started_once = True
        for _attempt in range(1 if restart else 3):
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
                 "--databases", str(self.databases)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if self._wait_own_port(30):
                return
            if not restart:
                self.port = free_port()
        raise OSError(f"redis-server did not start on 127.0.0.1:{self.port}")

    def _wait_own_port(self, timeout: float) -> bool:
        """True once our process listens on the port; False if it exited first."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # e.g. "Address already in use"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    s.sendall(b"INFO server\r\n")
                    reply = s.recv(65536).decode(errors="replace")
                if f"process_id:{self.proc.pid}\r\n" in reply:
                    return True
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis-server not answering on 127.0.0.1:{self.port} "
                           f"after {timeout} s")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP the server (clients hang until :meth:`resume`)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
