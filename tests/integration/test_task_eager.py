"""IdempotentTask in-process (Celery ``apply``) on a real store: keys, transaction modes,
lease renewal, outbox keys, failure classification. The real-worker proofs live in
``tests/acceptance/test_idempotent_task.py``.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask, _header
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError, IdempotencyKeyError

effects = sa.Table(
    "eager_effects", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200)), sa.Column("run_id", sa.Integer),
)


@pytest.fixture
def app(store: Store) -> Iterator[Celery]:
    effects.create(store.engine)
    app = Celery("eager", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False),
        reliable_beat_lease_seconds=0.6,
        reliable_beat_retry_max_attempts=3,
        reliable_beat_retry_base_seconds=0.01,
        reliable_beat_retry_cap_seconds=0.05,
    )
    yield app


def n_effects(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one())


def test_body_without_transaction_records_result_fenced(app: Celery, store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.plain")
    def plain(self: IdempotentTask, x: int) -> dict[str, int]:
        return {"x": x, "fence": self.fence_token}

    assert plain.apply((5,), headers={KEY_HEADER: "p:5"}).get() == {"x": 5, "fence": 1}
    assert plain.apply((6,), headers={KEY_HEADER: "p:5"}).get() == {"x": 5, "fence": 1}
    run = runs.get_run(store, "p:5")
    assert run["state"] == "succeeded" and run["result"] == {"x": 5, "fence": 1}


def test_transaction_commits_effect_and_key_together(app: Celery, store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.tx")
    def tx_task(self: IdempotentTask, fail_inside: bool) -> str:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key, run_id=self.run_id))
            if fail_inside:
                raise ValueError("invalid input")  # permanent by default
        return "done"

    r = tx_task.apply((True,), headers={KEY_HEADER: "tx:1"})
    assert isinstance(r.result, ValueError)
    assert n_effects(store) == 0 and runs.get_run(store, "tx:1")["state"] == "dead"
    assert tx_task.apply((False,), headers={KEY_HEADER: "tx:2"}).get() == "done"
    assert n_effects(store) == 1
    assert runs.get_run(store, "tx:2")["result"] == "done"


def test_own_engine_and_session(app: Celery, store: Store) -> None:
    engine = sa.create_engine(store.engine.url)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.own")
    def own(self: IdempotentTask, mode: str) -> None:
        if mode == "engine":
            with self.transaction(bind=engine) as tx:
                tx.execute(effects.insert().values(key=self.idempotency_key))
        else:
            with Session(engine) as session, self.transaction(session=session) as tx:
                session.execute(effects.insert().values(key=self.idempotency_key))
                assert tx is session.connection()

    own.apply(("engine",), headers={KEY_HEADER: "own:e"}).get()
    own.apply(("session",), headers={KEY_HEADER: "own:s"}).get()
    assert n_effects(store) == 2
    assert runs.get_run(store, "own:e")["state"] == "succeeded"
    assert runs.get_run(store, "own:s")["state"] == "succeeded"
    engine.dispose()


def test_own_engine_on_another_database_is_refused(
    app: Celery, store: Store, tmp_path: Path
) -> None:
    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.sqlite3'}")

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.other")
    def other_db(self: IdempotentTask) -> None:
        with self.transaction(bind=other):
            pass

    r = other_db.apply(headers={KEY_HEADER: "o:1"})
    assert isinstance(r.result, ConfigurationError)
    other.dispose()


def test_keys_never_invented(app: Celery, store: Store) -> None:
    ran: list[str] = []

    class Keyed(IdempotentTask):
        def idempotency_key_for(self, customer: str, month: str) -> str | None:
            return f"invoice:{customer}:{month}" if customer else None

    @app.task(shared=False, base=Keyed, bind=True, name="e.keyed")
    def keyed(self: IdempotentTask, customer: str, month: str) -> None:
        ran.append(self.idempotency_key)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.unkeyed")
    def unkeyed(self: IdempotentTask) -> None:
        ran.append("unkeyed")

    keyed.apply(("c1", "2026-01")).get()
    assert ran == ["invoice:c1:2026-01"]
    with pytest.raises(IdempotencyKeyError):
        unkeyed.apply_async()
    with pytest.raises(IdempotencyKeyError):
        keyed.delay("", "2026-01")
    # A slot's key form is reserved: an ad-hoc run under it would take that slot's place.
    with pytest.raises(IdempotencyKeyError, match="reserved"):
        unkeyed.delay_with_key("tick@2026-11-29T14:15:38Z")
    with pytest.raises(IdempotencyKeyError, match="reserved"):
        unkeyed.apply_async(headers={KEY_HEADER: "tick@2026-11-29T14:15:38.250000Z"})
    r = unkeyed.apply()  # a message without a key reaching a worker: refused, not run
    assert isinstance(r.result, IdempotencyKeyError) and "unkeyed" not in ran
    assert runs.list_runs(store) != [] and len(runs.list_runs(store)) == 1


def test_header_read_from_request_headers_or_attributes() -> None:
    as_headers = types.SimpleNamespace(headers={KEY_HEADER: "a"})
    as_attribute = types.SimpleNamespace(headers=None, reliable_beat_key="b")
    assert _header(as_headers, KEY_HEADER) == "a"
    assert _header(as_attribute, KEY_HEADER) == "b"
    assert _header(types.SimpleNamespace(), KEY_HEADER) is None


def test_lease_is_renewed_while_the_body_runs(app: Celery, store: Store) -> None:
    seen: dict[str, Any] = {}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.slow")
    def slow(self: IdempotentTask) -> None:
        time.sleep(1.5)  # 2.5 leases of 0.6 s: only renewals keep it alive
        expires = runs.get_run(store, self.idempotency_key)["lease_expires_at"]
        with store.engine.connect() as conn:
            seen["alive"] = expires > store.now(conn)
        seen["lost"] = self.lease_lost

    slow.apply(headers={KEY_HEADER: "slow:1"}).get()
    assert seen == {"alive": True, "lost": False}
    assert runs.get_run(store, "slow:1")["state"] == "succeeded"


def test_lease_lost_flag(app: Celery, store: Store) -> None:
    seen: dict[str, Any] = {}

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.lost")
    def lost(self: IdempotentTask) -> None:
        runs.clear_lease(store, self.idempotency_key)  # a person frees the lease
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not self.lease_lost:
            time.sleep(0.02)
        seen["lost"] = self.lease_lost

    r = lost.apply(headers={KEY_HEADER: "lost:1"})
    assert seen["lost"] is True
    assert r.failed()  # the fenced completion was rejected
    assert [a["outcome"] for a in runs.list_attempts(store, runs.get_run(store, "lost:1")["id"])
            ] == ["fenced_out"]


def test_one_renewer_thread_serves_concurrent_executions(app: Celery, store: Store) -> None:
    """Two bodies in flight at once (two threads), each outliving 2.5 leases: both stay
    leased, renewed by the process's one renewer thread, and no thread is started per task."""
    seen: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.slow2")
    def slow2(self: IdempotentTask, name: str) -> None:
        barrier.wait(timeout=10)
        time.sleep(1.5)  # 2.5 leases of 0.6 s
        expires = runs.get_run(store, self.idempotency_key)["lease_expires_at"]
        with store.engine.connect() as conn:
            seen[name] = (expires > store.now(conn), self.lease_lost)
        seen[f"{name}-threads"] = [t.name for t in threading.enumerate()
                                   if t.name.startswith("rb-lease")]

    # Create and bind the tasks here, as a worker does at start. ``@app.task`` on an app not
    # finalized returns a lazy proxy; Celery evaluates it unlocked and registers the task
    # before binding it, so a second thread evaluating it at once can get the task unbound
    # (``request_stack`` None: AttributeError in build_tracer). That thread died before its
    # claim and the other one's barrier broke after 10 s (seen 1 in 12 runs).
    app.finalize()
    callers = [threading.Thread(target=lambda n=n: slow2.apply((n,), headers={
        KEY_HEADER: f"slow2:{n}"}).get()) for n in ("a", "b")]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=30)
    assert seen["a"] == seen["b"] == (True, False)
    assert seen["a-threads"] == seen["b-threads"] == ["rb-lease-renewer"]
    for n in ("a", "b"):
        assert runs.get_run(store, f"slow2:{n}")["state"] == "succeeded"


def test_outbox_keys_count_per_attempt(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``self.outbox.add`` forwards to reliable_beat.outbox.add (stubbed here)."""
    calls: list[dict[str, Any]] = []
    fake = types.ModuleType("reliable_beat.outbox")

    def add(conn: Any, destination: str, payload: Any, **kw: Any) -> str:
        calls.append({"destination": destination, "payload": payload, **kw})
        return str(kw["key"])

    fake.add = add  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "reliable_beat.outbox", fake)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.outbox")
    def sends(self: IdempotentTask) -> None:
        with self.transaction() as tx:
            self.outbox.add(tx, "email", {"n": 1})
            self.outbox.add(tx, "email", {"n": 2}, ordering_key="c1")
            self.outbox.add(tx, "hook", {"n": 3}, key="explicit")
            if self.attempt == 1:
                raise ConnectionError("flaky")

    sends.apply(headers={KEY_HEADER: "ob:1"}).get()
    run_id = runs.get_run(store, "ob:1")["id"]
    keys = [c["key"] for c in calls]
    assert keys == ["ob:1#1", "ob:1#2", "explicit"] * 2  # the retry collapses onto the same
    assert all(c["run_id"] == run_id for c in calls)
    assert calls[1]["ordering_key"] == "c1"


def test_outbox_rows_commit_with_the_effect_real_outbox(app: Celery, store: Store) -> None:
    """With the real reliable_beat.outbox: rolled back with a failed try, one row per add."""
    from reliable_beat.db.tables import outbox

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.real_outbox")
    def sends(self: IdempotentTask) -> None:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key, run_id=self.run_id))
            self.outbox.add(tx, "celery", {"task": "x", "args": [1]}, delay=0.5)
            self.outbox.add(tx, "celery", {"task": "x", "args": [2]})
            if self.attempt == 1:
                raise ConnectionError("flaky")

    sends.apply(headers={KEY_HEADER: "real:1"}).get()
    sends.apply(headers={KEY_HEADER: "real:1"}).get()  # replay: deduplicated
    run_id = runs.get_run(store, "real:1")["id"]
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(outbox.c.message_id, outbox.c.run_id)
                            .order_by(outbox.c.id)).all()
    assert [tuple(r) for r in rows] == [("real:1#1", run_id), ("real:1#2", run_id)]
    assert n_effects(store) == 1


def test_state_survives_a_fresh_request_context(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery < 5.7 pushes a request context without the outer one's attributes."""
    from celery.app.task import Context, Task

    def old_push_request(self: Any, *args: Any, **kwargs: Any) -> None:
        self.request_stack.push(Context(*args, **kwargs))

    monkeypatch.setattr(Task, "push_request", old_push_request)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.old_celery")
    def old(self: IdempotentTask) -> list[Any]:
        return [self.idempotency_key, self.fence_token, self.attempt]

    assert old.apply(headers={KEY_HEADER: "old:1"}).get() == ["old:1", 1, 1]


def test_retry_that_cannot_be_sent_stays_retrying_for_the_redispatch_sweep(
    app: Celery, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kombu.exceptions import OperationalError as BrokerDown

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.unsent")
    def unsent(self: IdempotentTask) -> None:
        raise TimeoutError("upstream slow")

    def broken_retry(*args: Any, **kwargs: Any) -> None:
        raise BrokerDown("broker unreachable")

    monkeypatch.setattr(unsent, "retry", broken_retry)
    r = unsent.apply(headers={KEY_HEADER: "unsent:1"})
    assert isinstance(r.result, TimeoutError)
    run = runs.get_run(store, "unsent:1")
    assert run["state"] == "retrying"  # not dead: a broker blip must not need a person
    assert runs.list_dead_letters(store) == []
    from datetime import timedelta

    from reliable_beat.redispatch import claim_stuck_runs

    with store.begin() as conn:
        later = store.now(conn) + timedelta(hours=1)
        # Ad-hoc run: no trigger row, so the sweep rebuilds its message from the run row
        # and re-sends it (a retrying run is never left with nothing to move it on)
        found = claim_stuck_runs(store, conn, now=later, after=timedelta(seconds=60),
                                 tasks=["e.unsent"], retrying_after=timedelta(seconds=60))
    assert len(found) == 1, found
    payload = found[0].payload
    assert payload["task"] == "e.unsent"
    assert payload["headers"]["reliable_beat_key"] == "unsent:1"


def test_eager_call_on_a_leased_run_raises_lease_held(app: Celery, store: Store) -> None:
    from datetime import timedelta

    from reliable_beat.errors import LeaseHeldError

    @app.task(shared=False, base=IdempotentTask, bind=True, name="e.leased")
    def leased(self: IdempotentTask) -> None: ...

    runs.claim_run(store, "leased:1", owner="elsewhere", lease=timedelta(seconds=60), task="x")
    r = leased.apply(headers={KEY_HEADER: "leased:1"})
    assert isinstance(r.result, LeaseHeldError)
    rows = runs.list_attempts(store, runs.get_run(store, "leased:1")["id"])
    assert [a["outcome"] for a in rows] == ["running", "busy"]
