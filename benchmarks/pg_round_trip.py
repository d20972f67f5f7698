"""PostgreSQL CPU per slot of a tick's three writes: three statements vs ONE round trip.

An experiment behind ``docs/performance.md`` (*Row writes per slot*), not part of
``python -m benchmarks``. Each batch claims ``--batch`` due entries (``FOR UPDATE SKIP
LOCKED``, as the beat does), builds the rows the beat builds for them (run rows, trigger
outbox rows with ``build_trigger_payload``, the entries' advance) and writes them either

* ``three``: the beat's statements, ``INSERT runs ... jsonb_to_recordset ON CONFLICT DO
  NOTHING RETURNING``, ``INSERT outbox ... RETURNING``, ``UPDATE entries ... FROM
  jsonb_to_recordset`` (three round trips), or
* ``one``: the same three as ONE data-modifying CTE (the outbox rows join the runs the
  first insert actually returned, so a slot already fired gets no trigger, as now);

then commits. Variants alternate batch by batch on the same database and connection. The
PostgreSQL backend's CPU (``/proc/<pg_backend_pid()>/stat``; same host only) and the
statement wall time are reported per slot, median and range over the batches.

    PYTHONPATH=. python benchmarks/pg_round_trip.py --n 20000 --batch 500
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ONE = """
WITH r AS (
  INSERT INTO reliable_beat_runs (idempotency_key, entry_name, fire_at, trigger, task, args,
                                  kwargs, state, reason, created_at, updated_at)
  SELECT x.idempotency_key, x.entry_name, x.fire_at, x.trigger, x.task, x.args, x.kwargs,
         x.state, x.reason, x.created_at, x.updated_at
  FROM jsonb_to_recordset(CAST(:runs AS JSONB)) AS x(
    idempotency_key VARCHAR(400), entry_name VARCHAR(200), fire_at TIMESTAMPTZ,
    trigger VARCHAR(16), task VARCHAR(255), args JSONB, kwargs JSONB, state VARCHAR(16),
    reason TEXT, created_at TIMESTAMPTZ, updated_at TIMESTAMPTZ)
  ON CONFLICT DO NOTHING
  RETURNING id, idempotency_key, state
), o AS (
  INSERT INTO reliable_beat_outbox (message_id, destination, payload, headers, run_id, state,
                                    attempts, available_at, claimed_by, created_at)
  SELECT y.message_id, y.destination, y.payload, y.headers, r.id, y.state, y.attempts,
         y.available_at, y.claimed_by, y.created_at
  FROM jsonb_to_recordset(CAST(:outbox AS JSONB)) AS y(
    key VARCHAR(400), message_id VARCHAR(400), destination VARCHAR(200), payload JSONB,
    headers JSONB, state VARCHAR(16), attempts INTEGER, available_at TIMESTAMPTZ,
    claimed_by VARCHAR(200), created_at TIMESTAMPTZ)
  JOIN r ON r.idempotency_key = y.key AND r.state = 'scheduled'
  RETURNING id, run_id
), u AS (
  UPDATE reliable_beat_entries SET next_fire_at = z.b_next, last_fire_at = z.b_last,
                                   updated_at = z.b_now
  FROM jsonb_to_recordset(CAST(:adv AS JSONB)) AS z(
    b_id BIGINT, b_next TIMESTAMPTZ, b_last TIMESTAMPTZ, b_now TIMESTAMPTZ)
  WHERE reliable_beat_entries.id = z.b_id
  RETURNING 1
)
SELECT r.id, r.idempotency_key, o.id AS outbox_id FROM r LEFT JOIN o ON o.run_id = r.id
"""


def _backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rows(claimed: list[Any], now: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                 list[dict[str, Any]]]:
    from reliable_beat.beat import build_trigger_payload, trigger_outbox_row
    from reliable_beat.slots import idempotency_key

    runs, outbox, adv = [], [], []
    for e in claimed:
        key = idempotency_key(e.name, e.next_fire_at)
        runs.append({"idempotency_key": key, "entry_name": e.name, "fire_at": e.next_fire_at,
                     "trigger": "schedule", "task": e.task, "args": e.args,
                     "kwargs": e.kwargs, "state": "scheduled", "reason": None,
                     "created_at": now, "updated_at": now})
        payload = build_trigger_payload(task=e.task, args=e.args, kwargs=e.kwargs,
                                        options=e.options, key=key, entry=e.name,
                                        fire_at=e.next_fire_at, trigger="schedule",
                                        store_id="bench")
        row = trigger_outbox_row(key, 0, payload, now, available_at=now + timedelta(seconds=10),
                                 claimed_by="bench")
        outbox.append(row)
        adv.append({"b_id": e.id, "b_next": e.next_fire_at + timedelta(hours=1),
                    "b_last": e.next_fire_at, "b_now": now})
    return runs, outbox, adv


def main() -> None:
    from benchmarks.common import SIZES, seed_entries, servers
    from reliable_beat.beat import _advance_entries, _insert_rows, _rows_param
    from reliable_beat.db.dialects import Store
    from reliable_beat.db.tables import entries, outbox, runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--postgres-url")
    args = ap.parse_args()
    with servers(args.postgres_url, "redis://unused", SIZES["smoke"]) as env, \
            env.database("rt") as db_url:
        seed_entries(db_url, 0, args.n, due_in="-2 seconds", every=3600, grace=60)
        store = Store.from_url(db_url, role="beat")
        one = sa.text(ONE)
        cpu: dict[str, list[float]] = {"three": [], "one": []}
        wall: dict[str, list[float]] = {"three": [], "one": []}
        slots = {"three": 0, "one": 0}
        i = 0
        while True:
            variant = ("three", "one")[i % 2]
            with store.begin() as conn:
                pid = conn.execute(sa.select(sa.func.pg_backend_pid())).scalar_one()
                now = store.now(conn)
                claimed = conn.execute(
                    sa.select(entries).where(entries.c.next_fire_at <= now, entries.c.enabled)
                    .order_by(entries.c.next_fire_at).limit(args.batch)
                    .with_for_update(skip_locked=True)).all()
                if not claimed:
                    break
                run_rows, outbox_rows, adv = _rows(claimed, now)
                c0, t0 = _backend_cpu(pid), time.perf_counter()
                if variant == "three":
                    got = _insert_rows(conn, store, runs, run_rows, ignore=True,
                                       returning=("id", "idempotency_key"))
                    ids = dict((k, rid) for rid, k in got)
                    for row in outbox_rows:
                        row["run_id"] = ids[row["message_id"].removeprefix("trigger:")]
                    _insert_rows(conn, store, outbox, outbox_rows, ignore=False,
                                 returning=("id", "message_id"))
                    _advance_entries(conn, store, adv)
                else:
                    for row in outbox_rows:
                        row["key"] = row.pop("message_id").removeprefix("trigger:")
                        row["message_id"] = "trigger:" + row["key"]
                        del row["run_id"]
                    got = conn.execute(one, {"runs": _rows_param(run_rows),
                                             "outbox": _rows_param(outbox_rows),
                                             "adv": _rows_param(adv)}).all()
                    assert all(o is not None for _, _, o in got)
            t1 = time.perf_counter()
            c1 = _backend_cpu(pid)  # after the commit: the commit's work counts too
            if i >= 2:  # one warm-up batch of each
                cpu[variant].append(c1 - c0)
                wall[variant].append(1e6 * (t1 - t0) / len(claimed))
                slots[variant] += len(claimed)
            i += 1
        store.dispose()
    # /proc counts in clock ticks (10 ms): the CPU is summed over all batches of a variant
    print(f"{args.n:,} entries, batch {args.batch}, {len(cpu['one'])} batches of each variant, "
          "alternated; per slot:")
    print("| variant | PostgreSQL backend CPU us/slot (total / slots) | write statements + "
          "commit wall us/slot, median (min-max) |")
    print("|---|---|---|")
    for v in ("three", "one"):
        print(f"| {v} | {1e6 * sum(cpu[v]) / max(slots[v], 1):.1f} "
              f"| {statistics.median(wall[v]):.1f} ({min(wall[v]):.1f}-{max(wall[v]):.1f}) |")


if __name__ == "__main__":
    main()
