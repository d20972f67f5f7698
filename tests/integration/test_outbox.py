"""outbox.add, the claim, mark-sent / backoff / dead-letter, on SQLite and PostgreSQL; and the
handed case ``enqueue-before-commit-outbox`` (a, b, c) on PostgreSQL + Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, runs
from reliable_beat.db.tables import outbox as outbox_t
from reliable_beat.errors import DeliveryError, PermanentDeliveryError
from reliable_beat.handlers import CeleryHandler
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import (
    EXPIRED_ERROR,
    Relay,
    _Listener,
    mark_sent,
    outbox_status,
    purge_sent,
)
from reliable_beat.settings import Settings

APPS = Path(__file__).resolve().parents[1] / "apps"
WORKTREE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(APPS))

import redis_queue  # noqa: E402

FAST = Settings(database_url="unused://", outbox_retry_base_seconds=0.01,
                outbox_retry_cap_seconds=0.05, outbox_max_attempts=3, relay_poll_seconds=0.1)


def rows(store: Store) -> list[dict[str, object]]:
    with store.begin() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.select(outbox_t).order_by(outbox_t.c.id))]


class Recorder:
    """A handler that records message ids; fails per a plan ``{message_id: [exc, ...]}``."""

    def __init__(self, plan: dict[str, list[BaseException]] | None = None) -> None:
        self.seen: list[str] = []
        self.plan = plan or {}
        self.lock = threading.Lock()

    def __call__(self, message: OutboxMessage) -> None:
        with self.lock:
            self.seen.append(message.message_id)
            todo = self.plan.get(message.message_id)
            err = todo.pop(0) if todo else None
        if err is not None:
            raise err


def relay(store: Store, handler: Recorder, **kw: object) -> Relay:
    return Relay(store, handlers={"rec": handler}, settings=FAST, owner="t", **kw)  # type: ignore[arg-type]


def drain(r: Relay, limit: int = 100) -> None:
    for _ in range(limit):
        if r.run_once() == 0:
            return


# --------------------------------------------------------------------------- both stores


def test_add_joins_transaction_collapses_on_key(store: Store) -> None:
    with store.begin() as conn:
        assert outbox.add(conn, "rec", {"n": 1}, key="k1") == "k1"
        assert outbox.add(conn, "rec", {"n": 2}, key="k1") == "k1"  # same logical message
        generated = outbox.add(conn, "rec", {"n": 3})
    assert generated.startswith("msg:")
    with pytest.raises(RuntimeError), store.begin() as conn:
        outbox.add(conn, "rec", {"n": 4}, key="rolled-back")
        raise RuntimeError("effect failed")
    got = rows(store)
    assert [r["message_id"] for r in got] == ["k1", generated]
    assert got[0]["payload"] == {"n": 1}  # first write wins, never updated
    assert all(r["state"] == "pending" and r["attempts"] == 0 for r in got)
    with store.begin() as conn:
        outbox.add(conn, "rec", {"n": 1}, key="k1")  # after commit too
    assert len(rows(store)) == 2


def test_add_rejects_bad_arguments(store: Store) -> None:
    with store.begin() as conn:
        with pytest.raises(ValueError):
            outbox.add(conn, "rec", {}, key="x" * 401)
        with pytest.raises(ValueError):
            outbox.add(conn, "rec", {}, key="k", delay=timedelta(seconds=-1))


def test_add_takes_the_values_celerys_json_carries(store: Store) -> None:
    """A Decimal, datetime, UUID, bytes or tuple in a payload is stored in kombu's typed form
    (a Celery worker decodes it back); old code failed the caller's transaction with a
    TypeError from the JSON column at the insert."""
    from kombu.utils.json import loads as kombu_loads

    amount, when = Decimal("12.50"), datetime(2026, 1, 10, 2, 0, tzinfo=timezone.utc)
    ref = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    with store.begin() as conn:
        outbox.add(conn, "rec", {"args": [amount, when], "ref": ref, "raw": b"ok",
                                 "pair": (1, 2)}, key="typed", headers={"at": when})
    [row] = rows(store)
    assert row["payload"]["args"][0] == {"__type__": "decimal", "__value__": "12.50"}
    back = kombu_loads(json.dumps(row["payload"]))
    assert back == {"args": [amount, when], "ref": ref, "raw": b"ok", "pair": [1, 2]}
    assert kombu_loads(json.dumps(row["headers"])) == {"at": when}


def test_add_refuses_a_value_no_serializer_carries_naming_it(store: Store) -> None:
    with pytest.raises(ValueError, match=r"outbox message 'k'.*payload\['x'\].*object"), \
            store.begin() as conn:
        outbox.add(conn, "rec", {"x": object()}, key="k")
    assert rows(store) == []


def test_delay_holds_row_back(store: Store) -> None:
    with store.begin() as conn:
        outbox.add(conn, "rec", {}, key="later", delay=timedelta(hours=1))
        outbox.add(conn, "rec", {}, key="now")
    h = Recorder()
    drain(relay(store, h))
    assert h.seen == ["now"]
    assert [r["state"] for r in rows(store)] == ["pending", "sent"]


def test_claim_sets_lease_and_expired_lease_redelivers_same_id(store: Store) -> None:
    with store.begin() as conn:
        outbox.add(conn, "rec", {}, key="m1")
    r = relay(store, Recorder(), claim_lease_seconds=0.5)
    first = r.claim()  # a relay that claims and then dies before settling
    assert [m.message_id for m in first] == ["m1"] and first[0].attempts == 1
    assert r.claim() == []  # leased: nobody else gets it
    time.sleep(0.7)
    again = r.claim()
    assert [m.message_id for m in again] == ["m1"] and again[0].attempts == 2
    assert rows(store)[0]["claimed_by"] == "t"


def test_mark_sent_moves_trigger_run_to_dispatched(store: Store) -> None:
    now = datetime.now(timezone.utc)
    with store.begin() as conn:
        run_id = conn.execute(
            runs.insert().values(idempotency_key="e@1", task="t", args=[], kwargs={},
                                 state="scheduled", created_at=now, updated_at=now)
            .returning(runs.c.id)
        ).scalar_one()
        outbox.add(conn, "celery", {"task": "t"}, key="trigger:e@1", run_id=run_id)
    h = Recorder()
    r = Relay(store, handlers={"celery": h}, settings=FAST, owner="t")
    drain(r)
    assert h.seen == ["trigger:e@1"]
    row_id = int(rows(store)[0]["id"])  # type: ignore[call-overload]
    with store.begin() as conn:
        run = conn.execute(sa.select(runs)).one()
        assert run.state == "dispatched" and run.dispatched_at is not None
        assert mark_sent(conn, [row_id], now) == 0  # idempotent



def test_mark_sent_moves_each_run_once_in_one_batch(store: Store) -> None:
    """One batch, every case: a scheduled run is dispatched at ``now``; a run a worker claimed
    first keeps its state and gets ``dispatched_at`` only if it had none; a non-celery row's
    run and a run of a row left out are not touched; a second mark changes nothing."""
    t0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
    now = t0 + timedelta(seconds=5)
    earlier = t0 + timedelta(seconds=1)
    cases = {  # key: (run state, run dispatched_at, destination, in the batch)
        "sched": ("scheduled", None, "celery", True),
        "running": ("running", None, "celery", True),
        "seen": ("running", earlier, "celery", True),
        "other": ("scheduled", None, "webhook", True),
        "left": ("scheduled", None, "celery", False),
    }
    ids: dict[str, int] = {}
    with store.begin() as conn:
        for key, (state, dispatched_at, destination, _) in cases.items():
            run_id = conn.execute(
                runs.insert().values(idempotency_key=key, task="t", args=[], kwargs={},
                                     state=state, created_at=t0, updated_at=t0,
                                     dispatched_at=dispatched_at)
                .returning(runs.c.id)
            ).scalar_one()
            payload = ({"task": "t"} if destination == "celery"  # rows outbox.add accepts
                       else {"destination": "d", "path": "/x", "body": {}})
            outbox.add(conn, destination, payload, key=f"m:{key}", run_id=run_id)
            ids[key] = conn.execute(sa.select(outbox_t.c.id).where(
                outbox_t.c.message_id == f"m:{key}")).scalar_one()
    batch = [ids[k] for k, c in cases.items() if c[3]]
    with store.begin() as conn:
        assert mark_sent(conn, batch, now) == 4
        assert mark_sent(conn, batch, now + timedelta(seconds=1)) == 0
    with store.begin() as conn:
        got = {r.idempotency_key: (r.state, r.dispatched_at, r.updated_at)
               for r in conn.execute(sa.select(runs))}
        sent = {r.message_id: r.state for r in conn.execute(sa.select(outbox_t))}
    assert got == {
        "sched": ("dispatched", now, now),
        "running": ("running", now, t0),
        "seen": ("running", earlier, t0),
        "other": ("scheduled", None, t0),
        "left": ("scheduled", None, t0),
    }
    assert sent == {"m:sched": "sent", "m:running": "sent", "m:seen": "sent",
                    "m:other": "sent", "m:left": "pending"}

def test_transient_failure_backs_off_then_dead_letters(store: Store) -> None:
    boom = DeliveryError("far end down")
    with store.begin() as conn:
        outbox.add(conn, "rec", {"x": 1}, key="poison")
        outbox.add(conn, "rec", {}, key="flaky")
    h = Recorder({"poison": [boom] * 10, "flaky": [DeliveryError("once")]})
    r = relay(store, h)
    assert r.run_once() == 2
    state = {row["message_id"]: row for row in rows(store)}
    assert state["flaky"]["state"] == "pending" and state["flaky"]["last_error"]
    assert state["flaky"]["claimed_by"] is None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(x["state"] == "pending" for x in rows(store)):
        r.run_once()
        time.sleep(0.02)
    state = {row["message_id"]: row for row in rows(store)}
    assert state["flaky"]["state"] == "sent" and state["flaky"]["attempts"] == 2
    assert state["poison"]["state"] == "dead" and state["poison"]["attempts"] == 3
    assert h.seen.count("poison") == 3
    with store.begin() as conn:
        dl = conn.execute(sa.select(dead_letters)).one()
    assert (dl.kind, dl.key, dl.reason, dl.attempts) == ("outbox", "poison", "exhausted", 3)
    assert dl.payload["payload"] == {"x": 1} and "far end down" in dl.error


def test_permanent_failure_dead_letters_at_once(store: Store) -> None:
    with store.begin() as conn:
        outbox.add(conn, "rec", {}, key="bad")
    h = Recorder({"bad": [PermanentDeliveryError("HTTP 400")]})
    relay(store, h).run_once()
    assert rows(store)[0]["state"] == "dead"
    with store.begin() as conn:
        assert conn.execute(sa.select(dead_letters.c.reason)).scalar_one() == "permanent"


def test_ordering_key_single_relay(store: Store) -> None:
    with store.begin() as conn:
        for i in range(6):
            outbox.add(conn, "rec", {}, key=f"a{i}", ordering_key="A")
            outbox.add(conn, "rec", {}, key=f"free{i}")
    # a1 fails once: a2.. must wait for it
    h = Recorder({"a1": [DeliveryError("once")]})
    r = relay(store, h)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(x["state"] == "pending" for x in rows(store)):
        r.run_once()
        time.sleep(0.02)
    ordered = [m for m in h.seen if m.startswith("a")]
    assert ordered == ["a0", "a1", "a1", "a2", "a3", "a4", "a5"]
    assert h.seen.index("free5") < h.seen.index("a2")  # unordered rows are not held back


def test_unknown_destination_is_left_pending(store: Store) -> None:
    with store.begin() as conn:
        outbox.add(conn, "elsewhere", {}, key="x")
        status = outbox_status(conn)
    assert relay(store, Recorder()).run_once() == 0
    assert rows(store)[0]["attempts"] == 0
    assert status[0]["destination"] == "elsewhere" and status[0]["pending"] == 1
    assert status[0]["due"] == 1 and status[0]["oldest_pending_age_seconds"] >= 0


def test_retention_purges_old_sent_keeps_dead(store: Store) -> None:
    old = datetime.now(timezone.utc) - timedelta(days=8)
    with store.begin() as conn:
        for i in range(5):
            outbox.add(conn, "rec", {}, key=f"s{i}")
        outbox.add(conn, "rec", {}, key="dead")
        conn.execute(sa.update(outbox_t).values(state="sent", sent_at=old))
        conn.execute(sa.update(outbox_t).where(outbox_t.c.message_id == "dead")
                     .values(state="dead", sent_at=None))
        outbox.add(conn, "rec", {}, key="fresh")
    r = relay(store, Recorder())
    drain(r)  # delivers "fresh", purges the five old ones once
    assert sorted(x["message_id"] for x in rows(store)) == ["dead", "fresh"]
    with store.begin() as conn:
        assert purge_sent(conn, older_than=datetime.now(timezone.utc) + timedelta(1)) == 1
        status = outbox_status(conn)
    assert status == [{"destination": "rec", "pending": 0, "due": 0, "scheduled": 0, "backlog": 0,
                       "oldest_pending_at": None, "oldest_pending_age_seconds": None,
                       "dead": 1}]


def test_status_ages_backlog_from_due_time_and_counts_delayed_rows_as_scheduled(
    store: Store
) -> None:
    """Fresh-user finding 9: a workflow's 1 h timer wake written 30 min ago is not backlog
    (main: `1 pending, oldest 1800 s` with 0 due, so the operations.md alert on oldest >
    300 s fired for every sleeping workflow). A due row ages from its available_at; a row
    that failed ages from its created_at, through its retry backoff."""
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=30)
    with store.begin() as conn:
        outbox.add(conn, "rec", {}, key="timer", delay=timedelta(hours=1))
        conn.execute(sa.update(outbox_t).values(created_at=long_ago))
        status = outbox_status(conn)
    assert status[0]["pending"] == 1 and status[0]["due"] == 0
    assert status[0]["scheduled"] == 1
    assert status[0]["oldest_pending_at"] is None
    assert status[0]["oldest_pending_age_seconds"] is None
    with store.begin() as conn:  # the timer comes due 10 s ago: backlog of 10 s, not 30 min
        conn.execute(sa.update(outbox_t).values(
            available_at=datetime.now(timezone.utc) - timedelta(seconds=10)))
        status = outbox_status(conn)
    assert status[0]["due"] == 1 and status[0]["scheduled"] == 0
    assert 9 <= status[0]["oldest_pending_age_seconds"] < 60
    with store.begin() as conn:  # it failed and waits for its retry: ages from created_at
        conn.execute(sa.update(outbox_t).values(
            available_at=datetime.now(timezone.utc) + timedelta(minutes=5),
            last_error="ConnectionError", attempts=1))
        status = outbox_status(conn)
    assert status[0]["due"] == 0 and status[0]["scheduled"] == 0
    assert status[0]["oldest_pending_age_seconds"] >= 1790


# --------------------------------------------------------------------------- PostgreSQL only


def test_notify_delivered_on_commit_only(pg_store: Store) -> None:
    listener = _Listener(pg_store)
    try:
        assert listener.wait(0.1) is False  # connects and LISTENs
        with pg_store.begin() as conn:
            outbox.add(conn, "rec", {}, key="n1")
            assert listener.wait(0.3) is False  # not before commit
        assert listener.wait(2.0) is True
        with pytest.raises(RuntimeError), pg_store.begin() as conn:
            outbox.add(conn, "rec", {}, key="n2")
            raise RuntimeError
        assert listener.wait(0.5) is False  # rollback: no notification
    finally:
        listener.close()


def test_run_forever_wakes_on_notify(pg_store: Store) -> None:
    h = Recorder()
    settings = Settings(database_url="unused://", relay_poll_seconds=30.0)
    r = Relay(pg_store, handlers={"rec": h}, settings=settings, owner="t")
    stop = threading.Event()
    t = threading.Thread(target=r.run_forever, args=(stop,), daemon=True)
    t.start()
    try:
        time.sleep(0.5)  # idle now, waiting up to 30 s
        with pg_store.begin() as conn:
            outbox.add(conn, "rec", {}, key="wake")
        deadline = time.monotonic() + 5
        while not h.seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h.seen == ["wake"]
    finally:
        stop.set()
        t.join(5)


def _wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_run_forever_wakes_on_notify_late_in_a_long_poll(pg_store: Store) -> None:
    """A NOTIFY in the middle of a 30 s idle wait wakes the relay. On main the wait
    listened for its first second only, then slept the other 29 s deaf: a row added then
    waited for the next poll (any ``relay_poll_seconds`` above 1 s)."""
    h = Recorder()
    r = Relay(pg_store, handlers={"rec": h}, owner="t",
              settings=Settings(database_url="unused://", relay_poll_seconds=30.0))
    stop = threading.Event()
    t = threading.Thread(target=r.run_forever, args=(stop,), daemon=True)
    t.start()
    try:
        assert _wait_for(lambda: r._listener is not None and r._listener.conn is not None, 30)
        time.sleep(2.5)  # well into the idle wait: past its first second
        with pg_store.begin() as conn:
            outbox.add(conn, "rec", {}, key="late-wake")
        assert _wait_for(lambda: h.seen, 10), "the NOTIFY did not wake the relay"
        assert h.seen == ["late-wake"]
    finally:
        stop.set()
        t.join(35)


def test_run_forever_listens_before_its_first_claim(
        pg_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row committed right after the relay's first (empty) claim is delivered at once:
    the relay LISTENs before it claims. On main it began to LISTEN only after that claim,
    so the row's NOTIFY was lost and it waited a whole ``relay_poll_seconds`` (here 30 s)."""
    h = Recorder()
    r = Relay(pg_store, handlers={"rec": h}, owner="t",
              settings=Settings(database_url="unused://", relay_poll_seconds=30.0))
    real_run_once = r.run_once
    calls: list[int] = []

    def run_once_then_commit() -> int:
        claimed = real_run_once()
        calls.append(claimed)
        if len(calls) == 1:  # committed between the first claim and the first wait
            with pg_store.begin() as conn:
                outbox.add(conn, "rec", {}, key="between")
        return claimed

    monkeypatch.setattr(r, "run_once", run_once_then_commit)
    stop = threading.Event()
    t = threading.Thread(target=r.run_forever, args=(stop,), daemon=True)
    t.start()
    try:
        assert _wait_for(lambda: h.seen, 10), "the row waited for the next poll"
        assert h.seen == ["between"] and calls[0] == 0
    finally:
        stop.set()
        t.join(35)


# ---------------------------------------------------------------- case enqueue-before-commit


effects = sa.Table(
    "test_effects", sa.MetaData(),
    sa.Column("name", sa.String(50), primary_key=True),
    sa.Column("executions", sa.Integer, nullable=False, server_default="0"),
)
processed = sa.Table(
    "test_processed", sa.MetaData(), sa.Column("task_id", sa.String(64), primary_key=True)
)


@pytest.fixture
def case_env(pg_store: Store, redis_url: str) -> Iterator[tuple[Store, str, Celery]]:
    effects.create(pg_store.engine)
    processed.create(pg_store.engine)
    redis_queue.flush(redis_url)
    app = Celery("case", broker=redis_url)
    yield pg_store, redis_url, app
    app.close()


def idempotent_task(store: Store, task_id: str, name: str) -> bool:
    """What an idempotent worker does with one delivery: effect once per task id."""
    from sqlalchemy.dialects.postgresql import insert

    with store.begin() as conn:
        first = conn.execute(insert(processed).values(task_id=task_id).on_conflict_do_nothing()
                             .returning(processed.c.task_id)).first()
        if first:
            conn.execute(sa.update(effects).where(effects.c.name == name)
                         .values(executions=effects.c.executions + 1))
        return first is not None


def test_case_a_publish_never_before_commit(case_env: tuple[Store, str, Celery]) -> None:
    store, redis_url, app = case_env
    r = Relay(store, handlers={"celery": CeleryHandler(app)}, settings=FAST, owner="relay-a")
    stop = threading.Event()
    relay_thread = threading.Thread(target=r.run_forever, args=(stop,), daemon=True)
    seen: list[tuple[float, str, bool]] = []  # (monotonic time, task id, row visible)

    def worker() -> None:  # "a worker polls continuously"
        import json

        import redis

        client = redis.Redis.from_url(redis_url)
        while not stop.is_set():
            item = client.brpop(["celery"], timeout=0.1)
            if item is None:
                continue
            msg = json.loads(item[1])
            with store.engine.connect() as conn:
                found = conn.execute(sa.select(effects).where(effects.c.name == "R1")).first()
            seen.append((time.monotonic(), msg["headers"]["id"], found is not None))
        client.close()

    worker_thread = threading.Thread(target=worker, daemon=True)
    relay_thread.start()
    worker_thread.start()
    try:
        with store.begin() as conn:  # t = 0
            conn.execute(effects.insert().values(name="R1"))
            outbox.add(conn, "celery", {"task": "apply", "kwargs": {"row": "R1"}}, key="effect:R1")
            time.sleep(0.5)
            assert seen == []
            commit_started = time.monotonic()
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)  # any duplicate publication would show up by now
    finally:
        stop.set()
        relay_thread.join(5)
        worker_thread.join(5)
    assert len(seen) == 1  # publications: 1
    at, _task_id, row_found = seen[0]
    assert at >= commit_started  # published_not_before_commit
    assert row_found  # task_finds_row
    assert rows(store)[0]["state"] == "sent"


def test_case_b_rollback_leaves_nothing(case_env: tuple[Store, str, Celery]) -> None:
    store, redis_url, app = case_env
    with store.begin() as conn:
        conn.execute(effects.insert().values(name="R2"))
    with pytest.raises(sa.exc.IntegrityError), store.begin() as conn:
        outbox.add(conn, "celery", {"task": "apply", "kwargs": {"row": "R2"}}, key="effect:R2b")
        conn.execute(effects.insert().values(name="R2"))  # unique-constraint error
    r = Relay(store, handlers={"celery": CeleryHandler(app)}, settings=FAST, owner="relay-b")
    assert r.run_once() == 0
    assert rows(store) == []  # outbox_rows_left: 0
    assert redis_queue.task_ids(redis_url) == []  # publications: 0


def _relay_process(
    store: Store, redis_url: str, tmp: Path, sleep_after: float
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=f"{WORKTREE}{os.pathsep}{APPS}",
               RB_TEST_REDIS_URL=redis_url, RELIABLE_BEAT_DATABASE_URL=store.url,
               RB_TEST_SLEEP_AFTER_DELIVER=str(sleep_after),
               RB_TEST_DELIVERED_FILE=str(tmp / "delivered.txt"))
    return subprocess.Popen(
        [sys.executable, "-m", "reliable_beat.cli", "-A", "outbox_app", "relay",
         "--claim-lease-seconds", "2", "--loglevel", "WARNING"],
        env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(tmp / "relay.log", "ab"),
    )


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_case_c_relay_killed_after_publish_before_mark_sent(
    case_env: tuple[Store, str, Celery], tmp_path: Path
) -> None:
    store, redis_url, _app = case_env
    with store.begin() as conn:
        conn.execute(effects.insert().values(name="R3"))
        outbox.add(conn, "celery", {"task": "apply", "kwargs": {"row": "R3"}}, key="effect:R3")
    delivered = tmp_path / "delivered.txt"
    proc = _relay_process(store, redis_url, tmp_path, sleep_after=60)
    try:
        wait_for(lambda: delivered.exists() and "effect:R3" in delivered.read_text(), 30,
                 "the broker to accept the message")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rows(store)[0]["state"] == "pending"  # published, never marked sent
    assert redis_queue.message_ids(redis_url) == ["effect:R3"]
    time.sleep(5)  # the relay restarts 5 s later
    proc = _relay_process(store, redis_url, tmp_path, sleep_after=0)
    try:
        wait_for(lambda: rows(store)[0]["state"] == "sent", 30, "the row to be marked sent")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    published = redis_queue.queued(redis_url)
    assert len(published) >= 1  # publications_at_least: 1 (2 here: before and after the kill)
    assert {m["headers"]["reliable_beat_message_id"] for m in published} == {"effect:R3"}
    assert len({m["headers"]["id"] for m in published}) == 1  # same task id every time
    for m in published:
        idempotent_task(store, m["headers"]["id"], "R3")
    with store.begin() as conn:
        assert conn.execute(sa.select(effects.c.executions)
                            .where(effects.c.name == "R3")).scalar_one() == 1
    assert rows(store)[0]["state"] == "sent"  # outbox_row_final_state


def test_expired_trigger_not_published(case_env: tuple[Store, str, Celery]) -> None:
    store, redis_url, app = case_env
    now = datetime.now(timezone.utc)
    with store.begin() as conn:
        run_id = conn.execute(
            runs.insert().values(idempotency_key="e@0", task="t", args=[], kwargs={},
                                 state="scheduled", created_at=now, updated_at=now)
            .returning(runs.c.id)
        ).scalar_one()
        outbox.add(conn, "celery", {"task": "t", "expires_at": "2000-01-01T00:00:00Z"},
                   key="trigger:e@0", run_id=run_id)
    Relay(store, handlers={"celery": CeleryHandler(app)}, settings=FAST).run_once()
    row = rows(store)[0]
    assert (row["state"], row["last_error"]) == ("sent", EXPIRED_ERROR)
    with store.begin() as conn:
        run = conn.execute(sa.select(runs)).one()
    assert (run.state, run.reason) == ("skipped", "expired")
    assert redis_queue.task_ids(redis_url) == []
