"""Concurrent workflow purges on PostgreSQL and MariaDB (issue 16, review): four
``workflows purge`` / relay retention passes over the same rows at once, in batches of
different sizes (so one deletes ended workflows while another deletes continued runs'
history), round after round, on rows stored in an order unlike their keys.

No deadlock, no error, each row deleted once (the counts of all purgers add up to what
went), and nothing live touched. The review suspected a deadlock here; this test never saw
one on the code as it is (PostgreSQL 4 rounds x 4 purgers, several runs; MariaDB 3 runs).
A variant that locked the workflow rows first in the continued-runs batch too (FOR UPDATE
SKIP LOCKED) deadlocked on MariaDB in this very test (InnoDB locks every row a DELETE scans,
and the ended batch's ``DELETE ... WHERE id IN (...)`` scanned into the rows it had locked),
so the test guards against such a change as much as against the old suspicion.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflow_events, workflow_signals, workflows
from reliable_beat.workflows.retention import WorkflowPurge, purge_workflows

PURGERS = 4
ROUNDS = 4
PER_ROUND = 150  # workflows of each kind per round
RUNS = 3  # run_no of every seeded workflow: runs 1 and 2 are continued (old) runs
SEQS = 8


def _seed(store: Store, rnd: int) -> dict[str, int]:
    """Ended and waiting workflows interleaved by id, every one with continued runs: the
    ended ones are wholly purgeable, the waiting ones only their old runs' history."""
    with store.begin() as conn:
        now = store.now(conn)
        old = now - timedelta(days=40)
        wf_rows = []
        for i in range(PER_ROUND * 2):
            ended = i % 2 == 0
            wf_rows.append({
                "workflow_id": f"r{rnd}/{'ended' if ended else 'live'}/{i}", "name": "t.seed",
                "run_no": RUNS, "state": "completed" if ended else "waiting", "args": [],
                "kwargs": {}, "created_at": old, "updated_at": old,
                "finished_at": old if ended else None,
            })
        conn.execute(workflows.insert(), wf_rows)
        pks = dict(conn.execute(sa.select(workflows.c.workflow_id, workflows.c.id).where(
            workflows.c.workflow_id.like(f"r{rnd}/%"))).all())
        evs, sigs = [], []
        for pk in pks.values():
            for run in range(1, RUNS + 1):
                for seq in range(1, SEQS + 1):
                    evs.append({"workflow_pk": pk, "run_no": run, "seq": seq, "kind": "step",
                                "name": "s", "args_digest": "0" * 16, "state": "completed",
                                "fence_token": 1, "created_at": old})
                sigs.append({"workflow_pk": pk, "name": "go", "payload": run,
                             "consumed_run_no": run, "consumed_seq": 1, "created_at": old})
        # stored in an order unlike the key order, as a long-lived table's rows are: a
        # statement that scans the heap and one that walks an index then meet the same rows
        # in different orders
        random.Random(rnd).shuffle(evs)
        random.Random(rnd).shuffle(sigs)
        conn.execute(workflow_events.insert(), evs)
        conn.execute(workflow_signals.insert(), sigs)
    ended = PER_ROUND
    return {
        "workflows": ended,
        # ended: every event and signal; live: those of runs 1 .. RUNS-1
        "events": ended * RUNS * SEQS + PER_ROUND * (RUNS - 1) * SEQS,
        "signals": ended * RUNS + PER_ROUND * (RUNS - 1),
    }


def _counts(store: Store) -> tuple[int, int, int]:
    with store.connect() as conn:
        return tuple(int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
                     for t in (workflows, workflow_events, workflow_signals))  # type: ignore[return-value]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dialect", ["postgresql",
                                     pytest.param("mariadb", marks=pytest.mark.mariadb)])
def test_concurrent_purges_never_deadlock_and_delete_each_row_once(
        request: pytest.FixtureRequest, dialect: str) -> None:
    store: Store = request.getfixturevalue("pg_store" if dialect == "postgresql"
                                           else "mariadb_store")
    errors: list[BaseException] = []
    totals: list[WorkflowPurge] = []
    lock = threading.Lock()
    started = time.monotonic()
    for rnd in range(ROUNDS):
        expected = _seed(store, rnd)
        before = _counts(store)
        with store.connect() as conn:
            cutoff = store.now(conn) - timedelta(days=30)
        barrier = threading.Barrier(PURGERS)
        results: list[WorkflowPurge] = []

        def purger(n: int, results: list[WorkflowPurge] = results,
                   barrier: threading.Barrier = barrier, cutoff: Any = cutoff) -> None:
            barrier.wait()
            try:
                # batch sizes differ, so the purgers drift into different steps (one
                # deleting ended workflows while another deletes continued runs' history)
                out = purge_workflows(store, before=cutoff, batch_size=(2, 7, 300, 1000)[n % 4])
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                return
            with lock:
                results.append(out)

        threads = [threading.Thread(target=purger, args=(n,)) for n in range(PURGERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a purger hung"
        assert errors == [], f"round {rnd}: {errors!r}"
        after = _counts(store)
        gone = tuple(b - a for b, a in zip(before, after, strict=True))
        assert gone == (expected["workflows"], expected["events"], expected["signals"]), rnd
        # each row deleted once: the purgers' own counts add up to what went
        assert (sum(r.workflows for r in results), sum(r.events for r in results),
                sum(r.signals for r in results)) == gone, (rnd, results)
        totals.extend(results)
        with store.connect() as conn:
            live = conn.execute(sa.select(sa.func.count()).select_from(workflows).where(
                workflows.c.workflow_id.like(f"r{rnd}/live/%"),
                workflows.c.state == "waiting")).scalar_one()
            current = conn.execute(sa.select(sa.func.count()).select_from(
                workflow_events.join(workflows,
                                     workflows.c.id == workflow_events.c.workflow_pk)).where(
                workflows.c.workflow_id.like(f"r{rnd}/live/%"),
                workflow_events.c.run_no == RUNS)).scalar_one()
        assert live == PER_ROUND and current == PER_ROUND * SEQS  # the live runs untouched
    print(f"{ROUNDS} rounds x {PURGERS} concurrent purgers: "
          f"{sum(r.workflows for r in totals)} workflows, {sum(r.events for r in totals)} "
          f"events, {sum(r.signals for r in totals)} signals deleted once each, "
          f"{sum(r.batches for r in totals)} batches, 0 deadlocks, "
          f"{time.monotonic() - started:.1f} s")
