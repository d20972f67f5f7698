"""Deployments Celery projects really run, with real processes on real PostgreSQL + Redis:

* a rolling deploy: old and new ``celery beat`` pods alternate for about a minute while the
  schedule changes (one entry's cron changed, one added, one removed, one renamed);
* ``celery worker -B`` on every instance: a deploy of several instances starting and
  stopping at once, killed at random.

Triggers are counted in the broker (each test its own queue; nothing consumes it), so a
doubled or missing slot is seen as a doubled or missing message. Each test prints its
figures for the closing note. ``RELIABLE_BEAT_DEPLOY_SECONDS`` sets how long the pods
alternate: CI size 30 (at least three pod changes: old, new, old again, new again), the full
size 60 (``make test-full``); the ``worker -B`` instances are killed for half of it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

SECOND = timedelta(seconds=1)
DEPLOY_SECONDS = float(os.environ.get("RELIABLE_BEAT_DEPLOY_SECONDS", "30"))
#: A killed beat's claimed triggers are swept by another beat after slot + sweep delay (10 s,
#: then the loop's 5 s sweep period): :func:`wait_swept` waits until none is left unsent.
SWEEP_WAIT = 16.0
START_TIMEOUT = 90.0  # a celery process starting on a loaded 2-core machine

EVERY_SECOND = "* * * * * */1"  # croniter: the seconds field is the sixth
OLD = {
    "keep": {"cron": EVERY_SECOND},
    "cron": {"cron": "* * * * * */2"},
    "removed": {"cron": EVERY_SECOND},
    "old-name": {"cron": EVERY_SECOND, "args": ["renamed"]},
}
NEW = {
    "keep": {"cron": EVERY_SECOND},
    "cron": {"cron": "* * * * * */3"},
    "added": {"cron": EVERY_SECOND},
    "new-name": {"cron": EVERY_SECOND, "args": ["renamed"]},
}


class Harness:
    def __init__(self, store: Store, redis_url: str, procs: procs_mod.BeatProcs) -> None:
        self.store = store
        self.redis = redis.Redis.from_url(redis_url)
        self.queue = f"rbq_{uuid.uuid4().hex[:10]}"
        self.procs = procs
        procs.env.update(RB_BROKER_URL=redis_url, RELIABLE_BEAT_DATABASE_URL=store.url,
                         RB_QUEUE=self.queue, RB_MAX_LOOP="1")

    def now(self) -> datetime:
        with self.store.begin() as conn:
            return self.store.now(conn)

    def select(self, stmt: Any) -> list[Any]:
        with self.store.engine.connect() as conn:
            return list(conn.execute(stmt))

    def fired(self) -> dict[str, Counter[datetime]]:
        """Entry -> slot -> number of trigger messages in the broker."""
        out: dict[str, Counter[datetime]] = {}
        for raw in self.redis.lrange(self.queue, 0, -1):
            key = json.loads(raw)["headers"]["reliable_beat_key"]
            name, _, slot = key.partition("@")
            at = datetime.fromisoformat(slot.replace("Z", "+00:00"))
            out.setdefault(name, Counter())[at] += 1
        return out

    def logs(self) -> str:
        return "\n".join(f"--- {b.name} (pid {b.pid}) ---\n{b.output()[-4000:]}"
                         for b in self.procs.beats)


@pytest.fixture
def h(pg_store: Store, redis_url: str, tmp_path: Path) -> Iterator[Harness]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    harness = Harness(pg_store, redis_url, manager)
    try:
        yield harness
    finally:
        manager.cleanup()
        harness.redis.delete(harness.queue)
        harness.redis.close()


def wait_swept(h: Harness, t0: datetime, t1: datetime, every_second: str) -> float:
    """Wait (while the last pod runs) until the window's slots are all settled: a run row for
    every slot of the every-second entry ``every_second`` in [t0, t1] and no trigger of a slot
    up to ``t1`` left unsent, i.e. every trigger a killed pod claimed and never marked sent
    has been published by the last pod's sweep (after slot + sweep delay). A sent row is never
    published again, so nothing of the window can reach the broker after this. Returns the
    seconds waited; gives up (the checks then name what is missing) after 4x SWEEP_WAIT."""
    started = time.monotonic()
    want = len(seconds(t0, t1))

    def settled() -> bool:
        with h.store.engine.connect() as conn:
            planned = conn.execute(select(func.count()).select_from(runs).where(
                runs.c.entry_name == every_second, runs.c.fire_at >= t0,
                runs.c.fire_at <= t1)).scalar_one()
            unsent = conn.execute(select(func.count()).select_from(
                outbox.join(runs, outbox.c.run_id == runs.c.id)).where(
                runs.c.fire_at <= t1, outbox.c.state == "pending")).scalar_one()
        return planned >= want and unsent == 0

    while not settled() and time.monotonic() - started < 4 * SWEEP_WAIT:
        time.sleep(0.5)
    return time.monotonic() - started


def seconds(t0: datetime, t1: datetime, step: int = 1) -> list[datetime]:
    """Whole seconds s in [t0, t1] with s % step == 0 (seconds of the minute)."""
    s = t0.replace(microsecond=0) + (SECOND if t0.microsecond else timedelta(0))
    out = []
    while s <= t1:
        if s.second % step == 0:
            out.append(s)
        s += SECOND
    return out


def synced(beat: procs_mod.Beat) -> bool:
    """The beat finished its start-up sync (any outcome) and runs its loop (the second form
    is the log line of the code before schedule groups, so the test runs against it)."""
    out = beat.output()
    return "reliable_beat: schedule group" in out or "reliable_beat: synced beat_schedule" in out


def stop(h: Harness, beat: procs_mod.Beat, rng: random.Random) -> str:
    """SIGKILL the pod's whole process group (as a container stop does: a ``worker -B``'s
    embedded beat is a child process), or SIGTERM it (graceful)."""
    if rng.random() < 0.5:
        os.killpg(beat.pid, signal.SIGKILL)
        beat.proc.wait(timeout=10)
        return "SIGKILL"
    h.procs.terminate(beat, timeout=30)
    return "SIGTERM"


def sent_twice_after_a_sigkill(fired: dict[str, Counter[datetime]],
                               kills: list[datetime]) -> set[datetime]:
    """The slots whose triggers are in the broker twice inside the documented window
    (docs/concepts.md, "a second trigger"): a beat SIGKILLed after the broker took the slot's
    messages and before it marked them sent; another beat's sweep (after slot + the 10 s sweep
    delay) publishes them again, at most once more. ``kills`` are database-clock instants
    read just after each SIGKILL. A graceful stop never excuses a double."""
    return {s for cnt in fired.values() for s, c in cnt.items()
            if c == 2 and any(s <= k <= s + 11 * SECOND for k in kills)}


def test_rolling_deploy_old_and_new_beats_alternate(h: Harness) -> None:
    rng = random.Random(int(os.environ.get("RB_SEED", "11")))
    events: list[str] = []
    first_new_up: list[datetime] = []
    kills: list[datetime] = []  # database-clock instants of the SIGKILLs

    def start(which: str) -> procs_mod.Beat:
        beat = h.procs.start(which, RB_SCHEDULE=json.dumps(OLD if which == "old" else NEW))
        procs_mod.wait_for(lambda: synced(beat) or not beat.alive(), START_TIMEOUT,
                           f"{which} beat to start")
        assert beat.alive(), h.logs()
        events.append(f"{which} pid {beat.pid} up")
        if which == "new" and not first_new_up:
            first_new_up.append(h.now())
        return beat

    current = start("old")
    procs_mod.wait_for(lambda: h.fired().get("keep"), 30, "the old beat to fire")
    t0 = h.now() + SECOND
    started = time.monotonic()
    which = "new"
    changes = 0
    # ends on a new pod, after at least three changes: an old pod starts after the new
    # config was synced (it must not sync its older one) and a new pod finds it current
    while time.monotonic() - started < DEPLOY_SECONDS or which == "new" or changes < 3:
        changes += 1
        nxt = start(which)  # the next pod is up before the previous one goes
        time.sleep(rng.uniform(1.0, 4.0))
        how = stop(h, current, rng)
        if how == "SIGKILL":
            kills.append(h.now())
        events.append(f"{current.name} pid {current.pid} {how}")
        current, which = nxt, ("old" if which == "new" else "new")
    t1 = h.now() - SECOND
    swept_in = wait_swept(h, t0, t1, "keep")  # a killed pod's triggers, by the last pod
    h.procs.terminate(current, timeout=30)

    try:
        from reliable_beat.db.tables import schedule_configs
    except ImportError:  # the code before schedule groups: when the first new pod was up
        t_sync, short = first_new_up[0] - SECOND, "-"
    else:
        configs = h.select(select(schedule_configs))
        new_cfg = next(c for c in configs if c.superseded_at is None)
        assert sorted(new_cfg.entry_names) == sorted(NEW)
        t_sync, short = new_cfg.first_synced_at, new_cfg.config_hash[:12]
    fired = h.fired()
    problems: list[str] = []

    def expect_all(name: str, slots: list[datetime]) -> None:
        got = fired.get(name, Counter())
        problems.extend(f"{name}@{s:%H:%M:%S} missing" for s in slots if s not in got)

    sigkill_window = sent_twice_after_a_sigkill(fired, kills)
    doubles = [f"{n}@{s:%H:%M:%S} x{c}" for n, cnt in fired.items() for s, c in cnt.items()
               if c > 1 and s not in sigkill_window]
    problems.extend(doubles)
    before, after = t_sync - SECOND, t_sync + SECOND
    expect_all("keep", seconds(t0, t1))
    expect_all("cron", seconds(t0, before, 2) + seconds(after, t1, 3))
    problems.extend(f"cron@{s:%H:%M:%S} on the old grid after the switch (flapped)"
                    for s in fired.get("cron", {}) if s > after and s.second % 3)
    problems.extend(f"cron@{s:%H:%M:%S} off both grids" for s in fired.get("cron", {})
                    if s.second % 2 and s.second % 3)
    expect_all("removed", seconds(t0, before))
    problems.extend(f"removed@{s:%H:%M:%S} fired after removal"
                    for s in fired.get("removed", {}) if s > after)
    expect_all("added", seconds(after, t1))
    problems.extend(f"added@{s:%H:%M:%S} before the deploy"
                    for s in fired.get("added", {}) if s < before)
    # the rename: every second exactly once under one of the two names
    old_name, new_name = fired.get("old-name", Counter()), fired.get("new-name", Counter())
    for s in seconds(t0, t1):
        n = old_name.get(s, 0) + new_name.get(s, 0)
        if n != 1 and not (n == 2 and s in sigkill_window):
            problems.append(f"renamed entry @{s:%H:%M:%S}: {n} triggers (old+new name)")
    problems.extend(f"old-name@{s:%H:%M:%S} after the rename" for s in old_name if s > after)
    # every trigger has its run row, dispatched
    rows = {(r.entry_name, r.fire_at): r.state for r in h.select(select(runs))}
    problems.extend(f"{n}@{s:%H:%M:%S} run {rows.get((n, s))}" for n, cnt in fired.items()
                    for s in cnt if rows.get((n, s)) != "dispatched")
    stored = {r.name: r for r in h.select(select(entries))}
    # the change is logged once; old pods starting later say they are older, quietly
    logs = [b.output() for b in h.procs.beats]
    synced_new = sum(len(re.findall(rf"synced new beat_schedule \(config {short}\)", x))
                     for x in logs)
    disabled = sum(x.count("disabled 2 config entries") for x in logs)
    older = sum(x.count("is an older version") for x in logs)
    current_lines = sum(x.count(f"is current (config {short}") for x in logs)
    figures = {
        "pods_started": len(h.procs.beats), "window_s": round((t1 - t0).total_seconds()),
        "triggers": sum(sum(c.values()) for c in fired.values()), "doubles": len(doubles),
        "slots_sent_twice_after_a_sigkill": len(sigkill_window),
        "swept_in_s": round(swept_in, 1),
        "problems": len(problems), "change_logged": synced_new, "disabled_logged": disabled,
        "older_pods_not_syncing": older, "new_pods_current": current_lines,
    }
    print(f"\n[rolling deploy] {figures}\n" + "\n".join(events))
    assert not problems, f"{len(problems)} problems, e.g. {problems[:15]}\n{h.logs()}"
    # final state = the new config
    assert {n for n, r in stored.items() if r.enabled} == set(NEW)
    assert stored["cron"].schedule["expr"] == "* * * * * */3"
    assert synced_new == 1 and disabled == 1, h.logs()
    assert older >= 1 and current_lines >= 1, h.logs()
    for x in logs:
        assert "Traceback" not in x, x[-4000:]


def test_worker_dash_b_on_every_instance(h: Harness) -> None:
    """A deploy of N ``celery worker -B`` instances (the beat embedded in each) starting at
    once, then killed and restarted at random: no slot doubled or lost, and the start-up
    syncs stay quiet (one sync of the config, every other instance finds it current).

    The workers consume another queue so the triggers stay countable in the broker."""
    n = int(os.environ.get("RELIABLE_BEAT_WORKER_B", "6"))
    rng = random.Random(int(os.environ.get("RB_SEED", "7")))
    schedule = {f"e{i}": {"cron": EVERY_SECOND} for i in range(5)}
    h.procs.env["RB_SCHEDULE"] = json.dumps(schedule)

    def start(i: int) -> procs_mod.Beat:
        return h.procs.start(f"wb{i}", command=[
            "worker", "-B", "-l", "info", "-Q", f"{h.queue}-work", "-c", "1", "-P", "solo",
            "-n", f"wb{i}-{uuid.uuid4().hex[:6]}@%h", "-s", str(h.procs.logdir / f"wb{i}-s"),
            "--without-mingle", "--without-gossip"])

    pods = [start(i) for i in range(n)]  # all at once
    procs_mod.wait_for(lambda: all(synced(p) for p in pods), START_TIMEOUT * 2,
                       "every worker -B to sync")
    procs_mod.wait_for(lambda: h.fired().get("e0"), 30, "slots to fire")
    t0 = h.now() + SECOND
    started = time.monotonic()
    kills = 0
    sigkills: list[datetime] = []  # database-clock instants of the SIGKILLs
    events: list[str] = []
    while time.monotonic() - started < DEPLOY_SECONDS / 2:
        time.sleep(rng.uniform(2.0, 5.0))
        victims = rng.sample(range(n), k=rng.randint(1, max(1, n // 2)))
        for i in victims:  # several stop at once, killed or terminated
            how = stop(h, pods[i], rng)
            at = h.now()
            if how == "SIGKILL":
                sigkills.append(at)
            events.append(f"{at:%H:%M:%S.%f} {pods[i].name} pid {pods[i].pid} {how}")
            kills += 1
        for i in victims:
            pods[i] = start(i)
    t1 = h.now() - SECOND
    procs_mod.wait_for(lambda: any(synced(p) and p.alive() for p in pods), START_TIMEOUT,
                       "a worker -B to be up")
    swept_in = wait_swept(h, t0, t1, "e0")
    for p in pods:
        h.procs.terminate(p, timeout=30)
    fired = h.fired()
    sigkill_window = sent_twice_after_a_sigkill(fired, sigkills)
    problems = [f"{name}@{s:%H:%M:%S} x{fired.get(name, Counter()).get(s, 0)}"
                for name in schedule for s in seconds(t0, t1)
                if fired.get(name, Counter()).get(s, 0) != 1
                and not (fired[name][s] == 2 and s in sigkill_window)]
    logs = [b.output() for b in h.procs.beats]
    syncs = sum(x.count("synced new beat_schedule") for x in logs)
    quiet = sum(x.count("is current (config") for x in logs)
    figures = {"instances": n, "processes_started": len(h.procs.beats), "stopped": kills,
               "sigkills": len(sigkills), "window_s": round((t1 - t0).total_seconds()),
               "slots_checked": len(schedule) * len(seconds(t0, t1)),
               "triggers": sum(sum(c.values()) for c in fired.values()),
               "slots_sent_twice_after_a_sigkill": len(sigkill_window),
               "swept_in_s": round(swept_in, 1),
               "problems": len(problems), "syncs": syncs, "quiet_starts": quiet,
               "synced_at_all": sum("reliable_beat: schedule group" in x for x in logs)}
    print(f"\n[worker -B] {figures}\n" + "\n".join(events))
    assert not problems, (f"{len(problems)} problems, e.g. {problems[:15]}\n"
                          + "\n".join(events) + f"\n{h.logs()}")
    assert syncs == 1, h.logs()
    # every instance that got as far as its sync found the config current (some were killed
    # while still starting): one quiet INFO line each
    up = [x for x in logs if "reliable_beat: schedule group" in x]
    assert quiet == len(up) - 1, h.logs()
    for x in logs:
        assert "config entries gone from its beat_schedule" not in x, x[-4000:]
        assert "Traceback" not in x, x[-4000:]
