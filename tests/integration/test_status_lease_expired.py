"""``status`` reports ``running`` runs whose lease expired long ago (LEASE EXPIRED).

Trial finding (leaseops): a run whose worker died holding the lease (its message lost, or
back in a queue nobody reads) sat in ``running`` with no alarm of its own; ``status
--check`` exited 0. Real PostgreSQL; runs seeded with the store's clock.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from click.testing import CliRunner
from sqlalchemy import insert

from reliable_beat import runs as rb_runs
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, runs


def _running(store: Store, key: str, *, lease_ended: float, trigger: bool = True) -> None:
    """A ``running`` run whose lease ends ``lease_ended`` seconds before the store's now
    (negative: still live)."""
    with store.begin() as conn:
        now: Any = store.now(conn)
        at = now - timedelta(minutes=30)
        run_id = conn.execute(insert(runs).values(
            idempotency_key=key, entry_name=key.split("@")[0] if trigger else None,
            fire_at=at if trigger else None, trigger="schedule" if trigger else "adhoc",
            task="proj.pay", args=[], kwargs={}, state="running", fence_token=1,
            attempts=1, created_at=at, updated_at=at, dispatched_at=at, started_at=at,
            leased_by="host-a:4242", lease_expires_at=now - timedelta(seconds=lease_ended),
        ).returning(runs.c.id)).scalar_one()
        if trigger:
            conn.execute(insert(outbox).values(
                message_id=f"trigger:{key}", destination="celery", payload={}, headers={},
                run_id=run_id, state="sent", available_at=at, created_at=at, sent_at=at))


def _cli(store: Store, *args: str) -> Any:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, "status", *args],
                              catch_exceptions=False)


def test_lease_expired_is_a_problem_only_when_truly_stuck(pg_store: Store) -> None:
    """Fails on the old status: no LEASE EXPIRED problem, ``--check`` exited 0."""
    _running(pg_store, "pay@1", lease_ended=600)  # the worker died 10 min ago
    _running(pg_store, "inv:7", lease_ended=120, trigger=False)  # an ad-hoc call's
    _running(pg_store, "pay@2", lease_ended=5)  # a renewal a moment late: not stuck
    _running(pg_store, "pay@3", lease_ended=-40)  # a live lease
    info = collect_status(pg_store, redispatch_seconds=120)
    found = [p for p in info["problems"] if p.startswith("LEASE EXPIRED")]
    assert len(found) == 1, info["problems"]
    line = found[0]
    assert "2 running runs whose lease expired more than 30 s ago" in line
    assert "pay@1" in line and "inv:7" in line
    assert "pay@2" not in line and "pay@3" not in line
    assert "held by host-a:4242" in line and "reliable-beat lease clear KEY" in line
    # pay@1's sweep was due 120 s after its lease ended (8 min ago): no beat or relay runs
    assert "the sweep was due to re-send it at" in line
    assert "no trigger row: the sweep does not re-send it" in line  # inv:7
    expired = info["expired_leases"]
    assert expired["count"] == 2 and [r["key"] for r in expired["runs"]] == ["pay@1", "inv:7"]
    assert expired["runs"][1]["resend_at"] is None
    assert 595 <= expired["runs"][0]["expired_seconds"] <= 700
    assert not info["ok"]

    checked = _cli(pg_store, "--check")
    assert checked.exit_code == 1 and "!! LEASE EXPIRED: 2 running runs" in checked.output
    body = json.loads(_cli(pg_store, "--json").output)
    assert body["expired_leases"]["count"] == 2
    assert isinstance(body["expired_leases"]["runs"][0]["lease_expires_at"], str)

    # a person clears them: no longer running, no longer an expired lease
    rb_runs.release_lease(pg_store, "pay@1")
    rb_runs.release_lease(pg_store, "inv:7")
    info = collect_status(pg_store, redispatch_seconds=120)
    assert info["expired_leases"] == {"count": 0, "runs": []}
    assert not [p for p in info["problems"] if p.startswith("LEASE EXPIRED")]


def test_lease_expired_sweep_time_and_bounded_output(pg_store: Store) -> None:
    for i in range(15):
        _running(pg_store, f"pay@{i:02d}", lease_ended=40 + i)
    info = collect_status(pg_store, redispatch_seconds=120)
    line = next(p for p in info["problems"] if p.startswith("LEASE EXPIRED"))
    assert line.startswith("LEASE EXPIRED: 15 running runs")
    assert line.count("held by") == 10 and "; ...)" in line  # the 10 longest expired
    assert "pay@14" in line and "pay@00" not in line
    # lease ended 40-54 s ago, sweep after 120 s: still ahead
    assert "the sweep re-sends it at about" in line
    assert len(info["expired_leases"]["runs"]) == 10
    assert info["expired_leases"]["count"] == 15
