"""A malformed runs row never crashes a worker's claim nor silently stops a slot, on SQLite
and PostgreSQL (fresh-user findings).

Before: a run whose stored ``args`` was an object or ``kwargs`` a list (written by SQL),
re-sent by the re-dispatch sweep, made the claim raise *after* its lease was committed: the
run stayed ``running`` with an attempt stuck ``running``, re-sent and crashing forever, and
nothing named the row. A run in a state the library does not know was taken over and run
by a worker, and made the beat count its slot as "already fired" (INFO) and never fire it.
Now the claim dead-letters such a run (reason ``malformed``, the key, the column and the
fix at ERROR), the message is acked, and ``status`` counts it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select, text

from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.celery import commands as _commands  # noqa: F401  (cli_status import cycle)
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, entries, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.slots import idempotency_key

UTC = timezone.utc


def _now(store: Store) -> datetime:
    with store.begin() as conn:
        return store.now(conn)


def _app(store: Store) -> Celery:
    app = Celery("badruns", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False),
        reliable_beat_lease_seconds=5,
        reliable_beat_retry_max_attempts=3,
        reliable_beat_retry_base_seconds=0.01,
        reliable_beat_retry_cap_seconds=0.05,
    )
    return app


@pytest.fixture
def app(store: Store) -> Iterator[Celery]:
    yield _app(store)


def _insert_run(store: Store, key: str, now: datetime, **values: Any) -> None:
    row: dict[str, Any] = dict(
        idempotency_key=key, entry_name=None, fire_at=None, trigger="adhoc", task="bad.task",
        args=[], kwargs={}, state="dispatched", created_at=now, updated_at=now,
    )
    row.update(values)
    with store.begin() as conn:
        conn.execute(runs.insert().values(**row))


def _task(app: Celery, calls: list[Any]) -> Any:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="bad.task")
    def bad_task(self: IdempotentTask, *args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "ran"

    return bad_task


def _assert_dead_lettered(store: Store, key: str, *columns: str) -> None:
    with store.engine.connect() as conn:
        run = conn.execute(select(runs.c.id, runs.c.state, runs.c.reason).where(
            runs.c.idempotency_key == key)).one()
        letters = conn.execute(select(dead_letters.c.reason, dead_letters.c.error).where(
            dead_letters.c.key == key)).all()
        open_attempts = conn.execute(select(attempts.c.id).where(
            attempts.c.run_id == run.id, attempts.c.outcome == "running")).all()
    assert run.state == "dead", run
    assert run.reason.startswith("malformed: "), run.reason
    assert len(letters) == 1 and letters[0].reason == "malformed", letters
    for column in columns:
        assert (f"{column}=" in letters[0].error or f"{column}: unreadable" in letters[0].error
                ), (column, letters[0].error)
    assert open_attempts == []  # no attempt left "running" forever


#: name -> (values written to the run row, columns the dead letter must name)
BAD_CALLS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "args_object": ({"args": {"a": 1}}, ("args",)),
    "kwargs_list": ({"kwargs": [1]}, ("kwargs",)),
    "both": ({"args": {"a": 1}, "kwargs": [1]}, ("args", "kwargs")),
    "state_garbage": ({"state": "garbage"}, ("state",)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("left_running", [False, True], ids=["dispatched", "stuck_running"])
def test_malformed_run_is_dead_lettered_at_the_claim_not_crashed_on(
    app: Celery, store: Store, case: str, left_running: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The re-sent trigger of a malformed run: the body never runs, the execution ends
    (acked, no exception, no retry), the run and its stuck attempt are settled, and status
    --check reports the dead letter."""
    now = _now(store)
    key = f"bad:{case}"
    bad, columns = BAD_CALLS[case]
    extra: dict[str, Any] = {}
    if left_running:  # what the crash loop left behind: running, lease expired, attempt open
        extra = {"state": "running", "fence_token": 1, "attempts": 1, "leased_by": "w:1",
                 "lease_expires_at": now - timedelta(minutes=5)}
    _insert_run(store, key, now, **{**extra, **bad})
    if left_running:
        with store.begin() as conn:
            run_id = conn.execute(select(runs.c.id).where(runs.c.idempotency_key == key)
                                  ).scalar_one()
            conn.execute(attempts.insert().values(
                run_id=run_id, attempt=1, fence_token=1, worker="w:1", started_at=now,
                outcome="running"))
    calls: list[Any] = []
    task = _task(app, calls)
    with caplog.at_level(logging.ERROR, logger="reliable_beat"):
        for _ in range(2):  # a second delivery is just as quiet
            result = task.apply((), headers={KEY_HEADER: key})
            assert result.successful(), result.traceback
            assert result.result is None
    assert calls == []
    _assert_dead_lettered(store, key, *columns)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(key in m and "Fix:" in m for m in logged), logged
    status = collect_status(store)
    assert status["quarantined_rows"]["runs"] == 1
    assert any("dead letters" in p for p in status["problems"]), status["problems"]


#: SQLite only: text no reader can decode in the columns a claim reads.
BAD_SQLITE_TEXT: dict[str, tuple[str, str]] = {
    "args_text": ("args", "[1,"),
    "kwargs_text": ("kwargs", "{'a': 1}"),
    "lease_text": ("lease_expires_at", "yesterday"),
    "fire_at_text": ("fire_at", "2020-13-45 99:00:00"),
    "fence_text": ("fence_token", "many"),
}


@pytest.mark.parametrize("case", list(BAD_SQLITE_TEXT))
def test_undecodable_run_values_are_dead_lettered_on_sqlite(
    sqlite_store: Store, case: str
) -> None:
    store = sqlite_store
    app = _app(store)
    now = _now(store)
    key = f"sqlite:{case}"
    column, raw = BAD_SQLITE_TEXT[case]
    _insert_run(store, key, now, state="running", fence_token=1, attempts=1,
                leased_by="w:1", lease_expires_at=now - timedelta(minutes=5))
    with store.begin() as conn:
        conn.execute(text(f"UPDATE reliable_beat_runs SET {column} = :v "
                          "WHERE idempotency_key = :k"), {"v": raw, "k": key})
    calls: list[Any] = []
    result = _task(app, calls).apply((), headers={KEY_HEADER: key})
    assert result.successful(), result.traceback
    assert calls == []
    _assert_dead_lettered(store, key, column)


def test_a_good_run_next_to_a_malformed_one_still_runs(app: Celery, store: Store) -> None:
    now = _now(store)
    _insert_run(store, "bad:1", now, args={"a": 1})
    _insert_run(store, "good:1", now)
    calls: list[Any] = []
    task = _task(app, calls)
    assert task.apply((), headers={KEY_HEADER: "bad:1"}).result is None
    assert task.apply((), headers={KEY_HEADER: "good:1"}).get() == "ran"
    assert calls == [((), {})]
    with store.engine.connect() as conn:
        states = dict(conn.execute(select(runs.c.idempotency_key, runs.c.state)).all())
    assert states == {"bad:1": "dead", "good:1": "succeeded"}


def test_unknown_state_on_a_future_slot_is_reported_not_taken_as_fired(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A run pre-inserted for an entry's next slot with a state nobody knows: the beat does
    not fire the slot (its key exists: it may have run), does not call it "already fired"
    either, dead-letters it as malformed (ERROR with the key and the fix) for a person, and
    status --check reports it. The entry's later slots fire as usual."""
    now = _now(store)
    d = EntryDefinition(name="e", task="beatapp.tick", args=[],
                        schedule=sch.IntervalSchedule(timedelta(seconds=60),
                                                      now - timedelta(seconds=30)))
    slot = now - timedelta(seconds=1)
    values = d.row_values()
    values.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                  paused=False, misfire_grace_seconds=600)
    key = idempotency_key("e", slot)
    with store.begin() as conn:
        conn.execute(entries.insert().values(**values))
    _insert_run(store, key, now, entry_name="e", fire_at=slot, trigger="schedule",
                task="beatapp.tick", state="garbage")
    with caplog.at_level(logging.ERROR, logger="reliable_beat"):
        result = Beat(store, owner="t:1").tick()
    assert [t.key for t in result.triggers] == []
    assert result.malformed_runs == 1 and result.duplicates == 0
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(key in m and "state='garbage'" in m and "requeue" in m for m in logged), logged
    _assert_dead_lettered(store, key, "state")
    status = collect_status(store)
    assert status["quarantined_rows"]["runs"] == 1
    assert any("dead letters" in p for p in status["problems"]), status["problems"]
    with store.engine.connect() as conn:  # the entry moved on: its next slot is its own
        next_fire = conn.execute(select(entries.c.next_fire_at)).scalar_one()
    assert next_fire > slot


@pytest.fixture
def stub(sqlite_url: str, sqlite_store: Store) -> Iterator[Any]:
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from reliable_beat.dramatiq import ReliableBeat

    broker = StubBroker()
    broker.add_middleware(ReliableBeat(settings={
        "database_url": sqlite_url, "retry_max_attempts": 2, "retry_base_seconds": 0.01,
        "retry_cap_seconds": 0.02, "lease_seconds": 1}))
    dramatiq.set_broker(broker)
    worker = dramatiq.Worker(broker, worker_timeout=50)
    worker.start()
    yield broker
    worker.stop()
    broker.close()


@pytest.mark.timeout(60)
def test_malformed_run_is_dead_lettered_by_an_idempotent_actor(
    stub: Any, sqlite_store: Store
) -> None:
    """The Dramatiq adapter shares the claim: the message is acked (not retried, not in
    Dramatiq's dead letters), the run dead-lettered as malformed, the body never runs."""
    import dramatiq

    from reliable_beat.dramatiq import IdempotentActor

    calls: list[int] = []

    @dramatiq.actor(actor_class=IdempotentActor)
    def act(n: int) -> None:
        calls.append(n)

    now = _now(sqlite_store)
    _insert_run(sqlite_store, "dq:bad", now, task=act.actor_name, kwargs=[1])
    act.send_with_key("dq:bad", 1)
    stub.join(act.queue_name, fail_fast=False)
    assert calls == []
    assert stub.dead_letters == []
    _assert_dead_lettered(sqlite_store, "dq:bad", "kwargs")
