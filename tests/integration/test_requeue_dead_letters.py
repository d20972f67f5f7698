"""Requeueing run dead letters: what counts as a committed effect, and what is sent.

A run the beat fired has its trigger row in the outbox, stamped with the run: that row is
how the run was sent, not an effect of its body, so a failed slot can be requeued. A row
the body wrote (``<key>#<n>``) is an effect: requeueing would repeat it. A ``malformed``
dead letter's payload is the bad row as it was: the requeue sends the run row as it is now.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.db.tables import runs as runs_t
from reliable_beat.ops import actions
from reliable_beat.rows.quarantine import dead_letter_run
from reliable_beat.triggers import trigger_outbox_row

LEASE = timedelta(seconds=30)
KEY = "nightly@2026-12-06T02:00:00Z"


def _fired_run(store: Store) -> runs.Claim:
    """A run as the beat leaves it (its trigger row in the outbox), then claimed."""
    now = datetime.now(timezone.utc)
    claim = runs.claim_run(store, KEY, owner="w1", lease=LEASE, task="pay.merchants",
                           args=[1], kwargs={"m": "acme"}, task_id="t-1")
    with store.begin() as conn:
        conn.execute(outbox.insert().values(trigger_outbox_row(
            KEY, claim.run_id, {"task": "pay.merchants", "args": [1]}, now,
            available_at=now, claimed_by=None)))
    return claim


def _dead(store: Store, claim: runs.Claim) -> dict:
    assert runs.record_failure(store, claim, "boom", dead_reason="permanent") == "dead"
    [dl] = runs.list_dead_letters(store)
    return dl


def test_a_fired_run_whose_body_failed_can_be_requeued(store: Store) -> None:
    dl = _dead(store, _fired_run(store))
    got = runs.requeue_dead_letter(store, dl["id"], by="ops")
    assert got["payload"]["key"] == KEY
    assert runs.get_run(store, KEY)["state"] == "scheduled"


def test_a_row_the_body_wrote_still_refuses_the_requeue(store: Store) -> None:
    claim = _fired_run(store)
    with store.begin() as conn:  # what RunOutbox writes in the body's transaction
        conn.execute(outbox.insert().values(
            message_id=f"{KEY}#1", destination="webhook", payload={"path": "/x"},
            headers={}, run_id=claim.run_id, state="pending", attempts=0,
            available_at=datetime.now(timezone.utc), created_at=datetime.now(timezone.utc)))
    dl = _dead(store, claim)
    with pytest.raises(ValueError, match="effect committed"):
        runs.requeue_dead_letter(store, dl["id"], by="ops")
    assert runs.get_run(store, KEY)["state"] == "dead"


def test_a_malformed_dead_letter_is_requeued_from_the_repaired_run_row(store: Store) -> None:
    claim = _fired_run(store)
    with store.begin() as conn:
        row = dict(conn.execute(sa.select(runs_t).where(runs_t.c.id == claim.run_id))
                   .mappings().one())
        row["state"] = "garbage"
        assert dead_letter_run(conn, row, ["state 'garbage' is not a run state"],
                               datetime.now(timezone.utc), guard=sa.true())
    [dl] = runs.list_dead_letters(store)
    assert dl["reason"] == "malformed" and "key" not in dl["payload"]
    payload = actions.requeue_payload(store, dl)
    assert payload == {"task": "pay.merchants", "key": KEY, "args": [1],
                       "kwargs": {"m": "acme"}}


def test_a_payload_that_is_not_a_task_is_refused_by_name(store: Store) -> None:
    dl = _dead(store, _fired_run(store))
    broken = {**dl, "payload": {"task": "pay.merchants", "args": "1"}}
    with pytest.raises(ValueError, match=r"key must be a non-empty string; args must be an "
                                         r"array"):
        actions.requeue_payload(store, broken)
