"""What the end-to-end demos share (``python -m examples.payouts``, ``examples.orders``,
``examples.django_shop``): a local webhook endpoint (:class:`Sink`), the demo's processes with
kill / pause / restart (:class:`Procs`), the fault thread (:func:`break_it`), the run phase
(:func:`run_then_settle`) and the wait for the store to go idle (:func:`wait_idle`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Connection

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "Procs", "Sink", "break_it", "demo_env", "fresh_workdir", "private_servers",
           "run_then_settle", "runs_in_flight", "wait_idle"]


class Sink:
    """A local webhook endpoint recording (Idempotency-Key, body) of every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with sink.lock:
                    sink.requests.append((self.headers.get("Idempotency-Key", ""),
                                          json.loads(body)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Procs:
    """Named subprocesses of the demo, with kill / pause / restart."""

    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.env = env
        self.logdir = logdir
        self.cmds: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.faults: Counter[str] = Counter()

    def start(self, name: str, cmd: list[str] | None = None) -> None:
        if cmd is not None:
            self.cmds[name] = cmd
        log = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(
            self.cmds[name], env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def signal(self, name: str, sig: signal.Signals) -> None:
        p = self.procs[name]
        if p.poll() is None:
            os.killpg(p.pid, sig)

    def stop(self, name: str, timeout: float = 15) -> None:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGCONT)
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def break_it(procs: Procs, stop_at: float, rng: random.Random, *,
             victims: tuple[str, ...] | None = ("beat", "worker"),
             gap: tuple[float, float] = (3, 6), pause: tuple[float, float] = (4, 12),
             quiet: float = 8) -> None:
    """Every ``gap`` seconds (uniform) until ``quiet`` s before ``stop_at`` (monotonic):
    SIGKILL (then restart) or SIGSTOP for ``pause`` seconds (past the 10 s lease some of the
    time) one process whose name starts with one of ``victims`` (None: any process)."""
    while time.monotonic() < stop_at - quiet:
        time.sleep(rng.uniform(*gap))
        victim = rng.choice(sorted(n for n in procs.procs
                                   if victims is None or n.startswith(victims)))
        kind = victim.rstrip("0123456789")
        if rng.random() < 0.5:
            procs.signal(victim, signal.SIGKILL)
            procs.procs[victim].wait()
            procs.faults[f"SIGKILL {kind}"] += 1
            time.sleep(rng.uniform(0.5, 2))
            procs.start(victim)
        else:
            procs.signal(victim, signal.SIGSTOP)
            procs.faults[f"SIGSTOP {kind}"] += 1
            time.sleep(rng.uniform(*pause))
            procs.signal(victim, signal.SIGCONT)


def fresh_workdir(path: str | Path, *subdirs: str) -> Path:
    """``path`` emptied, with ``logs`` and ``subdirs`` created in it."""
    workdir = Path(path)
    shutil.rmtree(workdir, ignore_errors=True)
    for sub in ("logs", *subdirs):
        (workdir / sub).mkdir(parents=True)
    return workdir


def demo_env(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, the checkout importable (``PYTHONPATH``)."""
    env = dict(os.environ)
    env.update(extra, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                               env.get("PYTHONPATH")])))
    return env


def private_servers(stack: ExitStack, database_url: str | None,
                    broker_url: str | None) -> tuple[str, str]:
    """(PostgreSQL URL, Redis URL): the given ones, or private servers from the local
    binaries (:mod:`harness.servers`) stopped when ``stack`` closes."""
    from harness.servers import PostgresServer, RedisServer

    db_url = database_url or stack.enter_context(PostgresServer()).url
    broker = broker_url or stack.enter_context(RedisServer()).url
    return db_url, broker


def run_then_settle(procs: Procs, seconds: float, *,
                    faults: Callable[[float], None] | None = None, faults_tail: float = 0,
                    restart: tuple[str, ...] = ("worker",)) -> None:
    """Let the demo run ``seconds`` (with ``faults(stop_at)`` in a thread, then
    ``faults_tail`` s for its last fault to end), stop the beats, resume every paused process
    and restart the dead ones whose names start with ``restart``, so the rest can drain."""
    stop_at = time.monotonic() + seconds
    if faults is not None:
        threading.Thread(target=faults, args=(stop_at,), daemon=True).start()
    time.sleep(max(0.0, stop_at - time.monotonic()))
    if faults is not None:
        time.sleep(faults_tail)
    for name in [n for n in procs.procs if n.startswith("beat")]:
        procs.stop(name)
    for name in procs.procs:  # nothing stays paused while draining
        procs.signal(name, signal.SIGCONT)
    for name in [n for n in procs.procs if n.startswith(restart)]:
        if procs.procs[name].poll() is not None:
            procs.start(name)


def wait_idle(database_url: str, timeout: float, busy: Callable[[Connection], int]) -> None:
    """Poll the store every 0.5 s until ``busy(conn)`` (rows still in flight) is 0, for at
    most ``timeout`` seconds (the report then says what is left)."""
    from sqlalchemy import create_engine

    engine = create_engine(database_url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                if not busy(conn):
                    return
            time.sleep(0.5)
    finally:
        engine.dispose()


def runs_in_flight(conn: Connection) -> int:
    """Runs not yet finished plus pending outbox rows (a periodic-task demo's ``busy``)."""
    from sqlalchemy import func, select

    from reliable_beat.db.tables import outbox, runs

    active = conn.execute(select(func.count()).where(
        runs.c.state.in_(("scheduled", "dispatched", "running", "retrying")))).scalar_one()
    pending = conn.execute(select(func.count()).where(outbox.c.state == "pending")
                           ).scalar_one()
    return int(active) + int(pending)
