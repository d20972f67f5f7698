"""The store is the Django database when no ``reliable_beat_database_url`` is set: real
``celery beat``, ``celery worker``, ``manage.py reliable_beat relay`` and ``status`` processes
of a Django project (``tests/apps/djproj/djauto``, laid out as Celery's Django docs show) on a
real PostgreSQL (psycopg 3 and psycopg2) and Redis.

Before: without the setting every process used its own ``sqlite:///reliable_beat.sqlite3``
(and Django's ORM wrote to PostgreSQL: effect and key in two databases). Now each process
derives the store from ``DATABASES["default"]`` through the source the Django app registers
in ``AppConfig.ready()``, and says so: ``(from Django DATABASES['default'])``. With the
setting given, the setting wins, and says so too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat.db.tables import runs

ROOT = Path(__file__).resolve().parents[2]
PROJ = ROOT / "tests" / "apps" / "djproj"
BIN = Path(sys.executable).parent
FROM_DJANGO = "(from Django DATABASES['default'])"
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(300)]

sys.path.insert(0, str(PROJ))
from djtables import meta, payouts  # noqa: E402


class Project:
    """Processes of the djauto project, each with its log in ``tmp``."""

    def __init__(self, tmp: Path, driver: str, pg_url: str, redis_url: str) -> None:
        self.tmp, self.driver, self.pg_url, self.redis_url = tmp, driver, pg_url, redis_url
        self.queue = f"djauto-{uuid.uuid4().hex[:8]}"
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RELIABLE_BEAT_", "CELERY_", "DJANGO_", "RB_"))}
        env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), str(PROJ)]),
                    "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "djauto.settings",
                    "RB_DATABASE_URL": self.pg_url, "RB_DJANGO_DRIVER": self.driver,
                    "RB_BROKER_URL": self.redis_url, "RB_QUEUE": self.queue, **extra})
        return env

    def start(self, *args: str, **extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"{args[0]}-{len(self.procs)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([str(BIN / "celery"), "-A", "djauto", *args], cwd=self.tmp,
                                    env=self.env(**extra), stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append((proc, log))
        return proc, log

    def beat(self, **extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        return self.start("beat", "-l", "info", "--pidfile=", "-s",
                          str(self.tmp / "celerybeat-schedule"), **extra)

    def worker(self) -> tuple[subprocess.Popen[bytes], Path]:
        return self.start("worker", "--pool", "solo", "-c", "1", "-Q", self.queue, "-n",
                          f"{self.queue}@%h", "--without-gossip", "--without-mingle",
                          "--without-heartbeat", "-l", "INFO")

    def relay(self) -> tuple[subprocess.Popen[bytes], Path]:
        """``manage.py reliable_beat relay`` (delivers the triggers' sweep and the outbox)."""
        log = self.tmp / f"relay-{len(self.procs)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "django", "reliable_beat", "relay"],
                                    cwd=self.tmp, env=self.env(), stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, log))
        return proc, log

    def manage(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        """``manage.py <args>`` (``python -m django`` is manage.py without the file)."""
        return subprocess.run([sys.executable, "-m", "django", *args], cwd=self.tmp,
                              env=self.env(**extra), capture_output=True, text=True,
                              timeout=120)

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                         for _, log in self.procs)

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def project(request: pytest.FixtureRequest, tmp_path: Path, pg_url: str,
            redis_url: str) -> Iterator[Project]:
    driver = getattr(request, "param", "psycopg")
    if driver == "psycopg2":
        pytest.importorskip("psycopg2", reason="pip install psycopg2-binary")
    p = Project(tmp_path, driver, pg_url, redis_url)
    yield p
    p.stop()


def _succeeded(engine: sa.Engine, entry: str) -> int:
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(runs).where(
                runs.c.entry_name == entry, runs.c.state == "succeeded")).scalar_one())
    except sa.exc.ProgrammingError:  # the beat has not created the schema yet
        return 0


@pytest.mark.parametrize("project", ["psycopg", "psycopg2"], indirect=True)
def test_beat_worker_and_status_use_the_django_database(project: Project, pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    meta.create_all(engine)
    password = sa.engine.make_url(pg_url).password
    beat, beat_log = project.beat()
    worker, worker_log = project.worker()
    relay, relay_log = project.relay()
    deadline, done = time.monotonic() + 150, 0
    while time.monotonic() < deadline and done < 3:
        assert beat.poll() is None and worker.poll() is None, project.logs()
        assert relay.poll() is None, project.logs()
        done = _succeeded(engine, "auto-tick")
        time.sleep(0.5)
    assert done >= 3, f"no runs in the Django database after 150 s\n{project.logs()}"
    with engine.connect() as conn:  # the ORM effects, one per slot, in the same database
        keys = conn.execute(sa.select(payouts.c.key)).scalars().all()
    engine.dispose()
    assert keys and len(keys) == len(set(keys)), keys
    beat_text, worker_text = (beat_log.read_text(errors="replace"),
                              worker_log.read_text(errors="replace"))
    driver = f"postgresql+{project.driver}://"
    store_lines = [ln for ln in beat_text.splitlines() if "store ->" in ln]
    assert store_lines and driver in store_lines[0] and FROM_DJANGO in store_lines[0], beat_text
    store_lines = [ln for ln in worker_text.splitlines() if "reliable_beat: store" in ln]
    assert store_lines and driver in store_lines[0] and FROM_DJANGO in store_lines[0], (
        worker_text[-3000:])
    relay_text = relay_log.read_text(errors="replace")
    store_lines = [ln for ln in relay_text.splitlines() if ln.startswith("relay ")]
    assert store_lines and driver in store_lines[0] and FROM_DJANGO in store_lines[0], (
        relay_text[-3000:])
    status = project.manage("reliable_beat", "status")
    assert status.returncode == 0, status.stdout + status.stderr
    first = status.stdout.splitlines()[0]
    assert driver in first and "from Django DATABASES['default']" in first, status.stdout
    assert "auto-tick" in status.stdout
    # Nothing fell back to the embedded default store; no password in any banner.
    assert not (project.tmp / "reliable_beat.sqlite3").exists()
    assert "embedded default store" not in project.logs()
    if password:
        assert password not in project.logs() + status.stdout + status.stderr


def test_the_setting_wins_over_the_django_database(project: Project, pg_url: str) -> None:
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    other = f"t_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {other}"))
    other_url = sa.engine.make_url(pg_url).set(database=other).render_as_string(False)
    other_engine = sa.create_engine(other_url)
    try:
        beat, beat_log = project.beat(RB_CELERY_STORE_URL=other_url)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert beat.poll() is None, project.logs()
            if "store ->" in beat_log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        line = next(ln for ln in beat_log.read_text(errors="replace").splitlines()
                    if "store ->" in ln)
        assert f"/{other} (from CELERY_RELIABLE_BEAT_DATABASE_URL)" in line, line
        status = project.manage("reliable_beat", "status", RB_CELERY_STORE_URL=other_url)
        assert status.returncode == 0, status.stdout + status.stderr
        first = status.stdout.splitlines()[0]
        assert f"/{other} (from CELERY_RELIABLE_BEAT_DATABASE_URL" in first, status.stdout
        assert "auto-tick" in status.stdout  # the beat's entry, in the setting's database
    finally:
        project.stop()
        other_engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :n"), {"n": other})
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {other}"))
        admin.dispose()


@pytest.mark.mariadb
def test_a_mysql_django_database_is_the_store(project: Project, mariadb_url: str) -> None:
    """``DATABASES["default"]`` on Django's mysql backend (MariaDB here): the beat and
    ``manage.py reliable_beat status`` derive ``mysql+pymysql://`` from it (the store's
    driver, whatever Django's is)."""
    beat, beat_log = project.beat(RB_DJANGO_MYSQL_URL=mariadb_url)
    engine = sa.create_engine(mariadb_url)
    deadline, fired = time.monotonic() + 150, 0
    while time.monotonic() < deadline and fired < 2:
        assert beat.poll() is None, project.logs()
        try:
            with engine.connect() as conn:
                fired = int(conn.execute(sa.select(sa.func.count()).select_from(runs).where(
                    runs.c.entry_name == "auto-tick")).scalar_one())
        except sa.exc.ProgrammingError:  # no schema yet
            fired = 0
        time.sleep(0.5)
    engine.dispose()
    assert fired >= 2, f"no runs in the MariaDB database after 150 s\n{project.logs()}"
    line = next(ln for ln in beat_log.read_text(errors="replace").splitlines()
                if "store ->" in ln)
    assert "mysql+pymysql://" in line and FROM_DJANGO in line, line
    status = project.manage("reliable_beat", "status", RB_DJANGO_MYSQL_URL=mariadb_url)
    assert status.returncode == 0, status.stdout + status.stderr
    first = status.stdout.splitlines()[0]
    assert "mysql+pymysql://" in first and "from Django DATABASES['default']" in first, (
        status.stdout)
    assert "auto-tick" in status.stdout
    assert not (project.tmp / "reliable_beat.sqlite3").exists()
