"""A rolling deploy across two revisions of reliable_beat, with real processes on real
PostgreSQL + Redis: old and new ``celery beat`` processes alternate on one database, each
started beside the previous one and SIGKILLed a random moment later, with runs in flight,
while one old and one new ``celery worker`` execute.

The old code is revision :data:`OLD_REVISION` (``RB_ROLLING_OLD_REVISION`` overrides it),
extracted from this repository's git history (:mod:`harness.oldcode`); each old process has
it first on ``PYTHONPATH``, the app (``tests/apps/rolling_app.py``) is the current tree's.
The schema starts as the old code's (``reliable-beat db upgrade`` run by the old code), the
first old beat fires on it, then the current code's migration runs while its runs are in
flight, then the beats roll: old A, new B beside it, SIGKILL A, old C, SIGKILL B, ..., and
a last new beat runs until every slot settled. The test is skipped, saying why, when git or
the revision is missing (a shallow clone: ``git fetch --unshallow``).

Entries fire every second: ``effect-*`` an ``IdempotentTask`` writing one effect row per
slot (a table without a unique constraint), ``plain-*`` a plain task whose trigger messages
stay in their queue, counted. Every whole second between the first and the last slot:

* ``IdempotentTask``: exactly one effect (nothing lost, nothing doubled), its run
  ``succeeded``;
* plain task: at least one message; more than one only for a slot whose publishing beat was
  SIGKILLed between the broker accepting the message and the ``sent`` mark, which
  ``docs/concepts.md`` ("a second trigger") leaves to the task: such a slot gets at most two,
  and only when a SIGKILL came between the slot and the sweep delay after it (10 s); its run
  ends ``dispatched`` (a plain task keeps no run state past its trigger's publish);
* no run left ``scheduled`` and no trigger row left unsent; no ``IdempotentTask`` run left
  ``dispatched``/``running``.

CI size: 6 beats (3 old, 3 new; 5 SIGKILLs), 100 slots checked, 36 s on a quiet machine
(2026-12-07; most of it the beats' start-up and, after the last SIGKILL, the sweep delay of
a trigger the killed beat held). The ``full`` variant rolls 12 beats and also SIGKILLs the
workers, restarting each on the other code (56 s). Against an old revision whose beat never
let another process sweep its trigger rows, this test names the lost slots (left
``scheduled``, no effect, no message).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import func, select

from harness.oldcode import ROOT, OldCode, OldCodeError, extract, probe
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import current, head, upgrade
from reliable_beat.db.tables import outbox, runs

APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))
import procs as procs_mod  # noqa: E402  (tests/apps)
from rolling_app import effects, meta  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(240)]

#: The old side of the roll: the last commit before the beat stopped writing a trigger row
#: for a slot it publishes at once. Any revision whose reliable_beat runs rolling_app works.
OLD_REVISION = "9259a59"
OLD = os.environ.get("RB_ROLLING_OLD_REVISION", OLD_REVISION)
SECOND = timedelta(seconds=1)
ENTRIES = ["effect-cron", "effect-every", "plain-cron", "plain-every"]
START_TIMEOUT = 90.0  # a celery process starting on a loaded 2-core machine
#: The sweep delay: a trigger a SIGKILLed beat left unsent is published by another beat
#: after slot + this, so a second message of a plain task's slot needs a SIGKILL inside it.
SWEEP_DELAY = 10
SETTLE_TIMEOUT = 45.0


@pytest.fixture(scope="module")
def old_code(tmp_path_factory: pytest.TempPathFactory) -> OldCode:
    """Revision :data:`OLD`'s reliable_beat, extracted; skipped when unavailable."""
    try:
        old = extract(OLD, tmp_path_factory.mktemp("old-code"))
    except OldCodeError as exc:
        pytest.skip(f"the old revision is unavailable, so old and new code cannot be rolled: "
                    f"{exc}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(APPS)])}
    probe(old, env, ["rolling_app", "reliable_beat.celery:ReliableScheduler"], [],
          "tests/apps/rolling_app.py")
    return old


class Roll:
    """The database, the broker's plain queue and the processes of one roll."""

    def __init__(self, url: str, redis_url: str, old: OldCode, tmp: Path) -> None:
        self.url = url
        self.old = old
        self.engine = sa.create_engine(url)
        self.redis = redis.Redis.from_url(redis_url)
        tag = uuid.uuid4().hex[:8]
        self.plain_queue, self.effect_queue = f"rolling-plain-{tag}", f"rolling-effect-{tag}"
        self.procs = procs_mod.BeatProcs(logdir=tmp)
        self.procs.env.update(
            RB_BROKER_URL=redis_url, RELIABLE_BEAT_DATABASE_URL=url, RB_QUEUE=self.plain_queue,
            RB_EFFECT_QUEUE=self.effect_queue, RB_ENTRIES=json.dumps(ENTRIES), RB_MAX_LOOP="1")
        self.events: list[str] = []
        #: database-clock instants just after each SIGKILL of a beat
        self.kills: list[datetime] = []
        self.code: dict[int, str] = {}  # pid -> "old" | "new"

    def now(self) -> datetime:
        with self.engine.connect() as conn:
            value: datetime = conn.execute(select(func.clock_timestamp())).scalar_one()
        return value

    def select(self, stmt: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(stmt))

    def start(self, kind: str, code: str, n: int) -> procs_mod.Beat:
        name = f"{kind}{n}-{code}"
        if kind == "beat":
            command = ["beat", "-l", "info", "--pidfile=", "-s",
                       str(self.procs.logdir / f"{name}-schedule")]
        else:
            command = ["worker", "--pool", "solo", "-Q", self.effect_queue, "-n", f"{name}@%h",
                       "--without-gossip", "--without-mingle", "--without-heartbeat", "-l",
                       "info"]
        proc = self.procs.start(name, command=command, app="rolling_app",
                                code=self.old.tree if code == "old" else None)
        self.code[proc.pid] = code
        self.events.append(f"{self.now():%H:%M:%S.%f} {name} pid {proc.pid} started")
        return proc

    def kill(self, proc: procs_mod.Beat) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.proc.wait(timeout=10)
        at = self.now()
        if proc.name.startswith("beat"):
            self.kills.append(at)
        self.events.append(f"{at:%H:%M:%S.%f} {proc.name} pid {proc.pid} SIGKILL")

    def messages(self) -> dict[str, Counter[datetime]]:
        """Entry -> slot -> trigger messages in the plain task's queue."""
        out: dict[str, Counter[datetime]] = {}
        for raw in self.redis.lrange(self.plain_queue, 0, -1):
            key = json.loads(raw)["headers"]["reliable_beat_key"]
            name, _, slot = key.partition("@")
            out.setdefault(name, Counter())[
                datetime.fromisoformat(slot.replace("Z", "+00:00"))] += 1
        return out

    def unsettled(self, upto: datetime | None = None) -> list[str]:
        """What is still in flight among the slots up to ``upto`` (all when None): an
        ``IdempotentTask`` run not ``succeeded``, a plain run not ``dispatched``, a trigger row
        not sent."""
        cond = [runs.c.fire_at <= upto] if upto is not None else []
        rows = self.select(select(runs.c.idempotency_key, runs.c.task, runs.c.state)
                           .where(*cond))
        out = [f"{r.idempotency_key} {r.state}" for r in rows
               if r.state != ("succeeded" if r.task == "rolling.effect" else "dispatched")]
        unsent = self.select(select(outbox.c.message_id, outbox.c.state).select_from(
            outbox.join(runs, outbox.c.run_id == runs.c.id)).where(
            outbox.c.state != "sent", *cond))
        return out + [f"{m.message_id} {m.state}" for m in unsent]

    def logs(self) -> str:
        return "\n".join(f"--- {b.name} (pid {b.pid}) ---\n{b.output()[-3000:]}"
                         for b in self.procs.beats)


@pytest.fixture
def roll(pg_url: str, redis_url: str, old_code: OldCode, tmp_path: Path) -> Iterator[Roll]:
    logdir = tmp_path / "logs"  # not tmp_path itself: the processes' cwd holds no package
    logdir.mkdir()
    r = Roll(pg_url, redis_url, old_code, logdir)
    try:
        yield r
    finally:
        r.procs.cleanup()
        r.redis.delete(r.plain_queue, r.effect_queue)
        r.redis.close()
        r.engine.dispose()


def synced(beat: procs_mod.Beat) -> bool:
    """The beat finished its start-up sync and runs its loop (both log lines: the code
    before schedule groups logged the second)."""
    out = beat.output()
    return "reliable_beat: schedule group" in out or "reliable_beat: synced beat_schedule" in out


def up(r: Roll, beat: procs_mod.Beat) -> None:
    procs_mod.wait_for(lambda: synced(beat) or not beat.alive(), START_TIMEOUT,
                       f"{beat.name} to start")
    assert beat.alive(), r.logs()
    r.events.append(f"{r.now():%H:%M:%S.%f} {beat.name} synced")


def seconds(t0: datetime, t1: datetime) -> list[datetime]:
    s = t0.replace(microsecond=0) + (SECOND if t0.microsecond else timedelta(0))
    out = []
    while s <= t1:
        out.append(s)
        s += SECOND
    return out


def migrate_old_schema(r: Roll) -> str:
    """The old code creates the schema (its own ``reliable-beat db upgrade``); returns its
    revision."""
    env = r.old.env({**os.environ, "RELIABLE_BEAT_DATABASE_URL": r.url, "PYTHONPATH": ""})
    done = subprocess.run([sys.executable, "-m", "reliable_beat.cli", "db", "upgrade"],
                          cwd=r.old.tree, env=env, capture_output=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    store = Store.from_url(r.url, role="cli")
    try:
        revision = current(store)
    finally:
        store.dispose()
    assert revision is not None
    meta.create_all(r.engine)
    return revision


def rolling_deploy(r: Roll, beats: int, rng: random.Random, kill_workers: bool) -> None:
    """Old beat A alone on the old schema, the new schema migrated under it, then beats
    alternating new/old up to ``beats`` (even: the last is new), each up beside the previous,
    which is SIGKILLed a random moment later. The last runs until every slot claimed before
    the last SIGKILL settled (a trigger the killed beat left unsent: by its sweep, after slot
    + the sweep delay); then it stops (SIGTERM) and the workers finish what it published."""
    assert beats % 2 == 0, "the roll ends on new code"
    old_schema = migrate_old_schema(r)
    workers = [r.start("worker", "old", 0), r.start("worker", "new", 1)]
    beat = r.start("beat", "old", 0)
    up(r, beat)
    procs_mod.wait_for(lambda: r.select(select(runs.c.id).limit(1)), 30, "the first slot")
    time.sleep(rng.uniform(1.0, 3.0))  # the old beat fires on the old schema for a while
    store = Store.from_url(r.url, role="cli")
    try:
        upgrade(store)  # the new code's migration, with the old beat's runs in flight
    finally:
        store.dispose()
    r.events.append(f"{r.now():%H:%M:%S.%f} schema {old_schema} -> {head()}")
    for n in range(1, beats):
        nxt = r.start("beat", "new" if n % 2 else "old", n)
        up(r, nxt)
        time.sleep(rng.uniform(0.2, 1.5))  # both beats claim, then the older one dies
        r.kill(beat)
        beat = nxt
        if kill_workers and rng.random() < 0.5:
            i = rng.randrange(len(workers))
            code = "new" if r.code[workers[i].pid] == "old" else "old"
            r.kill(workers[i])
            workers[i] = r.start("worker", code, len(r.procs.beats))
    assert r.code[beat.pid] == "new"
    # past any slot the killed beat claimed ahead (reliable_beat_claim_ahead_seconds, 0.5 s)
    t1 = r.now() + 2 * SECOND
    settle(r, lambda: not r.unsettled(t1), "the slots up to the last SIGKILL")
    r.procs.terminate(beat, timeout=30)
    # what the last beat published as it stopped is executed (no beat is left to sweep)
    settle(r, lambda: not r.unsettled(), "every slot")
    for w in workers:
        r.procs.terminate(w, timeout=30)


def settle(r: Roll, done: Callable[[], bool], what: str) -> None:
    """Wait until ``done()``, at most :data:`SETTLE_TIMEOUT`; the checks then name what did
    not settle."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            r.events.append(f"{r.now():%H:%M:%S.%f} {what}: NOT settled after "
                            f"{SETTLE_TIMEOUT:.0f} s")
            return
        time.sleep(0.3)
    r.events.append(f"{r.now():%H:%M:%S.%f} {what} settled")


def check(r: Roll) -> dict[str, Any]:
    """The assertions of the module docstring; returns the figures."""
    rows = r.select(select(runs.c.entry_name, runs.c.fire_at, runs.c.state))
    by_entry: dict[str, set[datetime]] = {}
    for row in rows:
        by_entry.setdefault(row.entry_name, set()).add(row.fire_at)
    assert sorted(by_entry) == sorted(ENTRIES), r.logs()
    t0 = max(min(s) for s in by_entry.values())  # every entry fires from here
    t1 = min(max(s) for s in by_entry.values())  # ... to here
    slots = seconds(t0, t1)
    effect_rows = Counter(k for (k,) in r.select(select(effects.c.key)))
    msgs = r.messages()
    problems: list[str] = []
    doubles_in_window = 0
    for name in ENTRIES:
        if name.startswith("effect"):
            problems += [f"{name}@{s:%H:%M:%S}: {effect_rows.get(_key(name, s), 0)} effects"
                         for s in slots if effect_rows.get(_key(name, s), 0) != 1]
            continue
        got = msgs.get(name, Counter())
        for s in slots:
            n = got.get(s, 0)
            killed = any(s <= k <= s + (SWEEP_DELAY + 1) * SECOND for k in r.kills)
            if n == 2 and killed:
                doubles_in_window += 1
            elif n != 1:
                problems.append(f"{name}@{s:%H:%M:%S}: {n} messages"
                                + (" (a SIGKILL in its window)" if killed else ""))
    # any time, not only in the window: no slot has a second effect
    problems += [f"{k}: {n} effects" for k, n in effect_rows.items() if n > 1]
    problems += [f"left {what}" for what in r.unsettled()]
    states = Counter(row.state for row in rows)
    figures = {
        "beats": sum(1 for b in r.procs.beats if "beat" in b.name),
        "old_beats": sum(1 for b in r.procs.beats if b.name.startswith("beat")
                         and r.code[b.pid] == "old"),
        "workers": sum(1 for b in r.procs.beats if b.name.startswith("worker")),
        "sigkills": len(r.kills), "window_s": len(slots), "slots_checked": len(slots) * 4,
        "effects": sum(effect_rows.values()),
        "plain_messages": sum(sum(c.values()) for c in msgs.values()),
        "plain_slots_sent_twice_after_a_sigkill": doubles_in_window,
        "run_states": dict(states), "problems": len(problems),
    }
    print(f"\n[rolling deploy {r.old.label} -> current] {figures}\n" + "\n".join(r.events))
    assert not problems, f"{len(problems)} problems, e.g. {problems[:15]}\n{r.logs()}"
    for b in r.procs.beats:
        out = b.output()
        where = str(r.old.tree) if r.code[b.pid] == "old" else str(ROOT / "reliable_beat")
        assert f"rolling_app: reliable_beat from {where}" in out, out[-3000:]
        if b.name.startswith("beat"):
            assert "Traceback" not in out, out[-3000:]
    return figures


def _key(name: str, slot: datetime) -> str:
    """The slot's idempotency key (``fire_at`` comes back in the session's time zone)."""
    return f"{name}@{slot.astimezone(timezone.utc):%Y-%m-%dT%H:%M:%SZ}"


def test_rolling_deploy_old_and_new_code_alternate(roll: Roll) -> None:
    rng = random.Random(int(os.environ.get("RB_SEED", "5")))
    rolling_deploy(roll, beats=6, rng=rng, kill_workers=False)
    check(roll)


@pytest.mark.full
def test_rolling_deploy_long(roll: Roll) -> None:
    """12 beats (6 old, 6 new) and workers SIGKILLed and restarted on the other code."""
    rng = random.Random(int(os.environ.get("RB_SEED", "6")))
    rolling_deploy(roll, beats=12, rng=rng, kill_workers=True)
    check(roll)
