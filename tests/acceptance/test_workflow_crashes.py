"""Durable workflows on real processes: SIGKILL at every step boundary, timers across a full
restart, signals racing a SIGSTOPped advance. Real ``celery worker`` (solo pool) and
``reliable-beat relay`` processes, PostgreSQL and Redis (tests/apps/wf_app.py).

Crash matrix: for each crash point, the three shapes of wf_app run together on a worker
started with ``RB_WF_KILL_AT=<point>``; each time the worker SIGKILLs itself at that point a
new one is started (at most three kills per point, one marker file each), then a clean one.
Every workflow must end ``completed`` with exactly the expected event list and result, each
transaction and activity effect exactly once, each step effect at least once.

CI runs the short list of points; the full matrix is
``RB_WF_POINTS=all pytest tests/acceptance/test_workflow_crashes.py -k matrix``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.workflows import engine

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
from wf_app import meta, wf_effects  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(900)]

SHORT_POINTS = [
    "advance.after_claim", "record.transaction.in", "record.activity.in",
    "activity.after_commit", "step.after_body", "advance.before_release",
    "advance.before_finish",
]
FULL_POINTS = [
    *SHORT_POINTS,
    "advance.before_claim", "record.transaction.before", "record.transaction.after",
    "record.activity.before", "record.activity.after", "record.step.before",
    "record.step.in", "record.step.after", "record.timer.in", "record.timer.after",
    "record.signal.in", "record.signal.after", "record.now.in", "complete.before",
    "complete.after", "activity.before_return",
]
POINTS = FULL_POINTS if os.environ.get("RB_WF_POINTS") == "all" else SHORT_POINTS


class Rig:
    def __init__(self, pg_url: str, redis_url: str, store: Store, tmp: Path) -> None:
        self.pg_url, self.redis_url, self.store, self.tmp = pg_url, redis_url, store, tmp
        self.tag = uuid.uuid4().hex[:8]
        self.queue = f"wf-{self.tag}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{APPS}",
               "RB_BROKER_URL": self.redis_url, "RB_DATABASE_URL": self.pg_url,
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

    def worker(self, concurrency: int = 1, **extra: str) -> subprocess.Popen[bytes]:
        return self.start("worker", [sys.executable, "-m", "celery", "-A", "wf_app", "worker",
                                     "--pool", "solo" if concurrency == 1 else "prefork",
                                     "-c", str(concurrency), "-Q", self.queue,
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
def rig(pg_url: str, redis_url: str, pg_store: Store, tmp_path: Path) -> Iterator[Rig]:
    meta.create_all(pg_store.engine)
    r = Rig(pg_url, redis_url, pg_store, tmp_path)
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
    evs = [(1, "activity", "wfa.label", "completed", f"label-{order}-7"),
           (2, "signal", "go", "completed", {"ok": order}),
           (3, "transaction", "approved", "completed", f"{order}:approved"),
           (4, "now", None, "completed", "NOW")]
    return evs, [f"label-{order}-7", {"ok": order}, f"{order}:approved"]


def events(store: Store, wid: str) -> list[tuple[Any, ...]]:
    row = engine.get_workflow(store, wid, events=True)
    return [(e["seq"], e["kind"], e["name"], e["state"],
             "NOW" if e["kind"] == "now" else e["result"]) for e in row["events"]]


SHAPES = ["wfa.linear", "wfa.fanout", "wfa.signal"]


def run_shapes(rig: Rig, point: str | None) -> list[str]:
    """Start one workflow of each shape; drive workers (killing at ``point``) to the end."""
    wids = []
    for shape in SHAPES:
        order = f"{shape.split('.')[1]}-{uuid.uuid4().hex[:6]}"
        wid = f"{point or 'clean'}/{order}"
        engine.start(rig.store, shape, wid, [order], queue=rig.queue)
        wids.append(wid)
    kills = 0
    marker = rig.tmp / f"kill-{point}-{kills}"
    worker = rig.worker(**({"RB_WF_KILL_AT": point, "RB_WF_KILL_FILE": str(marker)}
                           if point else {}))
    signalled = False
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        states = [engine.get_workflow(rig.store, w)["state"] for w in wids]
        if all(s in ("completed", "failed", "blocked") for s in states):
            break
        if not signalled and len(events(rig.store, wids[2])) >= 1:
            engine.signal(rig.store, wids[2], "go", {"ok": wids[2].split("/")[1]},
                          key=f"go:{wids[2]}")
            signalled = True
        if worker.poll() is not None:  # killed itself at the point
            kills += 1
            marker = rig.tmp / f"kill-{point}-{kills}"
            extra = ({"RB_WF_KILL_AT": str(point), "RB_WF_KILL_FILE": str(marker)}
                     if point and kills < 3 else {})
            worker = rig.worker(**extra)
        time.sleep(0.2)
    else:
        raise AssertionError(f"point {point}: not finished {states}\n{rig.logs()}")
    worker.kill()
    worker.wait(timeout=10)
    return wids


def check(rig: Rig, wids: list[str], point: str | None) -> None:
    eff = rig.effects()
    for shape, wid in zip(SHAPES, wids, strict=True):
        order = wid.split("/")[1]
        row = engine.get_workflow(rig.store, wid)
        assert row["state"] == "completed", (point, wid, row, rig.logs())
        evs, result = expected(shape, wid, order)
        assert events(rig.store, wid) == evs, (point, wid)
        assert row["result"] == result, (point, wid)
        for kind, key in [(k, key) for (k, key) in eff if order in key or wid in key]:
            n = eff[(kind, key)]
            if kind == "step":
                assert n >= 1
            else:
                assert n == 1, (point, kind, key, n)
    # every expected effect is there
    tx_keys = {key for (k, key) in eff if k == "transaction"}
    assert len([w for w in wids if any(w.split("/")[1] in k for k in tx_keys)]) == 3


@pytest.mark.parametrize("point", POINTS)
def test_crash_matrix(rig: Rig, point: str) -> None:
    rig.relay()
    wids = run_shapes(rig, point)
    check(rig, wids, point)
    kills = len(list(rig.tmp.glob(f"kill-{point}-*")))
    print(f"MATRIX {point}: {kills} SIGKILLs, 3 shapes completed identically, divergences 0")
    assert kills >= 1, f"{point} was never reached"


def test_clean_run_and_cli(rig: Rig) -> None:
    rig.relay()
    wids = run_shapes(rig, None)
    check(rig, wids, None)
    out = rig.cli("workflows", "list", "--json")
    assert out.returncode == 0, out.stderr
    assert wids[0] in out.stdout
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
        last = conn.execute(sa.text(
            "SELECT max(fire_at) - clock_timestamp() FROM reliable_beat_workflow_events "
            "WHERE kind = 'timer'")).scalar_one()
    time.sleep(max(last.total_seconds(), 0) + 3)
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
    for i in range(5, n):  # the tight loop goes on while the holder is frozen
        engine.signal(rig.store, "ticks", "tick", i, key=f"tick:{i}")
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
