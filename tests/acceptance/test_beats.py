"""Proof of the scheduler: real ``celery beat`` processes, real PostgreSQL and Redis.

Every test bounds its waits, and the ``procs`` fixture kills every beat it started. Each
prints its figures (slots checked, duplicates, missing, messages) for the closing note.
Set ``RELIABLE_BEAT_ACCEPT_SECONDS=60`` for the full-length 3-beat run (CI default: 30).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # noqa: E402  (tests/apps)

UTC = timezone.utc
SECOND = timedelta(seconds=1)
ACCEPT_SECONDS = float(os.environ.get("RELIABLE_BEAT_ACCEPT_SECONDS", "30"))


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[procs_mod.BeatProcs]:
    manager = procs_mod.BeatProcs(logdir=tmp_path)
    try:
        yield manager
    finally:
        manager.cleanup()


class Harness:
    def __init__(self, store: Store, redis_url: str, procs: procs_mod.BeatProcs) -> None:
        self.store = store
        self.redis = redis.Redis.from_url(redis_url)
        self.queue = f"rbq_{uuid.uuid4().hex[:10]}"
        self.procs = procs
        procs.env.update(RB_BROKER_URL=redis_url, RELIABLE_BEAT_DATABASE_URL=store.url,
                         RB_QUEUE=self.queue, RB_MAX_LOOP="1")

    def schedule(self, spec: dict[str, Any]) -> None:
        self.procs.env["RB_SCHEDULE"] = json.dumps(spec)

    def now(self) -> datetime:
        with self.store.begin() as conn:
            return self.store.now(conn)

    def runs(self) -> list[Any]:
        with self.store.engine.connect() as conn:
            return list(conn.execute(select(runs).order_by(runs.c.entry_name, runs.c.fire_at)))

    def outbox(self) -> list[Any]:
        with self.store.engine.connect() as conn:
            return list(conn.execute(select(outbox)))

    def entries(self) -> list[Any]:
        with self.store.engine.connect() as conn:
            return list(conn.execute(select(entries)))

    def messages(self) -> list[dict[str, Any]]:
        raw = self.redis.lrange(self.queue, 0, -1)
        return [json.loads(m)["headers"] for m in raw]

    def logs(self) -> str:
        return "\n".join(f"--- {b.name} (pid {b.pid}) ---\n{b.output()[-3000:]}"
                         for b in self.procs.beats)


@pytest.fixture
def h(pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs) -> Iterator[Harness]:
    harness = Harness(pg_store, redis_url, procs)
    yield harness
    harness.redis.delete(harness.queue)
    harness.redis.close()


def every_second(n_cron: int, n_interval: int, **rb: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for i in range(n_cron):
        spec[f"cron{i:02d}"] = {"cron": "* * * * * */1", "reliable_beat": dict(rb)}
    for i in range(n_interval):
        spec[f"every{i:02d}"] = {"every": 1, "reliable_beat": dict(rb)}
    return spec


def ceil_s(at: datetime) -> datetime:
    return at.replace(microsecond=0) + (SECOND if at.microsecond else timedelta(0))


def check_window(h: Harness, names: list[str], t0: datetime, t1: datetime,
                 label: str) -> dict[str, int]:
    """Every whole-second slot in [t0, t1] of every entry: exactly one run row, dispatched,
    and exactly one message in the broker. Returns (and prints) the figures."""
    slots = []
    s = ceil_s(t0)
    while s <= t1:
        slots.append(s)
        s += SECOND
    rows = h.runs()
    row_count = Counter((r.entry_name, r.fire_at) for r in rows)
    msgs = h.messages()
    msg_keys = Counter(m.get("reliable_beat_key") for m in msgs)
    msg_ids = Counter(m.get("id") for m in msgs)
    missing_rows = missing_msgs = doubled = not_sent = 0
    problems: list[str] = []
    by_key = {r.idempotency_key: r for r in rows}
    for name in names:
        for slot in slots:
            key = f"{name}@{slot:%Y-%m-%dT%H:%M:%SZ}"
            n = row_count.get((name, slot), 0)
            if n == 0:
                missing_rows += 1
                problems.append(f"no run row {key}")
            elif by_key[key].state not in ("dispatched",):
                not_sent += 1
                problems.append(f"{key} state {by_key[key].state} ({by_key[key].reason})")
            m = msg_keys.get(key, 0)
            if m == 0:
                missing_msgs += 1
                problems.append(f"no message {key}")
            elif m > 1:
                doubled += 1
                problems.append(f"{m} messages {key}")
    figures = {
        "entries": len(names),
        "slots_checked": len(names) * len(slots),
        "missing_runs": missing_rows,
        "missing_messages": missing_msgs,
        "duplicates": doubled + sum(1 for v in row_count.values() if v > 1),
        "not_dispatched": not_sent,
        "messages_total": len(msgs),
        "distinct_keys_total": len(msg_keys),
        "distinct_task_ids_total": len(msg_ids),
        "run_rows_total": len(rows),
    }
    print(f"\n[{label}] window {t0:%H:%M:%S}..{t1:%H:%M:%S} ({len(slots)} s): {figures}")
    assert not problems, f"{len(problems)} problems, e.g. {problems[:10]}\n{h.logs()}"
    # globally: no key was published twice, one task id per key
    assert [k for k, v in msg_keys.items() if v > 1] == []
    assert len(msg_ids) == len(msg_keys) == len(msgs)
    return figures


def wait_running(h: Harness, n_entries: int, timeout: float = 30) -> datetime:
    """Wait until the beats synced and slots fire; returns the DB time then."""
    procs_mod.wait_for(lambda: len(h.entries()) >= n_entries and h.runs(), timeout,
                       "beats to sync and fire")
    return h.now()


def stop_all(h: Harness) -> None:
    for b in h.procs.beats:
        h.procs.terminate(b)


# -- 3 beats, 50 entries every second ---------------------------------------------------------
def test_three_beats_fifty_entries_every_second(h: Harness) -> None:
    spec = every_second(25, 25, misfire_policy="catch_up")
    h.schedule(spec)
    for i in range(3):
        h.procs.start(f"beat{i}")
    start = wait_running(h, 50)
    t0 = start + 3 * SECOND  # all three are up and synced by then
    procs_mod.wait_for(lambda: h.now() > t0 + ACCEPT_SECONDS * SECOND, ACCEPT_SECONDS + 30,
                       "the run to last")
    t1 = h.now() - 3 * SECOND
    assert all(b.alive() for b in h.procs.beats), h.logs()
    # let the last publishes of the window land, then stop
    procs_mod.wait_for(lambda: not [o for o in h.outbox() if o.state == "pending"
                                    and o.created_at <= t1 + SECOND], 10, "publishes")
    stop_all(h)
    figures = check_window(h, sorted(spec), t0, t1, "3 beats x 50 entries")
    # all three took part
    owners = Counter(o.claimed_by for o in h.outbox())
    assert len(owners) == 3, owners
    print(f"[3 beats x 50 entries] triggers per beat: {dict(owners)}")
    assert figures["duplicates"] == 0 and figures["missing_messages"] == 0
