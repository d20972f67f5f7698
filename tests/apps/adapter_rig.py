"""The rig of the adapter acceptance tests (``test_dramatiq_adapter.py``,
``test_adapters_celery_dramatiq.py``): real worker / beat / relay processes of one test, each
in its own session with its output in a log file (:meth:`Rig.kill_all` SIGCONTs and
SIGKILLs whatever still runs), and the queries the tests assert on (the test apps'
``test_effects`` / ``test_progress`` tables, runs and attempts), with a polling
:meth:`Rig.wait` that fails with every log.

Each rig gets its own tag: Redis namespace ``dq-<tag>`` and queue ``q-<tag>`` (no leftovers
between tests).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from reliable_beat import runs
from reliable_beat.db.dialects import Store

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"


class Rig:
    """Processes and queries of one test on PostgreSQL ``pg_url`` and broker ``broker_url``."""

    #: names the framework in :meth:`wait`'s failure ("" says nothing)
    framework = ""
    #: :meth:`wait`'s default deadline, seconds
    wait_timeout = 90.0

    def __init__(self, pg_url: str, broker_url: str, store: Store, tmp: Path) -> None:
        self.pg_url, self.broker_url, self.store, self.tmp = pg_url, broker_url, store, tmp
        self.tag = uuid.uuid4().hex[:8]
        self.queue = f"q-{self.tag}"
        self.procs: list[subprocess.Popen[bytes]] = []
        #: environment variables a test adds for the processes it starts next
        self.extra: dict[str, str] = {}

    def framework_env(self) -> dict[str, str]:
        """What a subclass adds to every process's environment (before :attr:`extra`)."""
        return {}

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
                "PYTHONUNBUFFERED": "1", "RB_BROKER_URL": self.broker_url,
                "RB_DATABASE_URL": self.pg_url, "RB_NAMESPACE": f"dq-{self.tag}",
                "RB_QUEUE": self.queue, "RB_LEASE_SECONDS": "2", **self.framework_env(),
                **self.extra}

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=self.tmp, start_new_session=True)
        self.procs.append(proc)
        return proc

    def killpg(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.killpg(proc, signal.SIGCONT)
                self.killpg(proc)
            proc.wait(timeout=20)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def rows(self, stmt: Any) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(stmt).mappings()]

    def effects(self, key: str) -> list[dict[str, Any]]:
        return self.rows(sa.text("SELECT * FROM test_effects WHERE key = :k").bindparams(k=key))

    def progress(self, key: str) -> list[dict[str, Any]]:
        return self.rows(sa.text("SELECT * FROM test_progress WHERE key = :k ORDER BY id")
                         .bindparams(k=key))

    def attempts(self, key: str) -> list[dict[str, Any]]:
        try:
            return runs.list_attempts(self.store, runs.get_run(self.store, key)["id"])
        except runs.RunNotFound:
            return []

    def state(self, key: str) -> str | None:
        try:
            return str(runs.get_run(self.store, key)["state"])
        except runs.RunNotFound:
            return None

    def wait(self, what: str, cond: Callable[[], Any], timeout: float | None = None) -> Any:
        """Poll ``cond`` every 0.2 s until truthy (its value); fail naming ``what`` with
        every process's log after ``timeout`` s (default :attr:`wait_timeout`)."""
        timeout = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.2)
        label = f"[{self.framework}] " if self.framework else ""
        pytest.fail(f"{label}timed out after {timeout}s waiting for {what}\n{self.logs()}")


def create_test_tables(store: Store) -> None:
    """The test apps' ``test_effects`` / ``test_progress`` tables (``dq_app.meta``: the same
    as ``rb_task_app``'s; importing it imports no Celery)."""
    sys.path.insert(0, str(APPS))
    try:
        from dq_app import meta
    finally:
        sys.path.remove(str(APPS))
    meta.create_all(store.engine)


R = TypeVar("R", bound=Rig)


@contextlib.contextmanager
def running(rig: R) -> Iterator[R]:
    """``rig`` with the test tables created; every process it started killed at the end."""
    create_test_tables(rig.store)
    try:
        yield rig
    finally:
        rig.kill_all()
