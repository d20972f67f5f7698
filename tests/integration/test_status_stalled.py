"""``status`` tells an entry whose triggers stopped being started (it ran before: workers
down or behind) from one whose task no worker ever started (a typo, a removed task).

Fresh-user finding: a Dramatiq actor that had run 93 times before its worker was killed was
reported as NEVER STARTED "a typo? a removed task?" with `celery inspect` advice, and a second
entry on the same actor, whose stuck trigger the re-dispatch sweep had just re-sent (its
``dispatched_at`` moved to then), was not listed at all.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from click.testing import CliRunner
from sqlalchemy import insert

from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import runs


def _run(name: str, i: int, at: datetime, *, started: bool,
         redispatches: int = 0) -> dict[str, Any]:
    return {
        "idempotency_key": f"{name}@{i}", "entry_name": name, "fire_at": at,
        "trigger": "schedule", "task": "proj.pay", "args": [], "kwargs": {},
        "state": "succeeded" if started else "dispatched", "created_at": at,
        "updated_at": at, "dispatched_at": at, "started_at": at if started else None,
        "redispatches": redispatches,
    }


def _seed(store: Store) -> datetime:
    with store.begin() as conn:
        now = store.now(conn)
        rows = []
        # ran 5 times, then its worker was killed: 3 triggers wait
        for i in range(8):
            rows.append(_run("pay_merchants", i, now - timedelta(minutes=60 - i),
                             started=i < 5))
        # same actor; its one stuck trigger was just re-sent by the sweep (dispatched_at
        # is recent, but it has waited redispatch_seconds already)
        rows.append(_run("pay_merchants_eu", 0, now - timedelta(minutes=50), started=True))
        rows.append(_run("pay_merchants_eu", 1, now - timedelta(seconds=5), started=False,
                         redispatches=3))
        # never started by anyone: a typo
        rows.append(_run("typo", 0, now - timedelta(minutes=30), started=False))
        # still fresh: not yet late
        rows.append(_run("fresh", 0, now - timedelta(seconds=5), started=False))
        conn.execute(insert(runs), rows)
    return now


def test_stalled_entries_are_not_called_a_typo(pg_store: Store) -> None:
    """Fails on the old check: pay_merchants was in NEVER STARTED with typo advice, and
    pay_merchants_eu (re-dispatched) was not reported at all."""
    _seed(pg_store)
    info = collect_status(pg_store, redispatch_seconds=120)  # no app: neutral advice
    assert info["unstarted"] == {"pay_merchants": 3, "pay_merchants_eu": 1, "typo": 1}
    never = [p for p in info["problems"] if p.startswith("NEVER STARTED")]
    assert len(never) == 1 and "(typo)" in never[0], info["problems"]
    assert "pay_merchants" not in never[0]
    stalled = [p for p in info["problems"] if p.startswith("STALLED")]
    assert len(stalled) == 1, info["problems"]
    assert "4 triggers of 2 entries" in stalled[0]
    assert "pay_merchants last ran " in stalled[0]
    assert "pay_merchants_eu last ran " in stalled[0]
    assert "down or behind" in stalled[0] and "typo" not in stalled[0]
    assert "celery" not in stalled[0] and "celery" not in never[0]
    assert info["unstarted_stalled"] == ["pay_merchants", "pay_merchants_eu"]
    assert set(info["last_started_at"]) == {"pay_merchants", "pay_merchants_eu"}
    assert not info["ok"]


def test_dramatiq_advice(pg_store: Store) -> None:
    """With a Dramatiq app the advice names dramatiq workers, never `celery inspect`."""
    _seed(pg_store)
    info = collect_status(pg_store, redispatch_seconds=120, framework="dramatiq")
    for label in ("STALLED", "NEVER STARTED"):
        text = next(p for p in info["problems"] if p.startswith(label))
        assert "dramatiq" in text and "celery" not in text, text


def test_celery_advice_and_check_exit(pg_store: Store) -> None:
    _seed(pg_store)
    result = CliRunner().invoke(reliable_beat, ["--database-url", pg_store.url, "status",
                                                "--check"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert "!! STALLED: 4 triggers of 2 entries" in result.output
    assert "!! NEVER STARTED" in result.output and "(typo)" in result.output
    info = collect_status(pg_store, redispatch_seconds=120, framework="celery")
    stalled = next(p for p in info["problems"] if p.startswith("STALLED"))
    assert "celery -A APP inspect active_queues" in stalled


def test_framework_name() -> None:
    from celery import Celery

    from reliable_beat.cli.status import framework_name

    assert framework_name(None) is None
    assert framework_name(Celery("x")) == "celery"
