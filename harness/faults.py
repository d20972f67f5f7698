"""Fault-injection harness: real beats, workers and relays killed, paused and restarted, with a
ledger that proves every slot's effect happened exactly once.

    python -m harness.faults --minutes 1.6 --seed 7          # the CI run
    python -m harness.faults --minutes 30 --seed 20260101    # the long run
    python -m harness.faults --minutes 3 --compare stock,redbeat
    python -m harness.faults --minutes 2.5 --seed 7 --broker rabbitmq   # on RabbitMQ
    python -m harness.faults --minutes 2.5 --seed 7 --framework dramatiq  # Dramatiq adapter
    python -m harness.faults --minutes 2.5 --seed 7 --store mariadb     # MariaDB as the store
    python -m harness.faults --minutes 3 --seed 5 --old-code HEAD~3     # old + new code mixed

What it does (see ``docs/reliability.md``):

1. Starts a private PostgreSQL and Redis (Redis with an fsync-always AOF, so a restart keeps
   queued messages, as a production broker would), or uses ``--postgres-url`` /
   ``--redis-url``; an in-process HTTP sink that records every request with its
   ``Idempotency-Key``; then K beats, W workers (``--pool solo``) and R relays as real
   subprocesses of :mod:`harness.faultapp`, on E entries mixing 6-field cron
   (every 1-5 s) and intervals across time zones, all ``catch_up`` with a large limit, so
   every slot of the checked window must produce its effect.
2. Injects faults on a seeded random timeline; every kind at least once: SIGKILL of a beat,
   a worker, a relay (restarted after a delay); a worker SIGSTOPped *inside its body* past
   its lease, then SIGCONTed (the zombie: its commit must be fenced out); ``pg_ctl restart
   -m fast``; a Redis restart; a paused Redis (SIGSTOP); a beat restarted with its clock
   skewed by +-300 s; a long outage (every beat down at once while every entry's
   ``next_fire_at`` moves a simulated week back). The app injects transient failures (a
   deterministic subset of slots fails attempt 1) and permanent failures (a tiny
   deterministic subset -> dead letters).
   ``--broker rabbitmq`` runs the same on a private RabbitMQ node instead of Redis; its
   broker fault is ``rabbitmq_restart`` (a clean stop or a SIGKILL of the node, at random,
   then a start on the same data: durable queues and persistent, confirmed messages must
   survive), in place of ``redis_restart`` / ``redis_pause``.
   ``--framework dramatiq`` runs the same workload, faults and ledger with the Dramatiq
   adapter (:mod:`harness.faultapp_dramatiq`): ``dramatiq`` worker processes (``-p 1 -t 1``),
   ``reliable-beat dramatiq beat`` and ``reliable-beat dramatiq relay`` processes, on Redis
   or (``--broker rabbitmq``) RabbitMQ with publisher confirms.
   ``--store mariadb`` runs the same with a private MariaDB as the store instead of
   PostgreSQL; its store fault is ``mariadb_restart`` (a clean shutdown or a SIGKILL of
   ``mariadbd``, at random, then a start on the same data directory: every connection of
   every process is dropped, and committed transactions must survive InnoDB's crash
   recovery), in place of ``pg_restart``.
   Beside the periodic entries (Celery; ``--no-workflows`` leaves them out) run three
   **workflow shapes** (:mod:`harness.faultapp`), started by beat entries
   (``reliable_beat.workflow.start``: one workflow per slot) and, for the signal shape, by the
   harness itself: a saga (3 forward activities, each compensation recorded before its step;
   the third fails permanently in a deterministic 1/3 of the workflows, which unwind), a
   timer (activity, 3 s durable timer, activity) and a signal wait (the harness sends the
   signal, one time in three twice under one dedup key; then an activity). Every activity
   and compensation writes a keyed effect row into ``faults_wf_effects`` (no unique
   constraint). ``poison_row`` also writes a workflow row naming no registered workflow: it
   must end ``blocked``, alone.
3. Stops faults 20 s before the end, stops the beats, lets workers and relays drain (and the
   workflows end), checks the ledger, prints a markdown table and exits non-zero on any
   missing or duplicated effect or failed check. Workflows: each ended as its shape and the
   fraction say (completed, or failed after unwinding), each forward and compensation
   effect exactly once, compensations in reverse order, no timer early, one consumed signal
   each, none left pending/running/waiting, ``blocked`` only where injected.

``--old-code REV`` runs old and new code side by side, as a rolling deploy does: the harness
extracts revision ``REV``'s ``reliable_beat`` package (``git archive REV reliable_beat``, in
this repository) and every start of a beat, relay or worker (the first ones, and every
restart after a kill, a crash or the skewed clock) runs either that old package or the
current tree's (:class:`Procs`: the first start of each name alternates, restarts draw from
the seed, about half each); the app modules (``harness/faultapp*.py``) stay the current
tree's, and the schema is the current code's (migrated first, as a deploy does). Each start
is logged with its code, the table counts the starts of each role on old and new code, and
every check is the same. An old revision that lacks an API the app uses fails the run at
start, naming it (:func:`harness.oldcode.probe`).

``--compare stock,redbeat`` then runs the same entries (as Celery intervals) under two stock
``celery beat`` processes (PersistentScheduler, one schedule file each) and two RedBeat
beats, with beat SIGKILL / SIGSTOP faults, and counts duplicate and missing triggers from
what a plain task executed (``reliable`` adds the same measurement for ReliableScheduler).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import Engine

from harness.oldcode import OldCode, OldCodeError, extract, probe
from harness.servers import (
    MariaDBServer,
    PostgresServer,
    RabbitMQServer,
    RedisServer,
    _wait_port,
)
from reliable_beat.schedules import CronSchedule, IntervalSchedule, Schedule

__all__ = ["FAULT_KINDS", "Harness", "fault_kinds", "main"]

ROOT = Path(__file__).resolve().parents[1]
APP = "harness.faultapp"
ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Asia/Kolkata"]

#: Fault kinds of the timeline (the harness injects them) and of the app (deterministic
#: subsets of slots); each appears in the table.
FAULT_KINDS = [
    "kill_beat",
    "kill_worker",
    "kill_relay",
    "zombie_worker",
    "pg_restart",
    "redis_restart",
    "redis_pause",
    "skewed_beat",
    "long_outage",
    "poison_row",
]
#: The broker faults of each ``--broker``; :data:`FAULT_KINDS` holds Redis's.
BROKER_FAULT_KINDS = {"redis": ["redis_restart", "redis_pause"],
                      "rabbitmq": ["rabbitmq_restart"]}
#: The store faults of each ``--store``; :data:`FAULT_KINDS` holds PostgreSQL's.
STORE_FAULT_KINDS = {"postgresql": ["pg_restart"], "mariadb": ["mariadb_restart"]}
APP_FAULT_KINDS = ["transient_failure", "permanent_failure"]
#: Restarts of servers that take tens of seconds to come back (RabbitMQ's Erlang boot, InnoDB
#: recovery), during which every worker is disconnected: one at most every
#: :data:`SLOW_RESTART_SPACING` seconds, else the random timeline of a long run keeps the
#: workers away from the broker most of the time and measures nothing but the backlog.
SLOW_RESTARTS = frozenset({"rabbitmq_restart", "mariadb_restart"})
SLOW_RESTART_SPACING = 60.0


def fault_kinds(broker: str = "redis", store: str = "postgresql") -> list[str]:
    """The timeline's fault kinds on ``broker`` (``redis`` or ``rabbitmq``) and ``store``
    (``postgresql`` or ``mariadb``)."""
    kinds = [k for k in FAULT_KINDS if k not in BROKER_FAULT_KINDS["redis"]] + \
        BROKER_FAULT_KINDS[broker]
    if store != "postgresql":
        kinds = [k for k in kinds if k not in STORE_FAULT_KINDS["postgresql"]] + \
            STORE_FAULT_KINDS[store]
    return kinds
COMPARE_FAULT_KINDS = ["kill_beat", "pause_beat"]

ACTIVE = ("scheduled", "dispatched", "running", "retrying", "buffered")
#: Workflow states that are not an end: none may remain after the drain.
WF_ACTIVE = ("pending", "running", "waiting")
#: The workflow shapes (harness.faultapp) and the effects each must leave exactly once.
WF_SHAPES = ("faults.saga", "faults.timer", "faults.signal")
WF_EXPECTED = {
    ("faults.saga", "completed"): ("fwd1", "fwd2", "fwd3"),
    ("faults.saga", "failed"): ("fwd1", "fwd2", "comp3", "comp2", "comp1"),  # in this order
    ("faults.timer", "completed"): ("before", "after"),
    ("faults.signal", "completed"): ("signalled",),
}


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- servers ----


@dataclass
class DurableRedis(RedisServer):
    """A private Redis with an fsync-always AOF: a restart keeps queued and unacked messages."""

    datadir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rb-redis-")))

    def start(self) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(exe):
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.datadir),
             "--daemonize", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, 30)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.datadir, ignore_errors=True)


@dataclass
class CrashSafeMariaDB(MariaDBServer):
    """A private MariaDB whose committed transactions survive a SIGKILL of ``mariadbd``.

    :class:`MariaDBServer` flushes InnoDB's log once a second
    (``innodb_flush_log_at_trx_commit=0``: a crash of the process may lose the last second
    of commits); this one writes the log at every commit (``=2``: only an OS crash could
    lose them), as a production server would, so the ``mariadb_restart`` fault may crash the
    server without the ledger counting lost commits as missing effects."""

    def _args(self) -> list[str]:
        return [*super()._args(), "--innodb-flush-log-at-trx-commit=2"]

    def crash(self) -> None:
        """SIGKILL ``mariadbd`` itself (not the ``runuser`` in front of it) and reap it."""
        assert self.proc is not None
        pid_file = self.datadir / "mysqld.pid"
        with suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
        with suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(60)
        self.proc = None
        deadline = time.monotonic() + 30  # the socket and port close with the process
        while time.monotonic() < deadline:
            try:
                _wait_port(self.port, 0.05)
            except TimeoutError:
                break
            time.sleep(0.1)


class Sink:
    """A local HTTP endpoint recording ``(Idempotency-Key, body, time)`` of every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any], float]] = []
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with sink.lock:
                    sink.requests.append(
                        (self.headers.get("Idempotency-Key", ""), json.loads(body), time.time())
                    )
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------- processes ----


class Procs:
    """Named subprocesses (own process groups) with kill / pause / restart.

    With ``old`` (``--old-code``), every start of a process chooses its code: the old
    revision's ``reliable_beat`` (:meth:`OldCode.env <harness.oldcode.OldCode.env>`, started
    in the old tree) or the current tree's. A name's first start alternates by its number
    (``worker0`` old, ``worker1`` new, ...: both codes from the beginning wherever a role has
    two processes), every restart draws from ``rng``, half each. :attr:`starts` counts them.
    """

    def __init__(self, env: dict[str, str], logdir: Path, old: OldCode | None = None,
                 rng: random.Random | None = None) -> None:
        self.env = env
        self.logdir = logdir
        self.old = old
        self.code_rng = rng or random.Random(0)
        #: (role, "old" | "new") -> starts; the code each name last started on
        self.starts: Counter[tuple[str, str]] = Counter()
        self.code: dict[str, str] = {}
        self.cmds: dict[str, list[str]] = {}
        self.extra_env: dict[str, dict[str, str]] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lock = threading.RLock()
        #: Killed on purpose, restart pending: the supervisor leaves them alone.
        self.down: set[str] = set()
        #: Exits nobody asked for (restarted by the supervisor, as systemd would).
        self.crashes: Counter[str] = Counter()
        self._supervising = threading.Event()

    def supervise(self) -> None:
        """Restart, like a process supervisor, any process that exited on its own."""
        self._supervising.set()

        def loop() -> None:
            while self._supervising.is_set():
                time.sleep(1.0)
                with self.lock:
                    if not self._supervising.is_set():
                        return
                    for name in list(self.cmds):
                        if name not in self.down and not self.alive(name):
                            log(f"{name} exited on its own (rc {self.procs[name].returncode}); "
                                "restarting it")
                            self.crashes[role_of(name)] += 1
                            self.start(name)

        threading.Thread(target=loop, daemon=True).start()

    def unsupervise(self) -> None:
        with self.lock:
            self._supervising.clear()

    def start(self, name: str, cmd: list[str] | None = None,
              extra_env: dict[str, str] | None = None) -> None:
        with self.lock:
            if cmd is not None:
                self.cmds[name] = cmd
            if extra_env is not None:
                self.extra_env[name] = extra_env
            env = {**self.env, **self.extra_env.get(name, {})}
            cwd, code = ROOT, "new"
            if self.old is not None and self._old_turn(name):
                env, cwd, code = self.old.env(env), self.old.tree, "old"
            self.code[name] = code
            self.starts[(role_of(name), code)] += 1
            logf = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
            if self.old is not None:
                what = f"old code {self.old.label}" if code == "old" else "new code"
                log(f"start {name} on {what}")
                logf.write(f"--- harness: {name} started on {what} ---\n".encode())
                logf.flush()
            self.procs[name] = subprocess.Popen(
                self.cmds[name], env=env, cwd=cwd, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            logf.close()

    def _old_turn(self, name: str) -> bool:
        """Whether this start of ``name`` runs the old code (see the class docstring)."""
        if name not in self.code:
            number = name[len(role_of(name)):]
            return not number.isdigit() or int(number) % 2 == 0
        return self.code_rng.random() < 0.5

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def signal(self, name: str, sig: signal.Signals) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, sig)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        p = self.procs.get(name)
        if p is not None:
            p.wait()

    def stop(self, name: str, timeout: float = 20) -> None:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        self.signal(name, signal.SIGCONT)
        self.signal(name, signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(name)

    def names(self, prefix: str) -> list[str]:
        return sorted(n for n in self.cmds if n.startswith(prefix))

    def by_pid(self, pid: int) -> str | None:
        """The live process ``pid`` is, or whose process group it is in (a ``dramatiq``
        worker process is a child of the ``dramatiq`` command the harness started)."""
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            group = -1
        for name, p in self.procs.items():
            if p.poll() is None and p.pid in (pid, group):
                return name
        return None

    def stop_all(self) -> None:
        self.unsupervise()  # else the supervisor restarts what this stops (SIGTERM, Ctrl-C)
        for name in list(self.procs):
            self.stop(name, timeout=10)


def role_of(name: str) -> str:
    """A process's role: its name without the number (``beat2`` -> ``beat``)."""
    return name.rstrip("0123456789")


#: The Dramatiq app (``--framework dramatiq``).
DRAMATIQ_APP = "harness.faultapp_dramatiq"
FRAMEWORKS = ("celery", "dramatiq")


def dramatiq_worker_cmd(i: int) -> list[str]:
    """One ``dramatiq`` worker: one process, one thread (the Celery run's ``--pool solo``)."""
    return [sys.executable, "-m", "dramatiq", DRAMATIQ_APP, "-p", "1", "-t", "1",
            "-Q", "faults"]


def dramatiq_beat_cmd() -> list[str]:
    return [sys.executable, "-m", "reliable_beat.cli", "dramatiq", "beat", "--broker",
            f"{DRAMATIQ_APP}:broker", "--loglevel", "WARNING"]


def dramatiq_relay_cmd() -> list[str]:
    return [sys.executable, "-m", "reliable_beat.cli", "dramatiq", "relay", "--broker",
            f"{DRAMATIQ_APP}:broker", "--loglevel", "WARNING"]


def celery_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", APP, *args]


def worker_cmd(i: int) -> list[str]:
    return celery_cmd("worker", "--pool", "solo", "-l", "warning", "-n", f"w{i}@%h",
                      "--without-gossip", "--without-mingle", "--without-heartbeat")


def beat_cmd(schedule_file: Path) -> list[str]:
    return celery_cmd("beat", "-l", "warning", "-s", str(schedule_file))


def relay_cmd() -> list[str]:
    return [sys.executable, "-m", "reliable_beat.cli", "-A", APP, "relay", "--loglevel",
            "WARNING", "--claim-lease-seconds", "10"]


# --------------------------------------------------------------------------- entries ----


def make_entries(n: int, rng: random.Random, anchor: datetime) -> list[dict[str, Any]]:
    """``n`` entries: alternately 6-field cron (seconds LAST) and intervals, 1-5 s, in zones."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        every = rng.randint(1, 5)
        zone = ZONES[i % len(ZONES)]
        if i % 2 == 0:
            out.append({"name": f"cron{i}", "kind": "cron", "every": every,
                        "expr": f"* * * * * */{every}", "timezone": zone})
        else:
            out.append({"name": f"every{i}", "kind": "interval", "every": every,
                        "timezone": zone, "anchor": f"{anchor:%Y-%m-%dT%H:%M:%SZ}"})
    return out


def schedule_of(e: dict[str, Any]) -> Schedule:
    if e["kind"] == "cron":
        return CronSchedule(e["expr"], timezone=e["timezone"])
    anchor = datetime.fromisoformat(e["anchor"].replace("Z", "+00:00"))
    return IntervalSchedule(timedelta(seconds=int(e["every"])), anchor, e["timezone"])


def fmt(at: datetime) -> str:
    return f"{at.astimezone(timezone.utc):%Y-%m-%dT%H:%M:%SZ}"


# --------------------------------------------------------------------------- harness ----


@dataclass
class Options:
    minutes: float = 2.5
    seed: int = 7
    beats: int = 3
    workers: int = 3
    relays: int = 2
    entries: int = 6
    postgres_url: str | None = None
    redis_url: str | None = None
    broker: str = "redis"
    framework: str = "celery"
    store: str = "postgresql"
    compare: list[str] = field(default_factory=list)
    compare_minutes: float | None = None
    workdir: Path | None = None
    keep_workdir: bool = False
    #: a git revision whose ``reliable_beat`` half the process starts run (``--old-code``)
    old_code: str | None = None
    lease_seconds: float = 3.0
    warmup_seconds: float = 12.0
    quiet_seconds: float = 20.0
    margin_seconds: float = 3.0
    drain_seconds: float = 120.0
    transient_every: int = 7
    permanent_every: int = 60
    #: the workflow shapes (Celery only): saga / timer / signal entries' periods (s), the
    #: saga fraction that unwinds (one in ``wf_fail_every``), the timer's length (s), how
    #: often the harness itself starts a signal workflow (s; 0: never)
    workflows: bool = True
    wf_saga_every: int = 6
    wf_timer_every: int = 10
    wf_signal_every: int = 10
    wf_fail_every: int = 3
    wf_timer_seconds: float = 3.0
    wf_direct_every: float = 8.0


@dataclass
class Result:
    faults: Counter[str] = field(default_factory=Counter)
    stats: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    compare: list[dict[str, Any]] = field(default_factory=list)


class Harness:
    """One fault-injection run. Use :meth:`run`."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.result = Result()
        self.stack = ExitStack()
        self.pg: PostgresServer | None = None
        self.redis: DurableRedis | None = None
        self.rabbit: RabbitMQServer | None = None
        self.maria: CrashSafeMariaDB | None = None
        self.kinds = fault_kinds(opts.broker, opts.store)
        self.restart_timers: list[threading.Timer] = []
        self._last_slow_restart = float("-inf")
        self.stop_faults = threading.Event()
        #: tags of the poison rows injected (one malformed row per table each time)
        self.poisoned: list[str] = []
        #: workflow shapes: ids of the injected poison workflows (must end blocked), signal
        #: workflows signalled (id -> times sent), workflows the harness started itself
        self.wf_poisoned: list[str] = []
        self.wf_signalled: dict[str, int] = {}
        self.wf_direct: list[str] = []
        self.wf_driver_errors = 0
        self.stop_wf = threading.Event()
        #: ``--old-code``: the old revision's extracted tree (:meth:`run` extracts it)
        self.old: OldCode | None = None

    # -- setup ---------------------------------------------------------------------------
    def _servers(self) -> tuple[str, str]:
        o = self.opts
        if o.store == "mariadb":
            maria = CrashSafeMariaDB()
            self.stack.enter_context(maria)
            self.maria = maria
            db_url = maria.url
        elif o.postgres_url:
            db_url = o.postgres_url
        else:
            self.pg = self.stack.enter_context(PostgresServer())
            db_url = self.pg.url
        if o.broker == "rabbitmq":
            self.rabbit = self.stack.enter_context(RabbitMQServer())
            broker = self.rabbit.url
        elif o.redis_url:
            broker = o.redis_url
        else:
            redis_server = DurableRedis()
            self.stack.enter_context(redis_server)
            self.redis = redis_server
            broker = redis_server.url
        return db_url, broker

    def _write_config(self, path: Path, **extra: Any) -> None:
        cfg = {
            "mode": "reliable",
            "database_url": self.db_url,
            "broker_url": self.broker_url,
            "sink_url": self.sink.url,
            "dir": str(self.workdir),
            "lease_seconds": self.opts.lease_seconds,
            "slow_seconds": 10,
            "transient_every": self.opts.transient_every,
            "permanent_every": self.opts.permanent_every,
            "entries": self.entries,
            "workflows": self.wf_on,
            "wf_entries": self.wf_entries,
            "wf_fail_every": self.opts.wf_fail_every,
            "wf_timer_seconds": self.opts.wf_timer_seconds,
            **extra,
        }
        path.write_text(json.dumps(cfg, indent=1))

    def _prepare_db(self) -> Engine:
        from harness import faultcore
        from reliable_beat.db.dialects import Store
        from reliable_beat.db.migrate import upgrade

        store = Store.from_url(self.db_url, role="cli")
        upgrade(store)
        store.dispose()
        engine = create_engine(self.db_url, pool_pre_ping=True)
        with engine.begin() as conn:
            conn.execute(text(
                "DROP TABLE IF EXISTS faults_effects, faults_triggers, faults_wf_effects"))
        faultcore.metadata.create_all(engine)
        return engine

    @property
    def wf_on(self) -> bool:
        """True when the run has the workflow shapes (``--workflows``, Celery only)."""
        return self.opts.workflows and self.opts.framework == "celery"

    @property
    def mysql(self) -> bool:
        """True when the store is MariaDB / MySQL (else PostgreSQL)."""
        return self.engine.dialect.name in ("mysql", "mariadb")

    def db_now(self) -> datetime:
        for _ in range(100):
            try:
                with self.engine.connect() as conn:
                    if self.mysql:  # DATETIME(6) holding UTC, naive
                        naive: datetime = conn.execute(
                            select(func.utc_timestamp(6))).scalar_one()
                        return naive.replace(tzinfo=timezone.utc)
                    value: datetime = conn.execute(select(func.clock_timestamp())).scalar_one()
                    return value.astimezone(timezone.utc)
            except Exception:
                time.sleep(0.3)
        raise RuntimeError("database unreachable")

    # -- the run -------------------------------------------------------------------------
    def run(self) -> int:
        o = self.opts
        self.workdir = Path(o.workdir or tempfile.mkdtemp(prefix="rb-faults-"))
        shutil.rmtree(self.workdir, ignore_errors=True)
        (self.workdir / "logs").mkdir(parents=True)
        try:
            if o.old_code:  # before any server starts: a bad revision fails at once
                self.old = extract(o.old_code, self.workdir / "old-code")
                log(f"old code {self.old.label} extracted into {self.old.tree}")
            with self.stack:
                self.sink = Sink()
                self.stack.callback(self.sink.close)
                self.db_url, self.broker_url = self._servers()
                self.engine = self._prepare_db()
                self.stack.callback(self.engine.dispose)
                anchor = self.db_now().replace(microsecond=0)
                self.entries = make_entries(o.entries, self.rng, anchor)
                self.wf_entries = [
                    {"name": name, "workflow": wf, "every": every,
                     "anchor": f"{anchor:%Y-%m-%dT%H:%M:%SZ}"}
                    for name, wf, every in (("wfsaga", "faults.saga", o.wf_saga_every),
                                            ("wftimer", "faults.timer", o.wf_timer_every),
                                            ("wfsignal", "faults.signal", o.wf_signal_every))
                ] if self.wf_on else []
                code = self._main_run()
                print(self.report(), flush=True)
                for mode in o.compare:
                    try:
                        self.result.compare.append(self._compare_run(mode))
                    except Exception as exc:
                        log(f"compare {mode} failed: {exc!r}")
                        self.result.compare.append(
                            {"mode": mode, "seconds": 0, "faults": {}, "expected": "-",
                             "executed": "-", "duplicate": "-", "missing": f"error: {exc!r}"})
                if o.compare:
                    print(self.report(compare_only=True))
                return code
        finally:
            if not o.keep_workdir and self.result.failures == []:
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:
                log(f"logs kept in {self.workdir / 'logs'}")

    def _main_run(self) -> int:
        o = self.opts
        cfg = self.workdir / "faults.json"
        self._write_config(cfg)
        env = dict(os.environ)
        env.update(RB_FAULTS_CONFIG=str(cfg), PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), env.get("PYTHONPATH")])))
        env.pop("RB_FAULTS_CLOCK_SKEW", None)
        dq = o.framework == "dramatiq"
        if self.old is not None:
            self._probe_old_code(env, dq)
        # its own rng: the fault timeline stays the one a run without --old-code has
        self.procs = Procs(env, self.workdir / "logs", old=self.old,
                           rng=random.Random(o.seed + 32))
        self.stack.callback(self.procs.stop_all)
        self.stack.callback(self.stop_faults.set)  # runs first: no fault during the teardown
        for i in range(o.workers):
            self.procs.start(f"worker{i}", dramatiq_worker_cmd(i) if dq else worker_cmd(i))
        for i in range(o.relays):
            self.procs.start(f"relay{i}", dramatiq_relay_cmd() if dq else relay_cmd())
        self.t_start = self.db_now()
        for i in range(o.beats):
            self.procs.start(f"beat{i}", dramatiq_beat_cmd() if dq else
                             beat_cmd(self.workdir / f"beat{i}.schedule"))
        total = o.minutes * 60
        log(f"{o.framework} on {o.broker}, seed {o.seed}: {o.beats} beats, {o.workers} workers, "
            f"{o.relays} relays, {len(self.entries)} entries for {total:.0f} s; "
            f"work dir {self.workdir}")
        started = time.monotonic()
        fault_end = started + total - o.quiet_seconds
        self.procs.supervise()
        timeline = threading.Thread(target=self._timeline, args=(started + o.warmup_seconds,
                                                                fault_end), daemon=True)
        timeline.start()
        if self.wf_on:
            threading.Thread(target=self._wf_driver, daemon=True).start()
            self.stack.callback(self.stop_wf.set)
        while time.monotonic() < started + total - o.quiet_seconds / 2:
            time.sleep(0.5)
        self.stop_faults.set()
        timeline.join(60)
        self._heal()
        self.t_end = self.db_now()
        self.procs.unsupervise()
        for name in self.procs.names("beat"):
            self.procs.stop(name)
        drained = self._drain(o.drain_seconds)
        self.stop_wf.set()
        if not drained:
            self.result.failures.append(f"not drained within {o.drain_seconds:.0f} s")
        self._check()
        if self.wf_on:
            self._check_workflows()
        for name in list(self.procs.procs):
            self.procs.stop(name)
        return 1 if self.result.failures else 0

    def _probe_old_code(self, env: dict[str, str], dramatiq: bool) -> None:
        """Fail before any process starts when the old code cannot run the app: its
        imports (the app module, the scheduler class) and its commands' options, on the
        old tree (:func:`harness.oldcode.probe`)."""
        assert self.old is not None
        if dramatiq:
            imports = [DRAMATIQ_APP]
            commands = [dramatiq_beat_cmd(), dramatiq_relay_cmd()]
        else:
            imports = [APP, "reliable_beat.celery:ReliableScheduler"]
            commands = [beat_cmd(self.workdir / "probe.schedule"), worker_cmd(0), relay_cmd()]
        log(f"probing old code {self.old.label}: {', '.join(imports)} and "
            f"{len(commands)} commands")
        probe(self.old, env, imports, commands,
              f"the harness's {self.opts.framework} app ({', '.join(imports)})")

    # -- faults --------------------------------------------------------------------------
    def _timeline(self, begin: float, end: float) -> None:
        """Every kind once (random order), then random kinds, until ``end``."""
        kinds = list(self.kinds)
        self.rng.shuffle(kinds)
        while time.monotonic() < begin:
            time.sleep(0.2)
        while time.monotonic() < end - 5 and not self.stop_faults.is_set():
            kind = kinds.pop(0) if kinds else self.rng.choice(self.kinds)
            if kind in SLOW_RESTARTS:
                if time.monotonic() - self._last_slow_restart < SLOW_RESTART_SPACING:
                    kind = self.rng.choice([k for k in self.kinds if k not in SLOW_RESTARTS])
                else:
                    self._last_slow_restart = time.monotonic()
            try:
                self._inject(kind, end)
            except Exception as exc:  # a fault that could not be injected is a failure
                self.result.failures.append(f"fault {kind} could not be injected: {exc!r}")
                log(f"fault {kind} failed: {exc!r}")
            time.sleep(self.rng.uniform(1.0, 4.0))
        if kinds:
            self.result.failures.append(f"fault kinds never injected (run too short): {kinds}")

    def _inject(self, kind: str, end: float) -> None:
        rng = self.rng
        p = self.procs
        if kind in ("kill_beat", "kill_worker", "kill_relay"):
            role = kind.split("_")[1]
            victim = rng.choice([n for n in p.names(role) if p.alive(n)] or p.names(role))
            log(f"SIGKILL {victim}")
            with p.lock:
                p.down.add(victim)
                p.kill(victim)
            self.result.faults[kind] += 1
            delay = rng.uniform(1.0, 6.0)
            self._restart_later(victim, delay)
        elif kind == "zombie_worker":
            self._zombie()
        elif kind == "pg_restart":
            if self.pg is None:
                log("pg_restart skipped: --postgres-url given")
                return
            log("pg_ctl restart -m fast")
            self.pg.restart(mode="fast")
            self.result.faults[kind] += 1
        elif kind == "mariadb_restart":
            assert self.maria is not None
            crash = rng.random() < 0.5
            log(f"mariadb {'SIGKILL' if crash else 'shutdown'} + start")
            if crash:
                self.maria.crash()
            else:
                self.maria.stop()
            time.sleep(rng.uniform(0.5, 2.0))
            self.maria.start()
            self.result.faults[kind] += 1
        elif kind == "redis_restart":
            if self.redis is None:
                log("redis_restart skipped: --redis-url given")
                return
            log("redis restart")
            self.redis.stop()
            time.sleep(rng.uniform(0.5, 2.0))
            self.redis.start()
            self.result.faults[kind] += 1
        elif kind == "rabbitmq_restart":
            assert self.rabbit is not None
            crash = rng.random() < 0.5
            log(f"rabbitmq {'SIGKILL' if crash else 'stop'} + start")
            self.rabbit.stop(kill=crash)
            time.sleep(rng.uniform(0.5, 2.0))
            self.rabbit.start()
            self.result.faults[kind] += 1
        elif kind == "redis_pause":
            if self.redis is None:
                return
            secs = rng.uniform(2.0, 6.0)
            log(f"redis SIGSTOP for {secs:.1f} s")
            self.redis.pause()
            self.result.faults[kind] += 1
            time.sleep(secs)
            self.redis.resume()
        elif kind == "skewed_beat":
            victim = rng.choice(p.names("beat"))
            skew = rng.choice([-300, 300])
            log(f"restart {victim} with its clock skewed by {skew:+d} s")
            with p.lock:
                p.kill(victim)
                p.start(victim, extra_env={"RB_FAULTS_CLOCK_SKEW": str(skew)})
            self.result.faults[kind] += 1
        elif kind == "long_outage":
            self._long_outage()
            self.result.faults[kind] += 1
        elif kind == "poison_row":
            self._poison()
        else:
            raise ValueError(kind)

    def _long_outage(self) -> None:
        """Every beat down at once; while they are down every entry's ``next_fire_at`` moves
        a week back (as if the outage had lasted a simulated week), then all restart. Their
        first claims plan a week of slots per entry: bounded work (a range row for the
        skipped ones), the misfire policy for the rest; the UNIQUE(entry, fire_at) makes the
        re-planned slots that already ran no-ops. Nothing in the window may go missing or
        run twice."""
        from reliable_beat.db.tables import entries

        p = self.procs
        beats = p.names("beat")
        secs = self.rng.uniform(2.0, 5.0)
        log(f"long outage: all {len(beats)} beats down, next_fire_at a simulated week back "
            f"({secs:.1f} s real)")
        with p.lock:
            for name in beats:
                p.down.add(name)
                p.kill(name)
        week = "INTERVAL 7 DAY" if self.mysql else "interval '7 days'"
        with self.engine.begin() as conn:
            conn.execute(text(
                f"UPDATE {entries.fullname} SET next_fire_at = next_fire_at - {week} "
                "WHERE next_fire_at IS NOT NULL"))
        time.sleep(secs)
        with p.lock:
            for name in beats:
                p.down.discard(name)
                if not p.alive(name):
                    p.start(name)

    def _poison(self) -> None:
        """Write one malformed row into each table the pipeline reads (issue 12): a due
        runtime entry whose ``options`` is a list, a ``celery`` outbox row whose payload is
        not a trigger, a buffered run whose ``args`` is not a list. Beats and relays must
        keep running and serving the others; each poison row must end quarantined (the
        entry) or dead-lettered as ``malformed`` (the outbox row, the run)."""
        from reliable_beat.db.tables import entries, outbox, runs

        tag = f"poison{len(self.poisoned)}"
        now = self.db_now()
        with self.engine.begin() as conn:
            conn.execute(entries.insert().values(
                name=f"{tag}-entry", task="harness.faultapp.nothing", args=[], kwargs={},
                options=["not", "an", "object"], schedule_kind="interval",
                schedule={"kind": "interval", "every_seconds": 1, "anchor": fmt(now),
                          "timezone": "UTC"},
                origin="runtime", next_fire_at=now, created_at=now, updated_at=now,
            ))
            conn.execute(outbox.insert().values(
                message_id=f"{tag}:outbox", destination=self.trigger_destination,
                payload=["not", "a", "trigger"], headers={}, state="pending", attempts=0,
                available_at=now, created_at=now,
            ))
            conn.execute(runs.insert().values(
                idempotency_key=f"{tag}:run", entry_name=f"{tag}-run", fire_at=now,
                trigger="schedule", task="harness.faultapp.nothing", args="not a list",
                kwargs={}, state="buffered", created_at=now, updated_at=now,
            ))
        self.poisoned.append(tag)
        log(f"poison rows {tag}: an entry, an outbox row and a run")
        if self.wf_on:
            self._poison_workflow(tag)
        self.result.faults["poison_row"] += 1

    def _poison_workflow(self, tag: str) -> None:
        """Two poison workflows rows, each with its start wake: one naming no registered
        workflow, one (a ``faults.timer``) whose ``args`` is a number, not a JSON array.
        Each advance must park only that workflow ``blocked``; the others go on."""
        from reliable_beat.db.tables import workflows
        from reliable_beat.workflows import start

        unknown, bad_args = f"{tag}:wf-unknown", f"{tag}:wf-args"
        with self.engine.begin() as conn:
            start(conn, "faults.no_such_workflow", unknown)
            start(conn, "faults.timer", bad_args)
            conn.execute(workflows.update().where(workflows.c.workflow_id == bad_args)
                         .values(args=5))
        self.wf_poisoned += [unknown, bad_args]
        log(f"poison workflows {unknown} (no such workflow), {bad_args} (args 5)")

    def _wf_driver(self) -> None:
        """The workflow shapes' harness side: starts a signal workflow itself every
        ``wf_direct_every`` s (until the faults stop) and sends each signal workflow its
        ``go`` signal 0.5-4 s after it first sees it, one time in three twice under the same
        dedup key. Database errors (the store restarts) are retried on the next loop; starts
        and signals are idempotent on their id / key."""
        from reliable_beat.db.tables import workflows
        from reliable_beat.workflows import WorkflowConflict, signal, start

        o = self.opts
        rng = random.Random(o.seed + 16)  # not self.rng: the fault timeline stays the same
        next_direct = time.monotonic() + o.warmup_seconds
        due: dict[str, float] = {}
        while not self.stop_wf.is_set():
            try:
                if (o.wf_direct_every > 0 and not self.stop_faults.is_set()
                        and time.monotonic() >= next_direct):
                    wid = f"direct-signal-{len(self.wf_direct)}"
                    with self.engine.begin() as conn:
                        start(conn, "faults.signal", wid)
                    self.wf_direct.append(wid)
                    next_direct = time.monotonic() + o.wf_direct_every
                with self.engine.connect() as conn:
                    ids = conn.execute(select(workflows.c.workflow_id).where(
                        workflows.c.name == "faults.signal",
                        workflows.c.state.in_(WF_ACTIVE))).scalars().all()
                now = time.monotonic()
                for wid in ids:
                    if wid in self.wf_signalled:
                        continue
                    if wid not in due:
                        due[wid] = now + rng.uniform(0.5, 4.0)
                    if now < due[wid]:
                        continue
                    times = 2 if rng.random() < 1 / 3 else 1
                    for _ in range(times):
                        with self.engine.begin() as conn:
                            signal(conn, wid, "go", {"wid": wid}, key=f"go:{wid}")
                    self.wf_signalled[wid] = times
            except WorkflowConflict as exc:  # ended before its signal: the verdict says so
                log(f"signal refused: {exc}")
                self.wf_driver_errors += 1
            except Exception as exc:  # the store is restarting: next loop
                log(f"workflow driver: {exc.__class__.__name__}: {str(exc)[:120]}")
                self.wf_driver_errors += 1
                time.sleep(1.0)
            self.stop_wf.wait(0.5)

    def _check_workflows(self) -> None:
        """The workflow shapes' verdict: every workflow ended as its shape and the
        deterministic fraction say (completed, or failed after unwinding), each forward and
        compensation effect exactly once (none duplicated, none missing for an ended
        workflow, none unexpected), compensations in reverse order, no timer fired early,
        each signal stored once (dedup) and consumed, ``blocked`` only where injected, no
        dead letter but the injected ``fwd3`` failures."""
        from harness.faultcore import wf_effects, wf_fails
        from reliable_beat.db.tables import dead_letters, workflow_signals, workflows

        o, r = self.opts, self.result
        with self.engine.connect() as conn:
            wfs = conn.execute(select(
                workflows.c.id, workflows.c.workflow_id, workflows.c.name, workflows.c.state,
                workflows.c.error, workflows.c.block_reason, workflows.c.entry_name)
                # this run's (an existing --postgres-url database may hold older ones)
                .where(workflows.c.created_at >= self.t_start)).all()
            effs = conn.execute(select(
                wf_effects.c.id, wf_effects.c.workflow_id, wf_effects.c.action,
                wf_effects.c.created_at).order_by(wf_effects.c.id)).all()
            sig_rows = conn.execute(select(
                workflow_signals.c.workflow_pk, workflow_signals.c.consumed_seq)).all()
            dead_wf = conn.execute(select(dead_letters.c.key).where(
                dead_letters.c.key.like("wf:%"))).scalars().all()
        by_wf: dict[str, list[Any]] = defaultdict(list)
        for e in effs:
            by_wf[e.workflow_id].append(e)
        sigs: dict[int, list[Any]] = defaultdict(list)
        for pk, consumed in sig_rows:
            sigs[pk].append(consumed)
        states: Counter[str] = Counter()
        started: Counter[str] = Counter()
        dup: list[str] = []
        missing: list[str] = []
        unexpected: list[str] = []
        wrong_end: list[str] = []
        order: list[str] = []
        early: list[str] = []
        sig_bad: list[str] = []
        left: list[str] = []
        blocked_bad: list[str] = []
        failing = set()
        for w in wfs:
            if w.workflow_id in self.wf_poisoned:
                if w.state != "blocked":
                    blocked_bad.append(f"{w.workflow_id}: injected, but {w.state}")
                continue
            if w.name not in WF_SHAPES:
                continue
            shape = w.name.split(".")[1]
            started[shape] += 1
            started["scheduled" if w.entry_name else "harness"] += 1
            states[w.state] += 1
            wid = w.workflow_id
            got = Counter(e.action for e in by_wf.get(wid, []))
            dup += [f"{wid} {a} x{n}" for a, n in got.items() if n > 1]
            if w.state in WF_ACTIVE:
                left.append(f"{wid} {w.state}")
                continue
            if w.state == "blocked":
                blocked_bad.append(f"{wid}: {w.block_reason}")
                continue
            want_state = ("failed" if w.name == "faults.saga" and wf_fails(wid, o.wf_fail_every)
                          else "completed")
            if w.state != want_state:
                wrong_end.append(f"{wid} {w.state} (expected {want_state}): {w.error}")
                continue
            if w.state == "failed":
                failing.add(wid)
                if "injected permanent failure" not in json.dumps(w.error):
                    wrong_end.append(f"{wid} failed, not with the original error: {w.error}")
            want = WF_EXPECTED[(w.name, w.state)]
            missing += [f"{wid} {a}" for a in want if got[a] == 0]
            unexpected += [f"{wid} {a}" for a in got if a not in want]
            firsts: dict[str, Any] = {}
            for e in by_wf.get(wid, []):
                firsts.setdefault(e.action, e)
            if w.state == "failed":
                comps = [firsts[a].id for a in ("comp3", "comp2", "comp1") if a in firsts]
                if comps != sorted(comps):
                    order.append(f"{wid}: {[e.action for e in by_wf[wid]]}")
            if w.name == "faults.timer" and "before" in firsts and "after" in firsts:
                gap = (firsts["after"].created_at - firsts["before"].created_at)
                if gap.total_seconds() < o.wf_timer_seconds - 0.01:
                    early.append(f"{wid}: {gap.total_seconds():.2f} s")
            if w.name == "faults.signal":
                got_sigs = sigs.get(w.id, [])
                if len(got_sigs) != 1 or got_sigs[0] is None:
                    sig_bad.append(f"{wid}: signals stored/consumed {got_sigs}")
        # an injected fwd3 failure may dead-letter while its saga still unwinds (a run that
        # did not drain is reported above): allowed for every saga in the fraction
        injected = {w.workflow_id for w in wfs if w.name == "faults.saga"
                    and wf_fails(w.workflow_id, o.wf_fail_every)}
        dead_bad = [k for k in dead_wf if k[3:].rsplit("/", 1)[0] not in injected]
        dead_missing = sorted(failing - {k[3:].rsplit("/", 1)[0] for k in dead_wf})
        r.stats["wf"] = dict(
            started=sum(started[k] for k in ("saga", "timer", "signal")),
            by_shape={k: started[k] for k in ("saga", "timer", "signal")},
            scheduled=started["scheduled"], harness=started["harness"],
            states=dict(states), completed=states["completed"],
            compensated=len(failing),
            expected_compensated=sum(1 for w in wfs if w.name == "faults.saga"
                                     and w.workflow_id not in self.wf_poisoned
                                     and wf_fails(w.workflow_id, o.wf_fail_every)),
            blocked=sum(1 for w in wfs if w.state == "blocked"),
            injected=len(self.wf_poisoned),
            effects=len(effs), duplicated=len(dup), missing=len(missing),
            unexpected=len(unexpected), order=len(order), early=len(early),
            signals_sent_twice=sum(1 for n in self.wf_signalled.values() if n == 2),
            signal_problems=len(sig_bad), left=len(left), dead_letters=len(dead_wf),
        )
        checks: list[tuple[list[str], str]] = [
            (dup, "workflow effects duplicated"),
            (missing, "workflow effects missing (ended workflows)"),
            (unexpected, "workflow effects that should not exist"),
            (wrong_end, "workflows that ended wrong"),
            (order, "sagas whose compensations did not run in reverse order"),
            (early, "timers that fired early"),
            (sig_bad, "signal workflows without exactly one stored, consumed signal"),
            (left, "workflows left pending/running/waiting after the drain"),
            (blocked_bad, "workflows blocked where nothing was injected (or injected and not "
                          "blocked)"),
            (dead_bad, "workflow dead letters where no failure was injected"),
            (dead_missing, "unwound sagas without their fwd3 dead letter"),
        ]
        for bad, what in checks:
            if bad:
                r.failures.append(f"{len(bad)} {what}: {sorted(bad)[:5]}")
        if not started["saga"] or not started["timer"] or not started["signal"]:
            r.failures.append(f"a workflow shape never started: {dict(started)}")
        if not failing:
            r.failures.append("no saga unwound (the fraction should have made some fail)")

    def _check_poison(self) -> list[str]:
        """Every poison row quarantined / dead-lettered as malformed."""
        from reliable_beat.db.tables import dead_letters, entries, outbox, runs

        problems: list[str] = []
        with self.engine.connect() as conn:
            for tag in self.poisoned:
                reason = conn.execute(select(entries.c.quarantine_reason).where(
                    entries.c.name == f"{tag}-entry")).scalar_one()
                if not reason:
                    problems.append(f"{tag}-entry not quarantined")
                for key, table, col in ((f"{tag}:outbox", outbox, outbox.c.message_id),
                                        (f"{tag}:run", runs, runs.c.idempotency_key)):
                    state = conn.execute(select(table.c.state).where(col == key)).scalar_one()
                    letters = conn.execute(select(dead_letters.c.reason).where(
                        dead_letters.c.key == key)).scalars().all()
                    if state != "dead" or letters != ["malformed"]:
                        problems.append(f"{key}: state {state}, dead letters {letters}")
        return problems

    def _restart_later(self, name: str, delay: float) -> None:
        def restart() -> None:
            with self.procs.lock:
                self.procs.down.discard(name)
                if not self.procs.alive(name):
                    self.procs.start(name)

        t = threading.Timer(delay, restart)
        t.daemon = True
        t.start()
        self.restart_timers.append(t)

    def _zombie(self) -> None:
        """SIGSTOP a worker inside its body (after its writes) past its lease, then SIGCONT
        once another worker has taken the run over (fence moved): its commit must fail."""
        from reliable_beat import unsent
        from reliable_beat.db.tables import outbox, runs

        for stale in self.workdir.glob("slow.*"):
            stale.unlink(missing_ok=True)
        flag = self.workdir / "slow.flag"
        flag.write_text("take me")
        deadline = time.monotonic() + 30
        info: dict[str, Any] | None = None
        while time.monotonic() < deadline and info is None:
            for f in self.workdir.glob("slow.taken.*.json"):
                info = json.loads(f.read_text())
                f.unlink()
            time.sleep(0.05)
        if info is None:
            flag.unlink(missing_ok=True)
            raise RuntimeError("no worker took the slow flag within 30 s")
        key, pid, token = info["key"], int(info["pid"]), int(info["fence_token"])
        name = self.procs.by_pid(pid)
        if name is None:
            raise RuntimeError(f"slow run {key}: pid {pid} is not a live worker")
        with self.engine.connect() as conn:
            row = conn.execute(
                select(runs.c.state, runs.c.fence_token).where(runs.c.idempotency_key == key)
            ).one()
        if row.state != "running" or row.fence_token != token:
            raise RuntimeError(f"slow run {key} is {row.state}/fence {row.fence_token}, "
                               f"expected running/fence {token}")
        self.procs.signal(name, signal.SIGSTOP)
        t0 = time.monotonic()
        log(f"SIGSTOP {name} inside {key} (fence {token})")
        self.result.faults["zombie_worker"] += 1
        time.sleep(self.opts.lease_seconds + 1.0)
        republished = False
        moved = False
        # RabbitMQ keeps the frozen worker's message unacknowledged (no visibility
        # timeout): the run is taken over only through a re-send, which queues behind any
        # backlog the other faults left; allow for it.
        while time.monotonic() - t0 < (120 if self.opts.broker == "rabbitmq" else 40):
            with self.engine.connect() as conn:
                fence = conn.execute(
                    select(runs.c.fence_token).where(runs.c.idempotency_key == key)
                ).scalar_one()
                if fence > token:
                    moved = True
                    break
                if not republished and time.monotonic() - t0 > self.opts.lease_seconds + 2:
                    # A redelivery, as the broker's visibility timeout would make later.
                    payload = conn.execute(
                        select(outbox.c.payload).where(outbox.c.message_id == "trigger:" + key)
                    ).scalar_one_or_none()
                    if payload is None:  # a due slot's trigger has no row: built as a re-send
                        run = conn.execute(select(runs).where(runs.c.idempotency_key == key))
                        payload = unsent.run_messages(conn, run.all(),
                                                      self.trigger_destination)[0].payload
                    if payload is not None:
                        self._republish(payload)
                        republished = True
            time.sleep(0.2)
        time.sleep(0.5)
        log(f"SIGCONT {name} after {time.monotonic() - t0:.1f} s (fence moved: {moved})")
        self.procs.signal(name, signal.SIGCONT)
        if not moved:
            self.result.failures.append(f"zombie {key}: no other worker took the run over")

    @property
    def trigger_destination(self) -> str:
        """The outbox destination of the framework's trigger rows."""
        return "dramatiq" if self.opts.framework == "dramatiq" else "celery"

    def _republish(self, payload: dict[str, Any]) -> None:
        if self.opts.framework == "dramatiq":
            self._republish_dramatiq(payload)
            return
        from celery import Celery

        app = Celery("faults-harness", broker=self.broker_url)
        try:
            app.send_task(payload["task"], args=payload["args"], kwargs=payload["kwargs"],
                          task_id=payload["task_id"], headers=payload["headers"],
                          **payload.get("options", {}))
        finally:
            app.close()

    def _republish_dramatiq(self, payload: dict[str, Any]) -> None:
        """Enqueue the trigger again, as Dramatiq's broker would redeliver it (same
        ``message_id``), on a broker of the harness's own (no middleware, no actors)."""
        from harness.faultapp_dramatiq import QUEUE
        from reliable_beat.dramatiq import message_for_trigger, rabbitmq_url

        if self.broker_url.startswith("amqp"):
            from dramatiq.brokers.rabbitmq import RabbitmqBroker

            broker: Any = RabbitmqBroker(url=rabbitmq_url(self.broker_url),
                                         confirm_delivery=True)
        else:
            from dramatiq.brokers.redis import RedisBroker

            broker = RedisBroker(url=self.broker_url, namespace="faults")  # type: ignore[no-untyped-call]
        try:
            broker.declare_queue(QUEUE)
            options = {**(payload.get("options") or {}), "queue_name": QUEUE}
            broker.enqueue(message_for_trigger(broker, {**payload, "options": options}))
        finally:
            broker.close()

    def _heal(self) -> None:
        """Undo every lasting fault: all processes running, nothing paused, clocks true."""
        for t in self.restart_timers:
            t.cancel()
        if self.redis is not None and self.redis.proc is not None:
            self.redis.resume()
        if self.rabbit is not None and self.rabbit.proc is None:
            self.rabbit.start()
        if self.maria is not None and self.maria.proc is None:
            self.maria.start()
        with self.procs.lock:
            self.procs.down.clear()
            for name in list(self.procs.cmds):
                self.procs.signal(name, signal.SIGCONT)
                if self.procs.extra_env.get(name):
                    self.procs.kill(name)
                    self.procs.extra_env[name] = {}
                if not self.procs.alive(name):
                    self.procs.start(name)
        time.sleep(self.opts.quiet_seconds / 2)

    # -- quiesce and check -----------------------------------------------------------------
    def _drain(self, timeout: float) -> bool:
        from reliable_beat.db.tables import outbox, runs, workflows

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.engine.connect() as conn:
                active = conn.execute(
                    select(func.count()).where(runs.c.state.in_(ACTIVE),
                                               runs.c.fire_at <= self.t_end)
                ).scalar_one()
                pending = conn.execute(
                    select(func.count()).where(outbox.c.state == "pending",
                                               outbox.c.destination != "celery")
                ).scalar_one()
                wf_active = conn.execute(
                    select(func.count()).where(workflows.c.state.in_(WF_ACTIVE),
                                               workflows.c.created_at >= self.t_start)
                ).scalar_one() if self.wf_on else 0
            if not active and not pending and not wf_active:
                log("drained")
                return True
            time.sleep(1.0)
        log(f"drain timed out: {active} runs active, {pending} outbox rows pending, "
            f"{wf_active} workflows pending/running/waiting")
        return False

    def _check(self) -> None:
        from harness.faultcore import effects, is_permanent, is_transient
        from reliable_beat.db.tables import attempts, dead_letters, outbox, runs

        o = self.opts
        r = self.result
        win_start = self.t_start + timedelta(seconds=o.warmup_seconds)
        win_end = self.t_end - timedelta(seconds=o.margin_seconds)
        expected: dict[tuple[str, str], bool] = {}  # (entry, slot) -> permanent
        for e in self.entries:
            for s in schedule_of(e).slots_between(win_start, win_end):
                expected[(e["name"], fmt(s))] = is_permanent(e["name"], fmt(s),
                                                             o.permanent_every)
        now = self.db_now()
        if self.mysql:  # DATETIME - DATETIME is not an interval on MySQL/MariaDB
            late_expr: Any = func.max(func.timestampdiff(
                text("MICROSECOND"), runs.c.fire_at, runs.c.dispatched_at))
        else:
            late_expr = func.max(runs.c.dispatched_at - runs.c.fire_at)
        with self.engine.connect() as conn:
            per = Counter(
                (en, sl) for en, sl in conn.execute(select(effects.c.entry, effects.c.slot))
            )
            outcomes = Counter(o_ for (o_,) in conn.execute(select(attempts.c.outcome)))
            dead = conn.execute(
                select(dead_letters.c.kind, dead_letters.c.key, dead_letters.c.reason)
            ).all()
            stuck = conn.execute(
                select(func.count()).where(runs.c.state == "running",
                                           runs.c.lease_expires_at < now)
            ).scalar_one()
            lateness = conn.execute(
                select(late_expr).where(runs.c.fire_at >= win_start, runs.c.fire_at <= win_end)
            ).scalar_one()
            if lateness is not None and not isinstance(lateness, timedelta):
                lateness = timedelta(microseconds=int(lateness))
            msgs = conn.execute(
                select(outbox.c.message_id, outbox.c.payload, outbox.c.state).where(
                    outbox.c.destination == "sink")
            ).all()
            run_states = Counter(
                s for (s,) in conn.execute(
                    select(runs.c.state).where(runs.c.fire_at >= win_start,
                                               runs.c.fire_at <= win_end))
            )
        missing = [k for k, perm in expected.items() if not perm and per[k] == 0]
        duplicated = [k for k in expected if per[k] > 1]
        duplicated_anywhere = [k for k, n in per.items() if n > 1]
        perm_slots = {k for k, perm in expected.items() if perm}
        perm_with_effect = [k for k in perm_slots if per[k] > 0]
        dead_keys = {key for kind, key, _ in dead if kind == "run"}
        perm_keys = {f"{en}@{sl}" for en, sl in perm_slots}
        perm_without_dl = sorted(perm_keys - dead_keys)
        names = {e["name"] for e in self.entries}
        unexpected_dl = sorted(
            key for kind, key, _ in dead
            if not key.startswith(tuple(f"{t}:" for t in self.poisoned))
            if not key.startswith("wf:")  # a workflow activity's: see _check_workflows
            if kind != "run" or key.rsplit("@", 1)[0] not in names
            or not is_permanent(key.rsplit("@", 1)[0], key.rsplit("@", 1)[-1], o.permanent_every)
        )
        # Outbox: every logical message reached the sink; all deliveries share one key.
        with self.sink.lock:
            reqs = list(self.sink.requests)
        keys_by_body: dict[tuple[str, str], set[str]] = defaultdict(set)
        deliveries: Counter[str] = Counter()
        for key, body, _t in reqs:
            keys_by_body[(body["entry"], body["slot"])].add(key)
            deliveries[key] += 1
        undelivered = [m.message_id for m in msgs if deliveries[m.message_id] == 0]
        not_sent = [m.message_id for m in msgs if m.state != "sent"]
        mixed_keys = [b for b, ks in keys_by_body.items() if len(ks) > 1]
        effect_without_msg = [
            k for k in expected if per[k] == 1 and not keys_by_body.get(k)
        ]
        transient_slots = sum(
            1 for (en, sl), perm in expected.items()
            if not perm and is_transient(en, sl, o.transient_every)
        )
        r.faults["transient_failure"] = transient_slots
        r.faults["permanent_failure"] = len(perm_slots)
        r.stats.update(
            window=f"{fmt(win_start)} .. {fmt(win_end)}",
            slots_checked=len(expected),
            missing=len(missing),
            duplicated=len(duplicated),
            duplicated_anywhere=len(duplicated_anywhere),
            fenced_out=outcomes["fenced_out"],
            deduplicated=outcomes["deduplicated"],
            busy=outcomes["busy"],
            retries=outcomes["retrying"],
            dead_letters=len(dead),
            expected_dead=len(perm_slots),
            max_lateness=lateness.total_seconds() if lateness is not None else None,
            stuck_running=stuck,
            outbox_messages=len(msgs),
            sink_requests=len(reqs),
            sink_redeliveries=len(reqs) - len(deliveries),
            undelivered=len(undelivered),
            mixed_keys=len(mixed_keys),
            run_states=dict(run_states),
            attempts=dict(outcomes),
            crashes=dict(self.procs.crashes),
        )
        if self.old is not None:
            r.stats["old_code"] = self.old.label
            r.stats["starts"] = {
                role: {c: self.procs.starts[(role, c)] for c in ("old", "new")}
                for role in sorted({role for role, _ in self.procs.starts})}
        checks: list[tuple[list[Any], str]] = [
            (missing, "slots without an effect"),
            (duplicated, "slots with more than one effect"),
            (duplicated_anywhere, "(entry, slot) pairs with more than one effect (any time)"),
            (perm_with_effect, "permanent-failure slots with an effect"),
            (perm_without_dl, "permanent-failure slots without a dead letter"),
            (unexpected_dl, "dead letters where no permanent failure was injected"),
            (undelivered, "outbox messages never delivered to the sink"),
            (not_sent, "outbox messages not in state sent"),
            (mixed_keys, "messages delivered under more than one Idempotency-Key"),
            (effect_without_msg, "effects whose message never reached the sink"),
        ]
        if missing:
            keys = [f"{en}@{sl}" for en, sl in missing]
            with self.engine.connect() as conn:
                found = conn.execute(
                    select(runs.c.idempotency_key, runs.c.state, runs.c.attempts).where(
                        runs.c.idempotency_key.in_(keys))
                ).all()
            why = Counter(f"run {st}, {n} attempts" for _k, st, n in found)
            why["no run row"] = len(keys) - len(found)
            lost = [k for k, st, n in found if st == "dispatched" and n == 0]
            r.stats["missing_why"] = {k: v for k, v in why.items() if v}
            if lost:
                r.failures.append(
                    f"{len(lost)} triggers published and marked dispatched but never executed by "
                    f"any worker (lost by the broker; never re-sent): {lost[:5]}"
                )
        for bad, what in checks:
            if bad:
                r.failures.append(f"{len(bad)} {what}: {sorted(bad)[:5]}")
        if stuck:
            r.failures.append(f"{stuck} runs left running with an expired lease")
        if not expected:
            r.failures.append("no slot in the checked window")
        if self.poisoned:
            poison = self._check_poison()
            r.stats["poison_rows_unhandled"] = len(poison)
            if poison:
                r.failures.append(f"{len(poison)} poison rows not isolated: {poison[:5]}")
        if r.faults["zombie_worker"] and not outcomes["fenced_out"]:
            r.failures.append("zombie faults injected but no fenced_out attempt recorded")

    # -- comparison ----------------------------------------------------------------------
    def _compare_run(self, mode: str) -> dict[str, Any]:
        """Two beats of ``mode`` + two workers running a plain task that records triggers."""
        from harness.faultapp import triggers

        o = self.opts
        minutes = o.compare_minutes if o.compare_minutes is not None else min(o.minutes, 3.0)
        cfg = self.workdir / f"compare-{mode}.json"
        self._write_config(cfg, mode="reliable" if mode == "reliable" else mode,
                           compare_task=True)
        import redis

        client = redis.Redis.from_url(self.broker_url)
        client.flushall()
        client.close()
        if mode == "reliable":
            with self.engine.begin() as conn:
                conn.execute(text("DELETE FROM reliable_beat_entries"))
        env = dict(os.environ)
        env.update(RB_FAULTS_CONFIG=str(cfg), PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), env.get("PYTHONPATH")])))
        procs = Procs(env, self.workdir / "logs")
        faults: Counter[str] = Counter()
        try:
            for i in range(2):
                procs.start(f"{mode}-worker{i}", worker_cmd(10 + i))
            if mode == "reliable":
                procs.start(f"{mode}-relay", relay_cmd())
            t0 = time.time()
            for i in range(2):
                procs.start(f"{mode}-beat{i}",
                            beat_cmd(self.workdir / f"{mode}-beat{i}.schedule"))
            log(f"compare {mode}: 2 beats for {minutes * 60:.0f} s")
            rng = random.Random(o.seed)
            end = time.monotonic() + minutes * 60
            time.sleep(10)
            kinds = list(COMPARE_FAULT_KINDS)
            while time.monotonic() < end - 20:
                kind = kinds.pop(0) if kinds else rng.choice(COMPARE_FAULT_KINDS)
                victim = rng.choice(procs.names(f"{mode}-beat"))
                if kind == "kill_beat":
                    procs.kill(victim)
                    time.sleep(rng.uniform(2.0, 8.0))
                    procs.start(victim)
                else:
                    procs.signal(victim, signal.SIGSTOP)
                    time.sleep(rng.uniform(5.0, 15.0))
                    procs.signal(victim, signal.SIGCONT)
                faults[kind] += 1
                time.sleep(rng.uniform(2.0, 6.0))
            while time.monotonic() < end:
                time.sleep(0.5)
            t1 = time.time()
            for n in procs.names(f"{mode}-beat"):
                procs.stop(n)
            time.sleep(8)  # let the workers finish what was sent
        finally:
            procs.stop_all()
        with self.engine.begin() as conn:
            rows = conn.execute(
                select(triggers.c.entry, triggers.c.at).where(triggers.c.mode == mode)
            ).all()
            conn.execute(triggers.delete().where(triggers.c.mode == mode))
        lo, hi = t0 + o.warmup_seconds, t1 - o.margin_seconds
        counts = count_triggers(
            {e["name"]: int(e["every"]) for e in self.entries},
            [(en, at) for en, at in rows],
            lo, hi,
        )
        counts.update(mode=mode, seconds=round(t1 - t0), faults=dict(faults))
        return counts

    # -- report --------------------------------------------------------------------------
    def report(self, *, compare_only: bool = False) -> str:
        r, s, o = self.result, self.result.stats, self.opts
        if compare_only:
            return self._compare_table()
        lines = [
            "",
            f"## Fault-injection run ({o.framework}, {o.broker}, {o.store}): seed {o.seed}, "
            f"{o.minutes:g} min, {o.beats} beats, {o.workers} workers, {o.relays} relays, "
            f"{len(self.entries)} entries",
            "",
            "| fault | injected |",
            "|---|---|",
        ]
        for kind in self.kinds + APP_FAULT_KINDS:
            lines.append(f"| {kind} | {r.faults[kind]} |")
        late = s.get("max_lateness")
        lines += [
            "",
            "| ledger | value |",
            "|---|---|",
            f"| checked window (UTC) | {s.get('window')} |",
            f"| slots checked | {s.get('slots_checked')} |",
            f"| missing effects | {s.get('missing')} "
            f"{'(' + str(s['missing_why']) + ')' if s.get('missing_why') else ''}|",
            f"| duplicated effects | {s.get('duplicated')} |",
            f"| fence rejections (fenced_out attempts) | {s.get('fenced_out')} |",
            f"| deduplicated attempts | {s.get('deduplicated')} |",
            f"| busy attempts (live lease elsewhere) | {s.get('busy')} |",
            f"| retries | {s.get('retries')} |",
            f"| dead letters (all / permanent-failure slots in window) | "
            f"{s.get('dead_letters')} / {s.get('expected_dead')} |",
            f"| runs left running with an expired lease | {s.get('stuck_running')} |",
            f"| outbox messages / sink requests / redeliveries | {s.get('outbox_messages')} / "
            f"{s.get('sink_requests')} / {s.get('sink_redeliveries')} |",
            f"| messages never delivered / with mixed keys | {s.get('undelivered')} / "
            f"{s.get('mixed_keys')} |",
            f"| poison rows not quarantined / dead-lettered | "
            f"{s.get('poison_rows_unhandled', 0)} |",
            f"| processes that exited on their own (restarted) | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(s.get('crashes', {}).items())) or 0} |",
            f"| max fire lateness (dispatched_at - fire_at) | "
            f"{'-' if late is None else f'{late:.2f} s'} |",
        ]
        starts = s.get("starts")
        if starts:
            lines += ["", f"| process starts | old code ({s['old_code']}) | new code |",
                      "|---|---|---|"]
            lines += [f"| {role} | {n['old']} | {n['new']} |" for role, n in starts.items()]
        wf = s.get("wf")
        if wf:
            lines += [
                "",
                "| workflows | value |",
                "|---|---|",
                f"| workflows started (saga / timer / signal; by beat entries / by the harness) "
                f"| {wf['started']} ({wf['by_shape']['saga']} / {wf['by_shape']['timer']} / "
                f"{wf['by_shape']['signal']}; {wf['scheduled']} / {wf['harness']}) |",
                f"| workflows completed | {wf['completed']} |",
                f"| workflows compensated (saga unwound) / expected by the fraction | "
                f"{wf['compensated']} / {wf['expected_compensated']} |",
                f"| workflows blocked (injected) | {wf['blocked']} ({wf['injected']}) |",
                f"| workflows left pending/running/waiting | {wf['left']} |",
                f"| workflow effects (forward + compensation rows) | {wf['effects']} |",
                f"| effects duplicated | {wf['duplicated']} |",
                f"| effects missing | {wf['missing']} |",
                f"| effects unexpected / compensations out of order / timers early | "
                f"{wf['unexpected']} / {wf['order']} / {wf['early']} |",
                f"| signals sent twice (deduplicated) / signal problems | "
                f"{wf['signals_sent_twice']} / {wf['signal_problems']} |",
                f"| workflow dead letters (injected fwd3 failures) | {wf['dead_letters']} |",
            ]
        lines.append("")
        if r.failures:
            lines.append("RESULT: FAILED")
            lines += [f"- {f}" for f in r.failures]
        else:
            lines.append("RESULT: OK: every checked slot has exactly one effect")
        return "\n".join(lines)

    def _compare_table(self) -> str:
        r = self.result
        lines: list[str] = []
        if r.compare:
            lines += [
                "",
                "| scheduler (2 beats) | run | beat faults | expected triggers | executed | "
                "duplicate | missing |",
                "|---|---|---|---|---|---|---|",
            ]
            for c in r.compare:
                fl = ", ".join(f"{k} {v}" for k, v in sorted(c["faults"].items()))
                lines.append(
                    f"| {c['mode']} | {c['seconds']} s | {fl} | {c['expected']} | "
                    f"{c['executed']} | {c['duplicate']} | {c['missing']} |"
                )
        return "\n".join(["", "## Side by side: triggers executed per slot", *lines])


def count_triggers(
    periods: dict[str, int], rows: list[tuple[str, float]], lo: float, hi: float
) -> dict[str, Any]:
    """Duplicate and missing triggers per entry, without assuming a grid.

    Executions of one entry are sorted by time (the slot where the scheduler says it, else
    the publish time) and clustered: an execution less than half a period after the first of
    the current cluster belongs to it (a duplicate). Consecutive clusters ``g`` seconds apart
    mean ``round(g / period) - 1`` missing triggers; so do the window's edges.
    """
    out = {"expected": 0, "executed": 0, "duplicate": 0, "missing": 0}
    by_entry: dict[str, list[float]] = defaultdict(list)
    for entry, at in rows:
        if lo <= at <= hi:
            by_entry[entry].append(at)
    for entry, period in periods.items():
        times = sorted(by_entry.get(entry, []))
        out["expected"] += int((hi - lo) // period)
        out["executed"] += len(times)
        clusters: list[float] = []
        for t in times:
            if clusters and t - clusters[-1] < period / 2:
                out["duplicate"] += 1
            else:
                clusters.append(t)
        edges = [lo - period / 2, *clusters, hi + period / 2]
        for a, b in itertools.pairwise(edges):
            out["missing"] += max(0, round((b - a) / period) - 1)
    return out


def _parse(argv: list[str] | None) -> Options:
    ap = argparse.ArgumentParser(prog="python -m harness.faults",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=2.5)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--beats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--relays", type=int, default=2)
    ap.add_argument("--entries", type=int, default=6)
    ap.add_argument("--postgres-url", default=None,
                    help="use this database (PostgreSQL restarts are then skipped)")
    ap.add_argument("--redis-url", default=None,
                    help="use this broker (Redis restarts and pauses are then skipped)")
    ap.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis",
                    help="broker of the run: a private Redis (default) or RabbitMQ node")
    ap.add_argument("--framework", choices=FRAMEWORKS, default="celery",
                    help="adapter of the run: Celery (default) or Dramatiq")
    ap.add_argument("--store", choices=("postgresql", "mariadb"), default="postgresql",
                    help="store of the run: a private PostgreSQL (default) or MariaDB server")
    ap.add_argument("--compare", default="",
                    help="comma-separated: stock, redbeat, reliable (trigger counting)")
    ap.add_argument("--compare-minutes", type=float, default=None)
    ap.add_argument("--drain-seconds", type=float, default=120.0,
                    help="how long workers and relays may take to drain after the faults")
    ap.add_argument("--no-workflows", dest="workflows", action="store_false",
                    help="leave out the workflow shapes (saga, timer, signal; Celery only)")
    ap.add_argument("--old-code", metavar="REV", default=None,
                    help="a git revision of this repository: every start of a beat, relay or "
                         "worker runs either that revision's reliable_beat or the current "
                         "one (about half each; the app modules stay the current tree's)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep-workdir", action="store_true")
    a = ap.parse_args(argv)
    compare = [m.strip() for m in a.compare.split(",") if m.strip()]
    for m in compare:
        if m not in ("stock", "redbeat", "reliable"):
            ap.error(f"--compare: unknown scheduler {m!r} (stock, redbeat, reliable)")
    if a.framework == "dramatiq" and compare:
        ap.error("--framework dramatiq: --compare runs Celery schedulers only")
    if a.broker == "rabbitmq" and (compare or a.redis_url):
        ap.error("--broker rabbitmq: --compare and --redis-url need Redis")
    if a.store == "mariadb" and (compare or a.postgres_url):
        ap.error("--store mariadb: --compare and --postgres-url need PostgreSQL")
    if a.old_code is not None and (compare or not a.old_code.strip()):
        ap.error("--old-code: give a git revision (a commit, tag or branch), without --compare "
                 "(the side-by-side schedulers run on the current code only)")
    return Options(
        minutes=a.minutes, seed=a.seed, beats=a.beats, workers=a.workers, relays=a.relays,
        entries=a.entries, postgres_url=a.postgres_url, redis_url=a.redis_url,
        broker=a.broker, framework=a.framework, store=a.store, compare=compare,
        compare_minutes=a.compare_minutes, workdir=a.workdir, drain_seconds=a.drain_seconds,
        keep_workdir=a.keep_workdir, workflows=a.workflows, old_code=a.old_code,
    )


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    old: Callable[..., Any] | int | None = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    opts = _parse(argv)
    with _sigterm_as_exit():
        try:
            return Harness(opts).run()
        except OldCodeError as exc:
            print(f"python -m harness.faults: --old-code {opts.old_code}: {exc}",
                  file=sys.stderr, flush=True)
            return 2


if __name__ == "__main__":
    raise SystemExit(main())
