"""Lost trigger messages: a tracked run stuck in `dispatched` gets its trigger sent again."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import insert, select, update

from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.redispatch import BACKOFF_CAP, claim_stuck_runs
from reliable_beat.relay import mark_sent


def _entry(store: Store, name: str, task: str) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(
            insert(entries).values(
                name=name, task=task, args=[], kwargs={}, options={}, schedule_kind="interval",
                schedule={"kind": "interval", "every_seconds": 3600, "timezone": "UTC",
                          "anchor": "2026-01-01T00:00:00Z"},
                timezone="UTC", next_fire_at=now - timedelta(seconds=5), created_at=now,
                updated_at=now,
            )
        )


def _fire_and_dispatch(store: Store) -> None:
    result = Beat(store, owner="t").tick()
    assert result.triggers
    with store.begin() as conn:
        mark_sent(conn, [t.id for t in result.triggers], store.now(conn))


def _backdate(store: Store, seconds: float) -> None:
    with store.begin() as conn:
        conn.execute(
            update(runs).values(
                dispatched_at=datetime.now(timezone.utc) - timedelta(seconds=seconds)
            )
        )


def test_stuck_tracked_run_is_redispatched_once_per_period(store: Store) -> None:
    _entry(store, "tracked", "app.tracked")
    _entry(store, "plain", "app.plain")
    _fire_and_dispatch(store)
    with store.begin() as conn:
        now = store.now(conn)
        # Not stuck yet: dispatched just now.
        assert claim_stuck_runs(store, conn, now=now, after=timedelta(seconds=60),
                                tasks=["app.tracked"]) == []
    _backdate(store, 120)
    with store.begin() as conn:
        now = store.now(conn)
        stuck = claim_stuck_runs(store, conn, now=now, after=timedelta(seconds=60),
                                 tasks=["app.tracked"])
    assert [m.payload["task"] for m in stuck] == ["app.tracked"]
    assert stuck[0].payload["headers"]["reliable_beat_entry"] == "tracked"
    assert stuck[0].message_id.startswith("trigger:tracked@")
    with store.begin() as conn:
        now = store.now(conn)
        # Its clock moved on: not picked again within the period; the plain task never is.
        assert claim_stuck_runs(store, conn, now=now, after=timedelta(seconds=60),
                                tasks=["app.tracked"]) == []


def test_started_and_finished_runs_are_left_alone(store: Store) -> None:
    _entry(store, "tracked", "app.tracked")
    _fire_and_dispatch(store)
    _backdate(store, 120)
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(runs).values(state="running",
                                         lease_expires_at=now + timedelta(seconds=30)))
        assert claim_stuck_runs(store, conn, now=now, after=timedelta(seconds=60),
                                tasks=["app.tracked"]) == []
        conn.execute(update(runs).values(state="succeeded"))
        assert claim_stuck_runs(store, conn, now=now, after=timedelta(seconds=60),
                                tasks=["app.tracked"]) == []
        # A worker that died mid-body: lease long expired, message never came back.
        conn.execute(update(runs).values(state="running",
                                         lease_expires_at=now - timedelta(seconds=300)))
        again = claim_stuck_runs(store, conn, now=now, after=timedelta(seconds=60),
                                 tasks=["app.tracked"])
        assert len(again) == 1
        assert conn.execute(select(runs.c.lease_expires_at)).scalar_one() == now


def test_retrying_run_is_redispatched_only_after_the_retry_window(store: Store) -> None:
    _entry(store, "tracked", "app.tracked")
    _fire_and_dispatch(store)
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(runs).values(state="retrying", updated_at=now - timedelta(seconds=90)))
        args = {"now": now, "after": timedelta(seconds=60), "tasks": ["app.tracked"]}
        assert claim_stuck_runs(store, conn, **args) == []  # retrying not asked for
        assert claim_stuck_runs(store, conn, retrying_after=timedelta(seconds=120), **args) == []
        found = claim_stuck_runs(store, conn, retrying_after=timedelta(seconds=80), **args)
        assert len(found) == 1
        assert claim_stuck_runs(store, conn, retrying_after=timedelta(seconds=80), **args) == []


def test_redispatch_backs_off_while_the_trigger_waits_in_a_backlog(store: Store) -> None:
    """A trigger queued behind a backlog looks lost (``dispatched``, unclaimed). Re-sending
    it every period added a duplicate per stuck run per period to the very backlog (on
    RabbitMQ under load the queue grew to thousands and never drained): the k-th re-send
    now waits ``after * 2**k``. 16 simulated minutes, after = 60 s, a look every 30 s: the
    old code re-sent it 10 times, the backoff 3 (90 s, 240 s, 510 s), and never gives up."""
    _entry(store, "tracked", "app.tracked")
    _fire_and_dispatch(store)
    after = timedelta(seconds=60)
    with store.begin() as conn:
        base = conn.execute(select(runs.c.dispatched_at)).scalar_one()
    sent_at: list[float] = []
    for step in range(1, 33):
        now = base + timedelta(seconds=30 * step)
        with store.begin() as conn:
            if claim_stuck_runs(store, conn, now=now, after=after, tasks=["app.tracked"]):
                sent_at.append((now - base).total_seconds())
    assert sent_at == [90.0, 240.0, 510.0], sent_at
    with store.begin() as conn:
        assert conn.execute(select(runs.c.redispatches)).scalar_one() == 3
    # capped, not abandoned: a message really lost is still re-sent, after * 2**BACKOFF_CAP
    with store.begin() as conn:
        late = base + timedelta(seconds=510 + 60 * 2**BACKOFF_CAP + 1)
        assert claim_stuck_runs(store, conn, now=late, after=after, tasks=["app.tracked"])
        conn.execute(update(runs).values(redispatches=10))
        later = late + timedelta(seconds=60 * 2**BACKOFF_CAP + 1)
        assert claim_stuck_runs(store, conn, now=later, after=after, tasks=["app.tracked"])


def _retrying_adhoc(store: Store, key: str, task: str, due_ago: float) -> int:
    """An ad-hoc call's run (no trigger row) waiting in ``retrying`` since ``due_ago`` s."""
    with store.begin() as conn:
        now = store.now(conn)
        return int(conn.execute(insert(runs).values(
            idempotency_key=key, trigger="adhoc", task=task, args=[1], kwargs={"b": 2},
            state="retrying", fence_token=1, attempts=1, created_at=now, updated_at=now,
            retry_at=now - timedelta(seconds=due_ago)).returning(runs.c.id)).scalar_one())


def test_retrying_run_without_trigger_row_is_re_sent_from_its_run_row(store: Store) -> None:
    """An ad-hoc call's run left ``retrying`` (its retry message lost or dropped) is re-sent
    ``after`` past its ``retry_at``, as built from the run row, in the publisher's payload
    shape; a workflow activity's run is left to the workflow sweep. Fails on the old code:
    runs without a trigger row were never claimed."""
    celery_id = _retrying_adhoc(store, "manual:c", "app.tracked", 90)
    dq_id = _retrying_adhoc(store, "manual:d", "app.actor", 90)
    _retrying_adhoc(store, "manual:young", "app.tracked", 30)
    _retrying_adhoc(store, "wf:w1/r1#1", "app.tracked", 900)
    args = {"after": timedelta(seconds=60), "retrying_after": timedelta(seconds=600)}
    with store.begin() as conn:
        now = store.now(conn)
        [c] = claim_stuck_runs(store, conn, now=now, tasks=["app.tracked"], **args)
        [d] = claim_stuck_runs(store, conn, now=now, tasks=["app.actor"],
                               destination="dramatiq", **args)
    assert (c.run_id, c.id, c.destination) == (celery_id, -celery_id, "celery")
    assert c.payload["task"] == "app.tracked" and c.payload["args"] == [1]
    assert c.payload["kwargs"] == {"b": 2}
    assert c.payload["headers"]["reliable_beat_key"] == "manual:c"
    assert (d.run_id, d.destination) == (dq_id, "dramatiq")
    assert d.payload["reliable_beat"]["key"] == "manual:d"
    with store.begin() as conn:
        row = conn.execute(select(runs.c.retry_at, runs.c.redispatches)
                           .where(runs.c.id == celery_id)).one()
        assert row.redispatches == 1 and row.retry_at == now  # the next re-send counts from now
        assert claim_stuck_runs(store, conn, now=store.now(conn), tasks=["app.tracked"],
                                **args) == []
