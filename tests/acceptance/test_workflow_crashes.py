"""Durable workflows on real processes: SIGKILL at every step boundary, timers across a full
restart, signals racing a SIGSTOPped advance. Real ``celery worker`` (solo pool) and
``reliable-beat relay`` processes, Redis, and PostgreSQL or MariaDB (``server_url``:
``-k postgresql`` / ``-k mariadb``; tests/apps/wf_app.py).

The crash grid: for each crash point the design lists (docs/workflows.md), the four shapes of
wf_app run side by side, **each on its own queue with its own solo worker** started with
``RB_WF_KILL_AT=<point>``, so every shape is killed at the point itself (not only whichever
shape reaches it first). Each time a worker SIGKILLs itself a new one is started (at most
``RB_WF_KILLS``, default 3, kills per shape and point, one marker file each), then a clean
one. Every workflow must end ``completed`` with exactly the expected event list and
result, each transaction and activity effect exactly once, each step effect at least once.
A cell the grid marks as not applying (:data:`NOT_APPLICABLE`, with the reason) must see
no kill: the table is checked, not assumed.

CI runs the short list of points; the full grid (every point x every shape) is
``RB_WF_POINTS=all pytest -s tests/acceptance/test_workflow_crashes.py -k "matrix and
(postgresql or summary)"`` (``mariadb`` for MariaDB); ``test_crash_matrix_summary`` prints
the matrix (points x shapes: SIGKILLs per cell, ``n/a``, divergences) and writes it to
``$RB_WF_MATRIX_FILE`` when set.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.outbox import db_now
from reliable_beat.workflows import engine

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from wf_app import meta, wf_effects  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(1200)]

SHAPES = ["wfa.linear", "wfa.fanout", "wfa.signal", "wfa.race"]

SHORT_POINTS = [
    "advance.after_claim", "record.transaction.in", "record.activity.in",
    "activity.after_commit", "step.after_body", "advance.before_release",
    "advance.before_finish",
]
KINDS = ["transaction", "activity", "step", "timer", "signal", "now", "wait_any"]
#: Every crash point docs/workflows.md lists (30).
FULL_POINTS = [
    "advance.before_claim", "advance.after_claim",
    *[f"record.{k}.{w}" for k in KINDS for w in ("before", "in", "after")],
    "step.after_body", "complete.before", "complete.after",
    "activity.after_commit", "activity.before_return",
    "advance.before_release", "advance.before_finish",
]
assert set(SHORT_POINTS) <= set(FULL_POINTS)
POINTS = FULL_POINTS if os.environ.get("RB_WF_POINTS") == "all" else SHORT_POINTS
#: SIGKILLs per shape and point (the first n hits), then a clean worker (``RB_WF_KILLS``).
KILLS = int(os.environ.get("RB_WF_KILLS", "3"))

_ONLY_LINEAR_STEP = "only wfa.linear makes a ctx.step"
_ONLY_LINEAR_TIMER = "only wfa.linear sleeps (ctx.sleep)"
_ONLY_SIGNAL = "only wfa.signal waits for a signal and reads ctx.now()"
_ONLY_RACE = "only wfa.race calls ctx.wait_any"
_NO_COMPLETE = ("the advance completes a scheduled event only for a timer (wfa.linear) or a "
                "signal that arrives after the wait was recorded (wfa.signal); this shape's "
                "scheduled events are activities, completed by the activity's own transaction")
_NO_CHARGE = "activity.after_commit is in wfa.charge, which wfa.signal does not call"
_NO_LABEL = "activity.before_return is in wfa.label, which wfa.fanout does not call"
#: (point, shape) cells that cannot be reached, and why. Everything else must be hit.
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    **{(f"record.step.{w}", s): _ONLY_LINEAR_STEP
       for w in ("before", "in", "after") for s in SHAPES if s != "wfa.linear"},
    **{("step.after_body", s): _ONLY_LINEAR_STEP for s in SHAPES if s != "wfa.linear"},
    **{(f"record.timer.{w}", s): _ONLY_LINEAR_TIMER
       for w in ("before", "in", "after") for s in SHAPES if s != "wfa.linear"},
    **{(f"record.{k}.{w}", s): _ONLY_SIGNAL for k in ("signal", "now")
       for w in ("before", "in", "after") for s in SHAPES if s != "wfa.signal"},
    **{(f"record.wait_any.{w}", s): _ONLY_RACE
       for w in ("before", "in", "after") for s in SHAPES if s != "wfa.race"},
    **{(f"complete.{w}", s): _NO_COMPLETE
       for w in ("before", "after") for s in ("wfa.fanout", "wfa.race")},
    ("activity.after_commit", "wfa.signal"): _NO_CHARGE,
    ("activity.before_return", "wfa.fanout"): _NO_LABEL,
}
#: Filled by test_crash_matrix, printed by test_crash_matrix_summary: {(dialect, point):
#: {shape: kills}}.
GRID: dict[tuple[str, str], dict[str, int]] = {}


class Rig:
    def __init__(self, db_url: str, redis_url: str, store: Store, tmp: Path) -> None:
        self.db_url, self.redis_url, self.store, self.tmp = db_url, redis_url, store, tmp
        self.tag = uuid.uuid4().hex[:8]
        self.queue = f"wf-{self.tag}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
               "RB_BROKER_URL": self.redis_url, "RB_DATABASE_URL": self.db_url,
               "RB_LEASE_SECONDS": "2", "RB_WF_QUEUE": self.queue, **extra}
        for k in ("RB_WF_KILL_AT", "RB_WF_KILL_FILE"):
            if k not in extra:
                env.pop(k, None)
        return env

    def start(self, name: str, args: list[str], **extra: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        proc = subprocess.Popen(args, env=self.env(**extra), stdout=log,
                                stderr=subprocess.STDOUT, cwd=self.tmp)
        self.procs.append(proc)
        return proc

    def worker(self, concurrency: int = 1, queue: str | None = None,
               **extra: str) -> subprocess.Popen[bytes]:
        queue = queue or self.queue
        if queue != self.queue:
            extra = {"RB_WF_QUEUE": queue, **extra}
        return self.start("worker", [sys.executable, "-m", "celery", "-A", "wf_app", "worker",
                                     "--pool", "solo" if concurrency == 1 else "prefork",
                                     "-c", str(concurrency), "-Q", queue,
                                     "-n", f"w-{uuid.uuid4().hex[:6]}@%h", "--without-gossip",
                                     "--without-mingle", "--without-heartbeat", "-l", "INFO"],
                          **extra)

    def relay(self) -> subprocess.Popen[bytes]:
        return self.start("relay", [sys.executable, "-m", "reliable_beat.cli", "-A", "wf_app",
                                    "relay", "--claim-lease-seconds", "3"])

    def cli(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "reliable_beat.cli", "-A", "wf_app",
                               *args], env=self.env(**extra), cwd=self.tmp,
                              capture_output=True, text=True, timeout=120)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)

    def effects(self) -> dict[tuple[str, str], int]:
        with self.store.engine.connect() as conn:
            rows = conn.execute(sa.select(wf_effects.c.kind, wf_effects.c.key, sa.func.count())
                                .group_by(wf_effects.c.kind, wf_effects.c.key)).all()
        return {(k, key): n for k, key, n in rows}


def wait(what: str, cond: Callable[[], Any], rig: Rig, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{rig.logs()}")


@pytest.fixture
def rig(server_url: str, redis_url: str, server_store: Store, tmp_path: Path) -> Iterator[Rig]:
    meta.create_all(server_store.engine)
    r = Rig(server_url, redis_url, server_store, tmp_path)
    try:
        yield r
    finally:
        r.kill_all()


def expected(shape: str, wid: str, order: str) -> tuple[list[tuple[Any, ...]], Any]:
    """(events as (seq, kind, name, state, result), workflow result) of a crash-free run."""
    if shape == "wfa.linear":
        charge = {"charged": 500, "order": order}
        evs = [(1, "transaction", "reserve", "completed", f"{order}:reserve"),
               (2, "activity", "wfa.charge", "completed", charge),
               (3, "step", "mail", "completed", f"{wid}:mail"),
               (4, "timer", None, "completed", None),
               (5, "activity", "wfa.label", "completed", f"label-{order}-1")]
        return evs, [f"{order}:reserve", charge, f"{wid}:mail", f"label-{order}-1"]
    if shape == "wfa.fanout":
        charges = [{"charged": n, "order": order} for n in (1, 2, 3)]
        evs = [(n, "activity", "wfa.charge", "completed", charges[n - 1]) for n in (1, 2, 3)]
        evs.append((4, "transaction", "total", "completed", f"{order}:total"))
        return evs, [charges, f"{order}:total"]
    if shape == "wfa.race":
        label, charge = f"label-{order}-3", {"charged": 9, "order": order}
        evs = [(1, "activity", "wfa.label", "completed", label),
               (2, "activity", "wfa.charge", "completed", charge),
               (3, "wait_any", None, "completed", "ANY"),
               (4, "transaction", "raced", "completed", f"{order}:raced")]
        return evs, [[label, charge], f"{order}:raced"]
    evs = [(1, "activity", "wfa.label", "completed", f"label-{order}-7"),
           (2, "signal", "go", "completed", {"ok": order}),
           (3, "transaction", "approved", "completed", f"{order}:approved"),
           (4, "now", None, "completed", "NOW")]
    return evs, [f"label-{order}-7", {"ok": order}, f"{order}:approved"]


def events(store: Store, wid: str) -> list[tuple[Any, ...]]:
    """(seq, kind, name, state, result); ``now`` results read ``NOW``, a ``wait_any`` result
    (the index seen first: 0 or 1, by timing) reads ``ANY``."""
    row = engine.get_workflow(store, wid, events=True)
    out = []
    for e in row["events"]:
        result = e["result"]
        if e["kind"] == "now":
            result = "NOW"
        elif e["kind"] == "wait_any":
            assert result in (0, 1), e
            result = "ANY"
        out.append((e["seq"], e["kind"], e["name"], e["state"], result))
    return out


@dataclass
class Lane:
    """One shape of a grid row: its workflow, its queue, its worker and its kills."""

    shape: str
    wid: str
    order: str
    queue: str
    worker: subprocess.Popen[bytes] | None = None
    kills: int = 0
    signalled: bool = False


def run_shapes(rig: Rig, point: str | None, shapes: list[str] = SHAPES) -> list[Lane]:
    """One workflow of each shape, each on its own queue and solo worker (killing itself at
    ``point``, up to three times, then a clean one), driven to the end."""
    lanes = []
    for shape in shapes:
        short = shape.split(".")[1]
        order = f"{short}-{uuid.uuid4().hex[:6]}"
        lane = Lane(shape, f"{point or 'clean'}/{order}", order, f"{rig.queue}-{short}")
        engine.start(rig.store, shape, lane.wid, [order], queue=lane.queue)
        lanes.append(lane)

    def spawn(lane: Lane) -> subprocess.Popen[bytes]:
        marker = rig.tmp / f"kill-{lane.shape}-{point}-{lane.kills}"
        extra = ({"RB_WF_KILL_AT": str(point), "RB_WF_KILL_FILE": str(marker)}
                 if point and lane.kills < KILLS else {})
        return rig.worker(queue=lane.queue, **extra)

    for lane in lanes:
        lane.worker = spawn(lane)
    deadline = time.monotonic() + 420
    states: list[str] = []
    while time.monotonic() < deadline:
        states = [engine.get_workflow(rig.store, lane.wid)["state"] for lane in lanes]
        if all(s in ("completed", "failed", "blocked") for s in states):
            break
        for lane in lanes:
            # the signal goes once the wait is recorded (``scheduled``): its consumption is
            # then always the advance's completing transaction (complete.* apply)
            if (lane.shape == "wfa.signal" and not lane.signalled
                    and len(events(rig.store, lane.wid)) >= 2):
                engine.signal(rig.store, lane.wid, "go", {"ok": lane.order},
                              key=f"go:{lane.wid}")
                lane.signalled = True
            assert lane.worker is not None
            if lane.worker.poll() is not None:  # killed itself at the point
                lane.kills += 1
                lane.worker = spawn(lane)
        time.sleep(0.2)
    else:
        raise AssertionError(f"point {point}: not finished {states}\n{rig.logs()}")
    for lane in lanes:
        assert lane.worker is not None
        lane.worker.kill()
        lane.worker.wait(timeout=10)
    return lanes


def check(rig: Rig, lanes: list[Lane], point: str | None) -> None:
    """Same final state, same event list and result as the crash-free run; transaction and
    activity effects exactly once, step effects at least once, every expected effect there."""
    eff = rig.effects()
    for lane in lanes:
        row = engine.get_workflow(rig.store, lane.wid)
        assert row["state"] == "completed", (point, lane.wid, row, rig.logs())
        evs, result = expected(lane.shape, lane.wid, lane.order)
        assert events(rig.store, lane.wid) == evs, (point, lane.wid)
        assert row["result"] == result, (point, lane.wid)
        mine = {(k, key): n for (k, key), n in eff.items()
                if lane.order in key or lane.wid in key}
        for (kind, key), n in mine.items():
            if kind == "step":
                assert n >= 1
            else:
                assert n == 1, (point, kind, key, n)
        want = {"wfa.linear": {"transaction": 1, "activity": 1, "step": 1},
                "wfa.fanout": {"transaction": 1, "activity": 3},
                "wfa.signal": {"transaction": 1},
                "wfa.race": {"transaction": 1, "activity": 1}}[lane.shape]
        got = {k: len([1 for (kind, _) in mine if kind == k]) for k in want}
        assert got == want, (point, lane.wid, got, want)


def _dialect(rig: Rig) -> str:
    return "mariadb" if rig.store.dialect in ("mysql", "mariadb") else rig.store.dialect


@pytest.mark.parametrize("point", POINTS)
def test_crash_matrix(rig: Rig, point: str) -> None:
    rig.relay()
    lanes = run_shapes(rig, point)
    check(rig, lanes, point)
    kills = {lane.shape: len(list(rig.tmp.glob(f"kill-{lane.shape}-{point}-*")))
             for lane in lanes}
    GRID[(_dialect(rig), point)] = kills
    print(f"MATRIX {point}: " + ", ".join(f"{s} {n}" for s, n in kills.items())
          + " SIGKILLs; all completed identically, divergences 0")
    for shape, n in kills.items():
        if (point, shape) in NOT_APPLICABLE:
            assert n == 0, f"{point} x {shape} is marked n/a but was hit {n} times"
        else:
            assert n >= 1, f"{point} was never reached by {shape}"


def test_crash_matrix_summary() -> None:
    """Run after the matrix (file order): print the grid, write it to $RB_WF_MATRIX_FILE."""
    if not GRID:
        pytest.skip("the crash matrix did not run in this session")
    lines = []
    for dialect in sorted({d for d, _ in GRID}):
        rows = [(p, GRID[(d, p)]) for d, p in GRID if d == dialect]
        hit = [(p, s, k[s]) for p, k in rows for s in SHAPES if (p, s) not in NOT_APPLICABLE]
        cells = len(hit)
        kills = sum(n for _, _, n in hit)
        lines.append(f"#### {dialect}: {len(rows)} points, {cells} cells, {kills} SIGKILLs, "
                     "divergences 0")
        lines.append("")
        lines.append("| point | " + " | ".join(SHAPES) + " |")
        lines.append("|---|" + "---|" * len(SHAPES))
        for p, k in rows:
            lines.append(f"| `{p}` | " + " | ".join(
                "n/a" if (p, s) in NOT_APPLICABLE else str(k[s]) for s in SHAPES) + " |")
        lines.append("")
    text = "\n".join(lines)
    print("\n" + text)
    out = os.environ.get("RB_WF_MATRIX_FILE")
    if out:
        Path(out).write_text(text + "\n")


def test_clean_run_and_cli(rig: Rig) -> None:
    rig.relay()
    lanes = run_shapes(rig, None)
    check(rig, lanes, None)
    out = rig.cli("workflows", "list", "--json")
    assert out.returncode == 0, out.stderr
    assert lanes[0].wid in out.stdout
    out = rig.cli("workflows", "replay", "--json")
    assert out.returncode == 0, out.stdout + out.stderr


def test_timer_across_a_full_restart(rig: Rig) -> None:
    """20 workflows sleep 20 s; every worker and relay is SIGKILLed during the sleep and
    restarted only after every timer is due: each wakes once, soon after the restart; while
    they slept the only worker (solo pool: one slot) ran other work, so no slot was held."""
    relay = rig.relay()
    worker = rig.worker()
    wids = [f"sleep/{i}" for i in range(20)]
    for i, wid in enumerate(wids):
        engine.start(rig.store, "wfa.sleeper", wid, [f"sl{i}", 20.0], queue=rig.queue)
    wait("all 20 asleep", lambda: all(
        engine.get_workflow(rig.store, w)["state"] == "waiting"
        and len(events(rig.store, w)) == 1 for w in wids), rig, timeout=60)
    # the one worker slot is free: other workflows run to the end meanwhile
    others = [f"busy/{i}" for i in range(3)]
    for i, wid in enumerate(others):
        engine.start(rig.store, "wfa.fanout", wid, [f"busy{i}"], queue=rig.queue)
    wait("other work done during the sleep", lambda: all(
        engine.get_workflow(rig.store, w)["state"] == "completed" for w in others), rig,
        timeout=60)
    assert all(engine.get_workflow(rig.store, w)["state"] == "waiting" for w in wids)
    for p in (worker, relay):
        p.kill()
        p.wait(timeout=10)
    with rig.store.engine.connect() as conn:  # every timer is due while nothing runs
        last = max(e["fire_at"] for w in wids
                   for e in engine.get_workflow(rig.store, w, events=True)["events"])
        left = last - db_now(conn)
    time.sleep(max(left.total_seconds(), 0) + 3)
    restarted = time.monotonic()
    rig.relay()
    rig.worker()
    wait("all 20 awake", lambda: all(
        engine.get_workflow(rig.store, w)["state"] == "completed" for w in wids), rig,
        timeout=90)
    took = time.monotonic() - restarted
    print(f"20 timers woke {took:.1f} s after the restart")
    eff = rig.effects()
    for i, wid in enumerate(wids):
        evs = events(rig.store, wid)
        assert [e[1:4] for e in evs] == [("timer", None, "completed"),
                                         ("transaction", "woke", "completed")]
        assert eff[("transaction", f"sl{i}:woke")] == 1
    assert took < 60, took


def test_timer_wake_lost_by_the_broker_is_sent_again(rig: Rig) -> None:
    """Fresh-user finding 2: a workflow sleeps; its worker is stopped; the relay publishes
    the timer's wake; Redis loses it (FLUSHDB: a restart without persistence); a worker
    starts. The relay's workflow sweep wakes it (RB_REDISPATCH_SECONDS=8 after the timer)
    and it completes, its transaction once (on main it stayed `waiting` for ever)."""
    import redis

    rig.relay()
    worker = rig.worker()
    wid = "lostwake/1"
    engine.start(rig.store, "wfa.sleeper", wid, ["lw1", 3.0], queue=rig.queue)
    wait("asleep", lambda: engine.get_workflow(rig.store, wid)["state"] == "waiting"
         and len(events(rig.store, wid)) == 1, rig, timeout=60)
    worker.kill()
    worker.wait(timeout=10)

    def wake_sent() -> bool:
        with rig.store.engine.connect() as conn:
            return conn.execute(sa.text(
                "SELECT state FROM reliable_beat_outbox WHERE message_id = :k"),
                {"k": f"wake:{wid}:1t1"}).scalar() == "sent"

    wait("the timer's wake published by the relay", wake_sent, rig, timeout=60)
    redis.Redis.from_url(rig.redis_url).flushdb()  # the broker loses it
    lost = time.monotonic()
    rig.worker()
    wait("the workflow woken by the sweep", lambda: engine.get_workflow(
        rig.store, wid)["state"] == "completed", rig, timeout=120)
    print(f"lost timer wake: completed {time.monotonic() - lost:.1f} s after the loss")
    assert [e[1:4] for e in events(rig.store, wid)] == [
        ("timer", None, "completed"), ("transaction", "woke", "completed")]
    assert rig.effects()[("transaction", "lw1:woke")] == 1


def _signal_retrying(store: Store, i: int) -> None:
    """MariaDB: ``engine.signal`` of tick ``i``, sent again under its key while it times out
    on the workflow row's lock (InnoDB's foreign-key check of the inbox row waits for a
    holder frozen inside one of its transactions). The key makes the retry the same signal,
    never a second. PostgreSQL needs no retry: signal() never waits for an advance there."""
    from reliable_beat.db.dialects import is_lock_wait

    deadline = time.monotonic() + 90
    while True:
        try:
            engine.signal(store, "ticks", "tick", i, key=f"tick:{i}")
            return
        except sa.exc.OperationalError as exc:
            if not is_lock_wait(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_signal_returns_at_once_while_the_worker_is_frozen_inside_an_advance(
        rig: Rig) -> None:
    """The worker holding the workflow is SIGSTOPped inside an advance's transaction (the
    workflow row locked by its fence check): ``signal`` returns in under a second (before
    the fix it waited ``lock_timeout`` and raised LockNotAvailable to the sender). A second
    worker gets the signal's wake meanwhile and finds the lease held; after SIGCONT the
    signal is consumed exactly once. PostgreSQL only: on MariaDB the inbox row's foreign-key
    check waits for the row lock (docs/workflows.md, "What signal() guarantees")."""
    if rig.store.dialect != "postgresql":
        pytest.skip("MariaDB: signal() still waits for an advance's transaction (FK lock)")
    rig.relay()
    for _ in range(2):
        rig.worker(RB_LEASE_SECONDS="30")
    marker = rig.tmp / "held.pid"
    engine.start(rig.store, "wfa.held", "held", [str(marker), 1.0], queue=rig.queue)
    wait("the advance inside its transaction",
         lambda: marker.exists() and marker.read_text(), rig, timeout=60)
    frozen = int(marker.read_text())
    os.kill(frozen, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert engine.signal(rig.store, "held", "go", {"ok": 1}, key="held:go") is True
        took = time.monotonic() - t0
        time.sleep(3)  # the relay publishes the signal's wake; the other worker meets the lock
    finally:
        os.kill(frozen, signal.SIGCONT)
    print(f"signal() returned in {took * 1000:.0f} ms with the holder frozen in its transaction")
    assert took < 1.0, f"signal() took {took:.2f} s"
    wait("the signal consumed", lambda: engine.get_workflow(rig.store, "held")["state"]
         == "completed", rig, timeout=120)
    row = engine.get_workflow(rig.store, "held", events=True)
    assert row["result"] == ["held", {"ok": 1}]
    assert [(e["kind"], e["state"]) for e in row["events"]] == [
        ("transaction", "completed"), ("signal", "completed")]
    assert [s["consumed_seq"] for s in row["signals"]] == [2]


def test_signals_in_a_tight_loop_with_a_stopped_worker(rig: Rig) -> None:
    """Two workers; 30 signals sent in a tight loop while advances run; the worker holding
    the workflow is SIGSTOPped mid-advance, kept stopped until the other worker took the
    workflow over (past the 2 s lease), then continued: every signal is consumed exactly
    once, in order, and the fenced-out advance writes nothing after the takeover."""
    rig.relay()
    workers = {p.pid: p for p in (rig.worker(), rig.worker())}
    n = 30
    engine.start(rig.store, "wfa.ticks", "ticks", [n], queue=rig.queue)

    def holder() -> int | None:
        row = engine.get_workflow(rig.store, "ticks")
        owner = row["leased_by"] or ""
        pid = int(owner.rsplit(":", 1)[1]) if ":" in owner else None
        return pid if row["state"] == "running" and pid in workers else None

    for i in range(5):
        engine.signal(rig.store, "ticks", "tick", i, key=f"tick:{i}")
    stopped = wait("an advance running", holder, rig, timeout=60)
    stopped_fence = engine.get_workflow(rig.store, "ticks")["fence_token"]
    os.kill(stopped, signal.SIGSTOP)
    slowest = 0.0
    for i in range(5, n):  # the tight loop goes on while the holder is frozen
        t0 = time.monotonic()
        if rig.store.dialect == "postgresql":  # never waits on the frozen holder
            engine.signal(rig.store, "ticks", "tick", i, key=f"tick:{i}")
        else:
            _signal_retrying(rig.store, i)
        slowest = max(slowest, time.monotonic() - t0)
    if rig.store.dialect == "postgresql":
        assert slowest < 5.0, f"a signal took {slowest:.1f} s with the holder frozen"
    # past the frozen advance's lease, the other worker (woken by a signal's wake or the
    # relay's sweep) takes the workflow over with a newer fence
    wait("the other worker to take over", lambda: engine.get_workflow(
        rig.store, "ticks")["fence_token"] > stopped_fence, rig, timeout=90)
    os.kill(stopped, signal.SIGCONT)
    wait("all signals consumed", lambda: engine.get_workflow(rig.store, "ticks")["state"]
         == "completed", rig, timeout=180)
    row = engine.get_workflow(rig.store, "ticks", events=True)
    assert row["result"] == list(range(n))
    assert [e["kind"] for e in row["events"]] == ["signal", "step"] * n
    consumed = [s["consumed_seq"] for s in row["signals"]]
    assert None not in consumed and len(set(consumed)) == n
    # the frozen advance wrote nothing once it lost the workflow: the fence tokens of the
    # events never go down along the history
    fences = [e["fence_token"] for e in row["events"]]
    assert fences == sorted(fences)
    assert max(fences) > stopped_fence


@pytest.mark.full  # CI size: test_workflow_versions.py rolls parked runs
def test_reordered_v2_blocks_parked_workflows_and_replay_names_them(rig: Rig) -> None:
    """v1 workers park 5 workflows on wait_signal; the workers are replaced by a reordered
    v2: every workflow woken is blocked with zero new events and nothing dispatched;
    `workflows replay` under v2 exits 1 naming them; back on v1, `workflows resume`
    completes them."""
    rig.relay()
    v1 = rig.worker()
    wids = [f"ver/{i}" for i in range(5)]
    for i, wid in enumerate(wids):
        engine.start(rig.store, "wfa.signal", wid, [f"ver{i}"], queue=rig.queue)
    wait("5 parked on the signal", lambda: all(
        len(events(rig.store, w)) == 2 for w in wids), rig)
    before = {w: events(rig.store, w) for w in wids}
    v1.kill()
    v1.wait(timeout=10)
    rig.worker(RB_WF_V2="1")
    for w in wids:
        engine.signal(rig.store, w, "go", {"ok": w}, key=f"go:{w}")
    wait("all blocked", lambda: all(
        engine.get_workflow(rig.store, w)["state"] == "blocked" for w in wids), rig)
    for w in wids:
        row = engine.get_workflow(rig.store, w)
        assert "seq 1: code did signal go" in row["block_reason"], row["block_reason"]
        assert "history has activity wfa.label" in row["block_reason"]
        assert events(rig.store, w) == before[w]  # nothing written
    with rig.store.engine.connect() as conn:  # nothing dispatched by v2
        n = conn.execute(sa.text("SELECT count(*) FROM reliable_beat_outbox WHERE "
                                 "message_id LIKE 'act:%'")).scalar_one()
    assert n == 5
    out = rig.cli("workflows", "replay", "--json", RB_WF_V2="1")
    assert out.returncode == 1, out.stdout + out.stderr
    for w in wids:
        assert w in out.stdout
    out = rig.cli("workflows", "replay")  # the v1 code matches every history
    assert out.returncode == 0, out.stdout + out.stderr
    rig.kill_all()
    rig.relay()
    rig.worker()
    for w in wids:
        assert rig.cli("workflows", "resume", w, "--json").returncode == 0
    wait("all completed on v1", lambda: all(
        engine.get_workflow(rig.store, w)["state"] == "completed" for w in wids), rig)


def test_killed_between_the_handoff_publish_and_its_mark(rig: Rig) -> None:
    """A worker publishes a workflow's next message (an activity's, a wake) itself right
    after its commit, then marks it sent (reliable_beat.handoff). SIGKILLed between the
    publish and the mark, the row stays pending: the relay sends it again under the same
    message id and task id, and every shape ends as a clean run, each transaction and
    activity effect once."""
    rig.relay()
    point = "handoff.before_mark"
    lanes = run_shapes(rig, point)
    check(rig, lanes, point)
    for lane in lanes:
        assert list(rig.tmp.glob(f"kill-{lane.shape}-{point}-*")), (lane.shape, rig.logs())


def test_killed_between_an_activity_and_its_in_process_advance(rig: Rig) -> None:
    """The worker that completes a workflow's activity advances the workflow itself right
    after the activity's commit (no wake through the broker); the wake row stays pending,
    due to the relay after HANDOFF_DELAY, until that advance's release marks it sent.
    SIGKILLed in that window (``handoff.before_advance``: the activity's effect, result and
    history event committed, nothing of the advance yet), the relay sends the wake and
    every shape (each calls an activity) ends as a clean run, each effect once."""
    rig.relay()
    point = "handoff.before_advance"
    lanes = run_shapes(rig, point)
    check(rig, lanes, point)
    for lane in lanes:
        assert list(rig.tmp.glob(f"kill-{lane.shape}-{point}-*")), (lane.shape, rig.logs())


def test_a_handed_off_message_also_relayed_makes_one_effect(
    rig: Rig, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every message a worker hands off is also sent by the relay: the workers skip the
    mark as if they died between the publish and the mark (RB_WF_HANDOFF_UNMARKED), so
    each activity message and each activity's wake reaches the broker twice. The second
    copies are received (each activity's is deduplicated by its key, an advance's finds
    nothing new in the history) and every shape ends as a clean run, effects once. (A wake
    still pending when its workflow ends is dropped with it, as a timer's is.)"""
    monkeypatch.setenv("RB_WF_HANDOFF_UNMARKED", "1")
    rig.relay()
    lanes = run_shapes(rig, None)
    for lane in lanes:  # the relayed copies arrive after HANDOFF_DELAY: drain them
        rig.worker(queue=lane.queue)
    outbox = sa.table("reliable_beat_outbox", sa.column("message_id"), sa.column("state"),
                      sa.column("attempts"))
    attempts = sa.table("reliable_beat_attempts", sa.column("run_id"), sa.column("outcome"))
    run_rows = sa.table("reliable_beat_runs", sa.column("id"), sa.column("idempotency_key"))
    wids = [lane.wid for lane in lanes]
    seen: dict[str, Any] = {}

    def relayed_and_deduplicated() -> bool:
        with rig.store.engine.connect() as conn:
            rows = conn.execute(sa.select(outbox.c.message_id, outbox.c.state,
                                          outbox.c.attempts)).all()
            acts = [r for r in rows if r.message_id.startswith("act:wf:")
                    and any(r.message_id.startswith(f"act:wf:{w}/") for w in wids)]
            wakes = [r for r in rows if r.message_id.startswith("wake:")
                     and any(r.message_id.startswith(f"wake:{w}:1#") for w in wids)]
            keys = [r.message_id[4:] for r in acts]
            seen["acts"], seen["wakes"] = acts, wakes
            deduplicated = set(conn.execute(
                sa.select(run_rows.c.idempotency_key)
                .join(attempts, attempts.c.run_id == run_rows.c.id)
                .where(run_rows.c.idempotency_key.in_(keys),
                       attempts.c.outcome == "deduplicated")).scalars())
            seen["deduplicated"] = deduplicated
        # every handed-off row was published by its worker and sent again by the relay (a
        # wake still pending when its workflow ended is dropped with it: drop_wakes)
        return (len(acts) == 8
                and all(r.state == "sent" and r.attempts >= 1 for r in acts + wakes)
                and deduplicated == set(keys))

    try:
        wait("every handed-off message relayed too, each activity's copy deduplicated",
             relayed_and_deduplicated, rig, timeout=60)
    except AssertionError:
        raise AssertionError(f"{seen}") from None
    check(rig, lanes, None)
