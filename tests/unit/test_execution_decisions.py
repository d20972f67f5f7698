"""The shared completion path (``reliable_beat.execution``) both adapters map onto their verbs.

A failure the store cannot record is never dropped: the decision is a retry (the Dramatiq
actor used to get an exception out of ``failure_decision`` and map it itself; the Celery task
had its own copy of this logic). Real SQLite stores: the unreachable one is a file in a
directory that does not exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from reliable_beat import execution, runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters
from reliable_beat.db.tables import runs as runs_table
from reliable_beat.errors import StaleFenceToken

LEASE = timedelta(seconds=30)


def _claim(store: Store, key: str = "k") -> runs.Claim:
    return runs.claim_run(store, key, owner="t:1", lease=LEASE, task="t", args=[], kwargs={})


@pytest.fixture
def gone(tmp_path: Path) -> Iterator[Store]:
    store = Store.from_url(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.sqlite3'}", role="cli")
    yield store
    store.dispose()


@pytest.mark.parametrize(("kind", "attempt", "verb"), [
    ("transient", 1, "retry_in"), ("permanent", 1, "retry_unrecorded"),
    ("transient", 3, "retry_unrecorded"),
])
def test_an_unrecordable_failure_is_still_retried(sqlite_store: Store, gone: Store, kind: str,
                                                  attempt: int, verb: str) -> None:
    claim = _claim(sqlite_store)
    claim = dataclasses.replace(claim, attempt=attempt)
    decision = execution.failure_decision(
        gone, claim, RuntimeError("boom"), kind, max_attempts=3, payload={}, delay=2.5)
    assert decision.verb == verb
    assert decision.seconds == 2.5
    assert decision.unrecorded is not None  # the store's error, for the adapter to chain


def test_failure_decisions_are_recorded(sqlite_store: Store) -> None:
    claim = _claim(sqlite_store, "t1")
    retry = execution.failure_decision(sqlite_store, claim, OSError("net"), "transient",
                                       max_attempts=3, payload={}, delay=1.0)
    assert (retry.verb, retry.seconds, retry.unrecorded) == ("retry_in", 1.0, None)
    dead = execution.failure_decision(sqlite_store, _claim(sqlite_store, "t2"),
                                      ValueError("bad"), "permanent", max_attempts=3,
                                      payload={"task": "t"})
    assert (dead.verb, dead.reason) == ("dead", "permanent")
    with sqlite_store.engine.connect() as conn:
        states = dict(conn.execute(select(runs_table.c.idempotency_key, runs_table.c.state)).all())
        letters = conn.execute(select(dead_letters.c.payload)).scalars().all()
    assert states == {"t1": "retrying", "t2": "dead"}
    assert letters == [{"task": "t"}]


def test_complete_after_body_is_fenced(sqlite_store: Store) -> None:
    stale = _claim(sqlite_store)
    with sqlite_store.begin() as conn:  # a newer runner took the run over
        conn.execute(runs_table.update().values(fence_token=stale.fence_token + 1))
    state = execution.RunState(claim=stale, store=sqlite_store, lease=LEASE, task_name="t")
    with pytest.raises(StaleFenceToken):
        execution.run_and_complete(state, lambda: 42)
    assert not state.completed
    fresh = _claim(sqlite_store, "other")
    state = execution.RunState(claim=fresh, store=sqlite_store, lease=LEASE, task_name="t")
    assert execution.run_and_complete(state, lambda: {"n": 1}) == {"n": 1}
    assert state.completed
    assert runs.get_run(sqlite_store, "other")["state"] == "succeeded"
