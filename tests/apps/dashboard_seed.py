"""Store contents for the dashboard's tests: one entry whose last slots show every outcome.

An entry every 5 minutes (``*/5``); its last eight slots, oldest first: on time, late (by
40 s), a slot with **no run row** (a gap), missed (the misfire policy recorded it late past
its grace), an attempt **fenced out** (its lease cleared, :func:`reliable_beat.runs.
release_lease`), dead (a permanent failure: a dead letter), retried (two attempts), on time.
Values carry an XSS payload where a person could put one (entry name, args, error).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from reliable_beat import entries as rb_entries
from reliable_beat import runs as rb_runs
from reliable_beat import schedules as sch
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, entries, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.slots import idempotency_key

XSS = '<script>alert("rb")</script><img src=x onerror=alert(1)>'


@dataclass
class Seeded:
    entry: str
    slots: list[datetime]  # oldest first
    outcomes: list[str]  # what the timeline must show, per slot
    fenced_key: str
    dead_key: str
    dead_letter_id: int
    xss_entry: str


def _run(conn: Any, name: str, at: datetime, now: datetime, state: str, **extra: Any) -> int:
    values = {"idempotency_key": idempotency_key(name, at), "entry_name": name, "fire_at": at,
              "trigger": "schedule", "task": "payouts.pay", "args": [], "kwargs": {},
              "state": state, "created_at": at, "updated_at": now, **extra}
    return int(conn.execute(runs.insert().returning(runs.c.id), [values]).scalar_one())


def seed(store: Store) -> Seeded:
    tag = uuid.uuid4().hex[:6]
    name = f"pay-{tag}"
    rb_entries.save_runtime_entry(store, EntryDefinition(
        name=name, task="payouts.pay", schedule=sch.CronSchedule("*/5 * * * *", "UTC")),
        create=True)
    now = datetime.now(timezone.utc)
    last = sch.CronSchedule("*/5 * * * *", "UTC").previous_at_or_before(now)
    assert last is not None
    slots = [last - timedelta(minutes=5 * i) for i in range(7, -1, -1)]
    ok = {"dispatched_at": None, "attempts": 1, "finished_at": None}
    with store.begin() as conn:
        for i, at in enumerate(slots):
            if i == 2:
                continue  # the gap: no run row at all
            if i in (4, 5):
                continue  # fenced out and dead: through the runs API below
            if i == 3:
                _run(conn, name, at, now, "skipped", reason="misfire:skip", attempts=0)
                continue
            late = timedelta(seconds=40 if i == 1 else 1)
            tries = 2 if i == 6 else 1
            rid = _run(conn, name, at, now, "succeeded",
                       **{**ok, "dispatched_at": at + late, "attempts": tries,
                          "started_at": at + late, "finished_at": at + late * 2})
            for n in range(1, tries + 1):
                conn.execute(attempts.insert().values(
                    run_id=rid, attempt=n, fence_token=n, worker=f"worker-{tag}@host",
                    started_at=at + late, finished_at=at + late * 2,
                    outcome="succeeded" if n == tries else "retrying",
                    error=None if n == tries else f"TimeoutError: {XSS}"))
        conn.execute(entries.update().where(entries.c.name == name)
                     .values(last_fire_at=slots[-1]))
        for i in (4, 5):
            _run(conn, name, slots[i], now, "dispatched", dispatched_at=slots[i])
    fenced_key = idempotency_key(name, slots[4])
    rb_runs.claim_run(store, fenced_key, owner=f"worker-{tag}@stuck", lease=timedelta(minutes=5),
                      task="payouts.pay", entry=name, fire_at=slots[4])
    rb_runs.release_lease(store, fenced_key, resend=False)
    dead_key = idempotency_key(name, slots[5])
    claim = rb_runs.claim_run(store, dead_key, owner=f"worker-{tag}@host",
                              lease=timedelta(minutes=5), task="payouts.pay", entry=name,
                              fire_at=slots[5])
    rb_runs.record_failure(store, claim, f"PermanentError: card declined {XSS}",
                           dead_reason="permanent",
                           payload={"task": "payouts.pay", "args": [XSS], "kwargs": {},
                                    "key": dead_key, "headers": {}})
    dl = next(d for d in rb_runs.list_dead_letters(store) if d["key"] == dead_key)
    xss_entry = f"x{tag}{XSS}"
    rb_entries.save_runtime_entry(store, EntryDefinition(
        name=xss_entry, task=f"t.{XSS}", schedule=sch.CronSchedule("0 3 * * *", "Europe/Paris"),
        args=[XSS], kwargs={"note": XSS}), create=True)
    return Seeded(entry=name, slots=slots,
                  outcomes=["on_time", "late", "gap", "missed", "fenced_out", "dead", "retried",
                            "on_time"],
                  fenced_key=fenced_key, dead_key=dead_key, dead_letter_id=int(dl["id"]),
                  xss_entry=xss_entry)
