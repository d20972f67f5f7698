"""The claim and the fenced completion on the psycopg connection (reliable_beat.db.driver).

They must be the same statements with the same answers as through ``conn.execute()`` (the
path other drivers take): same outcome, fence, attempt, stored call and result, and the
engine's cursor events still see them.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.errors import StaleFenceToken

claim_mod = importlib.import_module("reliable_beat.runs.claim")
complete_mod = importlib.import_module("reliable_beat.runs.complete")  # runs.complete: the function

LEASE = timedelta(seconds=30)


def _claims(store: Store, key: str) -> list[Any]:
    """fresh claim, completion, then the deduplicated replay's claim"""
    first = runs.claim_run(store, key, owner="w", lease=LEASE, task="t.x", args=[1, "a"],
                           kwargs={"k": [1, 2]}, task_id="tid")
    with store.begin() as conn:
        runs.complete(conn, first, {"ok": [1, None]})
    again = runs.claim_run(store, key, owner="w", lease=LEASE, task="t.x", args=[1, "a"],
                           kwargs={"k": [1, 2]}, task_id="tid")
    return [first, again]


def _comparable(c: runs.Claim) -> tuple[Any, ...]:
    return (c.outcome, c.fence_token, c.attempt, c.fresh, c.result, c.task, c.args,
            c.kwargs, c.entry_name, c.fire_at, c.lease_expires_at is None)


def test_driver_path_answers_as_sqlalchemy_core(pg_store: Store,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.from_url(pg_store.url, role="worker")
    contexts: list[Any] = []

    def seen(_c: Any, _cur: Any, statement: str, _p: Any, context: Any, _m: bool) -> None:
        if statement.lstrip().startswith("WITH"):
            contexts.append(context)

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        driver = _claims(store, "drv:1")
        assert len(contexts) == 3 and all(c is None for c in contexts), contexts  # raw
        contexts.clear()
        monkeypatch.setattr(claim_mod, "uses_psycopg", lambda conn: False)
        monkeypatch.setattr(complete_mod, "uses_psycopg", lambda conn: False)
        core = _claims(store, "drv:2")
        assert len(contexts) == 3 and all(c is not None for c in contexts)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
        store.dispose()
    assert [_comparable(c) for c in driver] == [_comparable(c) for c in core]
    assert driver[0].outcome == runs.ACQUIRED and driver[0].args == (1, "a")
    assert driver[1].outcome == runs.ALREADY_SUCCEEDED and driver[1].result == {"ok": [1, None]}
    for key in ("drv:1", "drv:2"):
        run = runs.get_run(pg_store, key)
        assert run["state"] == "succeeded" and run["result"] == {"ok": [1, None]}


def test_driver_completion_with_a_moved_fence_writes_nothing(pg_store: Store) -> None:
    store = Store.from_url(pg_store.url, role="worker")
    try:
        stale = runs.claim_run(store, "drv:3", owner="a", lease=timedelta(0), task="t.x")
        newer = runs.claim_run(store, "drv:3", owner="b", lease=LEASE, task="t.x")
        assert newer.fence_token == stale.fence_token + 1
        with pytest.raises(StaleFenceToken), store.begin() as conn:
            runs.complete(conn, stale, "stale")
        assert runs.get_run(pg_store, "drv:3")["state"] == "running"
        with store.begin() as conn:
            runs.complete(conn, newer, "mine")
        assert runs.get_run(pg_store, "drv:3")["result"] == "mine"
    finally:
        store.dispose()
