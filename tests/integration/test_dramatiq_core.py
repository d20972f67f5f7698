"""The framework-neutral core the Dramatiq adapter stands on, and the adapter in process.

* importing every core module (``reliable_beat/*.py``, ``reliable_beat/db/``, not the
  adapters) with Celery and kombu made unimportable works and loads neither (subprocess);
* trigger rows of destination ``dramatiq`` move their runs like Celery's (``mark_sent`` ->
  ``dispatched``, ``mark_expired`` -> ``skipped``) and are found by the re-dispatch sweep;
* the core ``BeatLoop`` publishes through a ``Publisher`` and marks the outcome;
* ``IdempotentActor`` in process (Dramatiq's ``StubBroker`` and a real ``Worker``, SQLite):
  key refusal, deduplication, a dead letter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from reliable_beat import schedules as sch
from reliable_beat import unsent
from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, entries, outbox, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.errors import IdempotencyKeyError
from reliable_beat.loop import BeatLoop, trigger_messages
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redispatch import claim_stuck_runs
from reliable_beat.relay import mark_expired, mark_sent
from reliable_beat.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_core_modules_import_without_celery_or_kombu() -> None:
    script = textwrap.dedent("""
        import importlib, pathlib, sys

        class Block:  # Celery and kombu are "not installed"
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("celery", "kombu"):
                    raise ImportError(f"blocked: {name}")
                return None

        sys.meta_path.insert(0, Block())
        import reliable_beat
        root = pathlib.Path(reliable_beat.__file__).parent
        names = [f"reliable_beat.{p.stem}" for p in sorted(root.glob("*.py"))
                 if p.stem != "__init__"]
        names += [f"reliable_beat.db.{p.stem}" for p in sorted((root / "db").glob("*.py"))
                  if p.stem != "__init__"]
        for name in names:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "kombu"))
        print(len(names), loaded)
        assert not loaded, loaded
        assert "reliable_beat.execution" in names and "reliable_beat.loop" in names
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _seed_due(store: Store, name: str = "e", task: str = "t",
              ahead: timedelta = timedelta(seconds=-30)) -> datetime:
    """An entry every 60 s whose next slot is ``ahead`` from now (default 30 s ago: due)."""
    with store.begin() as conn:
        now = store.now(conn).replace(microsecond=0)
    anchor = now + ahead
    d = EntryDefinition(name=name, task=task, schedule=sch.IntervalSchedule(
        timedelta(seconds=60), anchor))
    with store.begin() as conn:
        values = d.row_values()
        values.update(next_fire_at=anchor, created_at=now, updated_at=now, enabled=True,
                      paused=False)
        conn.execute(entries.insert().values(**values))
    return anchor


def _run_state(store: Store) -> str:
    with store.engine.connect() as conn:
        return str(conn.execute(select(runs.c.state)).scalar_one())


@pytest.mark.parametrize("end", ["sent", "expired"])
def test_dramatiq_trigger_rows_move_their_runs(sqlite_store: Store, end: str) -> None:
    store = sqlite_store
    _seed_due(store)
    result = Beat(store, owner="t:1", trigger_destination="dramatiq").tick()
    assert len(result.triggers) == 1
    with store.begin() as conn:  # its row, as a publish the broker refused writes it
        now = store.now(conn)
        unsent.write_trigger_rows(store, conn,
                                  trigger_messages(result.triggers, "dramatiq"), now)
    with store.engine.connect() as conn:
        row_id, destination = conn.execute(select(outbox.c.id, outbox.c.destination)).one()
    assert destination == "dramatiq"
    with store.begin() as conn:
        (mark_sent if end == "sent" else mark_expired)(conn, [row_id], now)
    assert _run_state(store) == ("dispatched" if end == "sent" else "skipped")


@pytest.mark.parametrize("end", ["sent", "expired"])
def test_dramatiq_rowless_triggers_move_their_runs(sqlite_store: Store, end: str) -> None:
    store = sqlite_store
    _seed_due(store)
    result = Beat(store, owner="t:1", trigger_destination="dramatiq").tick()
    assert [t.outbox_id for t in result.triggers] == [None]  # due: no row
    with store.begin() as conn:
        (mark_sent if end == "sent" else mark_expired)(conn, [result.triggers[0].id],
                                                       store.now(conn))
    assert _run_state(store) == ("dispatched" if end == "sent" else "skipped")


def test_redispatch_finds_stuck_dramatiq_triggers(sqlite_store: Store) -> None:
    store = sqlite_store
    _seed_due(store)
    result = Beat(store, owner="t:1", trigger_destination="dramatiq").tick()
    with store.begin() as conn:
        now = store.now(conn)
        # its row, as a publish the broker refused writes it (then sent by a relay)
        unsent.write_trigger_rows(store, conn,
                                  trigger_messages(result.triggers, "dramatiq"), now)
        mark_sent(conn, list(conn.execute(select(outbox.c.id)).scalars()), now)
        conn.execute(update(runs).values(dispatched_at=now - timedelta(hours=1)))
    with store.begin() as conn:
        stuck = claim_stuck_runs(store, conn, now=store.now(conn), after=timedelta(seconds=60),
                                 tasks=["t"])
    assert [m.destination for m in stuck] == ["dramatiq"]


def test_redispatch_of_a_rowless_dramatiq_trigger_takes_the_callers_shape(
    sqlite_store: Store,
) -> None:
    store = sqlite_store
    _seed_due(store)
    result = Beat(store, owner="t:1", trigger_destination="dramatiq").tick()
    with store.begin() as conn:
        now = store.now(conn)
        mark_sent(conn, [result.triggers[0].id], now)
        conn.execute(update(runs).values(dispatched_at=now - timedelta(hours=1)))
    with store.begin() as conn:
        stuck = claim_stuck_runs(store, conn, now=store.now(conn), after=timedelta(seconds=60),
                                 tasks=["t"], destination="dramatiq")
    assert [m.destination for m in stuck] == ["dramatiq"]
    assert stuck[0].payload == result.triggers[0].payload


class _Recorder:
    destination = "dramatiq"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.published: list[OutboxMessage] = []

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        self.published += messages
        return [(m.id, ConnectionError("down") if self.fail else None) for m in messages]

    def tracked_tasks(self) -> Collection[str]:
        return ["t"]


def test_beat_loop_publishes_and_marks(sqlite_store: Store) -> None:
    pub = _Recorder()
    loop = BeatLoop(store=sqlite_store, settings=Settings(), publisher=pub, owner="t:1")
    _seed_due(sqlite_store)
    loop.step()
    assert [m.payload["task"] for m in pub.published] == ["t"]
    assert _run_state(sqlite_store) == "dispatched"
    with sqlite_store.engine.connect() as conn:  # a due trigger: its run is its record
        assert conn.execute(select(outbox.c.state)).all() == []


def test_beat_loop_leaves_unpublished_triggers_pending(sqlite_store: Store) -> None:
    loop = BeatLoop(store=sqlite_store, settings=Settings(), publisher=_Recorder(fail=True),
                    owner="t:1")
    _seed_due(sqlite_store)
    loop.step()
    assert _run_state(sqlite_store) == "scheduled"
    with sqlite_store.engine.connect() as conn:
        assert conn.execute(select(outbox.c.state)).scalar_one() == "pending"


class _TimedRecorder(_Recorder):
    """Records when (host clock, UTC) each batch left: a publisher without ``publish_at``."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[datetime] = []

    def publish(self, messages: Sequence[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        self.at.append(datetime.now(timezone.utc))
        return super().publish(messages, now)


def test_beat_loop_claims_ahead_holds_and_publishes_at_the_slot(sqlite_store: Store) -> None:
    """The core loop (the Dramatiq beat's) claims an ``allow`` entry up to the claim-ahead
    before its slot, commits its run and trigger, holds the trigger and publishes it at the
    slot, never before. Fails on the old core loop: it had no claim-ahead (nothing was
    committed before the slot)."""
    store = sqlite_store
    pub = _TimedRecorder()
    loop = BeatLoop(store=store, settings=Settings(claim_ahead_seconds=3), publisher=pub,
                    owner="t:1")
    slot = _seed_due(store, "ahead", ahead=timedelta(seconds=2))  # 1-2 s away
    loop.step()
    assert pub.published == []  # claimed and committed, but held until the slot
    assert _run_state(store) == "scheduled"
    with store.engine.connect() as conn:
        assert conn.execute(select(outbox.c.state)).scalar_one() == "pending"
    deadline = time.monotonic() + 30
    while not pub.published and time.monotonic() < deadline:
        time.sleep(min(loop.step(), 0.01))
    assert [m.payload["args"] for m in pub.published] == [[]]
    assert pub.at[0] >= slot, (pub.at[0], slot)  # at the slot, never before
    assert _run_state(store) == "dispatched"
    loop.close()


# ------------------------------------------------------ the adapter, in process ----

dramatiq = pytest.importorskip("dramatiq")


@pytest.fixture
def stub(sqlite_url: str, sqlite_store: Store) -> Any:
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


def _attempts(store: Store, key: str) -> list[str]:
    from reliable_beat import runs as runs_mod

    return [a["outcome"] for a in runs_mod.list_attempts(
        store, runs_mod.get_run(store, key)["id"])]


def test_idempotent_actor_in_process(stub: Any, sqlite_store: Store) -> None:
    from reliable_beat.dramatiq import IdempotentActor, current
    from reliable_beat.dramatiq.base import OUTBOX_MESSAGE_OPTION

    calls: list[int] = []

    @dramatiq.actor(actor_class=IdempotentActor, idempotency_key=lambda n: f"k:{n}")
    def act(n: int) -> int:
        calls.append(current().fence_token)
        return n * 2

    @dramatiq.actor(actor_class=IdempotentActor)
    def keyless() -> None:
        calls.append(-1)

    @dramatiq.actor(actor_class=IdempotentActor)
    def bad() -> None:
        raise ValueError("no")

    assert act.options["max_retries"] is None
    act.send(1)
    act.send(1)  # the same work again: deduplicated
    with pytest.raises(IdempotencyKeyError, match=r"keyless\.send_with_key\(key, \.\.\.\)"):
        keyless.send()  # no key: refused at the call site, nothing sent
    # ... and a keyless message sent anyway (broker.enqueue): refused in the worker
    stub.enqueue(dramatiq.Message(queue_name=keyless.queue_name, actor_name="keyless",
                                  args=(), kwargs={}, options={}))
    # an outbox row's message id in a slot's key form: reserved, refused (not that slot's run)
    stub.enqueue(dramatiq.Message(
        queue_name=keyless.queue_name, actor_name="keyless", args=(), kwargs={},
        options={OUTBOX_MESSAGE_OPTION: "nightly@2026-01-01T02:00:00Z"}))
    bad.send_with_key("bad:1")
    act.send_with_key("x" * 401, 3)  # a key the store cannot take: refused, not retried
    stub.join(act.queue_name, fail_fast=False)
    assert calls == [1]
    # The two messages may run at once on the worker's threads: the second then finds the
    # lease held (busy, retried after the lease) before it deduplicates.
    got = _attempts(sqlite_store, "k:1")
    assert got.count("succeeded") == 1 and got[-1] == "deduplicated", got
    assert set(got) <= {"succeeded", "busy", "deduplicated"}, got
    assert _attempts(sqlite_store, "bad:1") == ["dead"]
    # keyless, slot-shaped, bad, the long key: failed, in Dramatiq's dead letters (no retry)
    assert len(stub.dead_letters) == 4
    with sqlite_store.engine.connect() as conn:
        kinds = sorted(r.kind for r in conn.execute(select(dead_letters)))
        messages = list(conn.execute(
            select(dead_letters).where(dead_letters.c.kind == "message")))
        slot_runs = conn.execute(select(runs.c.id).where(
            runs.c.idempotency_key == "nightly@2026-01-01T02:00:00Z")).all()
    assert kinds == ["message", "message", "message", "run"]
    assert sorted(r.reason for r in messages) == ["invalid", "no_key", "no_key"]
    assert slot_runs == []  # no run under the slot's key
    assert any("form of a scheduled slot's key" in r.error for r in messages), [
        r.error for r in messages]


def test_periodic_definitions_are_validated(stub: Any, sqlite_store: Store) -> None:
    from reliable_beat.dramatiq import IdempotentActor, definitions
    from reliable_beat.errors import ConfigurationError

    @dramatiq.actor(actor_class=IdempotentActor, periodic="*/5 * * * *",
                    reliable_beat={"misfire_policy": "catch_up"})
    def every5() -> None: ...

    now = datetime.now().astimezone()
    defs = definitions(stub, {"nightly": {"actor": "every5", "schedule": 3600.0}},
                       now=now, settings=Settings())
    assert sorted(d.name for d in defs) == ["every5", "nightly"]
    with pytest.raises(ConfigurationError, match="broken"):
        definitions(stub, {"broken": {"actor": "every5", "schedule": "not a cron"}},
                    now=now, settings=Settings())


def test_publisher_and_handler_message_ids_are_deterministic(sqlite_url: str) -> None:
    from dramatiq.brokers.stub import StubBroker

    from reliable_beat.beat import build_trigger_payload, task_id_for
    from reliable_beat.dramatiq import (
        OPTION,
        DramatiqHandler,
        DramatiqPublisher,
        IdempotentActor,
        ReliableBeat,
    )
    from reliable_beat.handlers import MessageExpiredError

    stub = StubBroker()  # no worker: the test reads the queue
    stub.add_middleware(ReliableBeat(settings={"database_url": sqlite_url}))

    @dramatiq.actor(actor_class=IdempotentActor, queue_name="qq", broker=stub)
    def target(x: int) -> None: ...

    at = datetime(2026, 1, 1, 2, 0, tzinfo=timezone.utc)
    payload = build_trigger_payload(task="target", args=[1], kwargs={}, options={"expires": 60},
                                    key="e@2026-01-01T02:00:00Z", entry="e", fire_at=at,
                                    trigger="schedule")
    row = OutboxMessage(id=7, message_id="trigger:e@2026-01-01T02:00:00Z",
                        destination="dramatiq", payload=payload, run_id=1)
    pub = DramatiqPublisher(stub)
    assert pub.publish([row], at) == [(7, None)]
    late = pub.publish([row], at + timedelta(seconds=61))
    assert isinstance(late[0][1], MessageExpiredError)  # past expires_at: not published
    (sent,) = [m for m in stub.queues["qq"].queue]  # type: ignore[attr-defined]
    msg = dramatiq.Message.decode(sent)
    assert msg.message_id == task_id_for("e@2026-01-01T02:00:00Z")
    assert msg.options[OPTION] == {"key": "e@2026-01-01T02:00:00Z", "entry": "e",
                                   "fire_at": "2026-01-01T02:00:00Z", "trigger": "schedule"}
    # expires counts from the slot: Dramatiq's AgeLimit skips a delivery after slot + 60 s
    assert msg.message_timestamp == int(at.timestamp() * 1000)
    assert msg.options["max_age"] == 60_000
    assert pub.tracked_tasks() == ["target"]
    app_row = OutboxMessage(id=8, message_id="k#1", destination="dramatiq",
                            payload={"actor": "target", "args": [2]}, run_id=None)
    handler = DramatiqHandler(stub)
    handler(app_row)
    handler(app_row)  # a re-delivery by the relay: the same message id
    ids = [dramatiq.Message.decode(m).message_id for m in stub.queues["qq"].queue]
    assert len(ids) == 3 and ids[1] == ids[2] != ids[0]
