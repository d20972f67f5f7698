"""``signal()`` never waits on a running advance (PostgreSQL), and no wake-up is lost.

Real PostgreSQL connections racing: an advance paused inside one of its transactions (the
crash hook blocks the advancing thread there, as a SIGSTOP or a GC pause would), a row lock
held by another writer, a transaction ending the workflow. The real-process version (a
worker SIGSTOPped inside an advance) is tests/acceptance/test_workflow_signal_nowait.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, workflow_signals, workflows
from reliable_beat.workflows import WorkflowConflict, WorkflowContext, engine, workflow

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[None]:
    yield
    engine.crash_hook = None


def _signals(store: Store, wid: str) -> list[Any]:
    with store.connect() as conn:
        return list(conn.execute(
            sa.select(workflow_signals.c.id, workflow_signals.c.payload,
                      workflow_signals.c.consumed_seq)
            .join(workflows, workflows.c.id == workflow_signals.c.workflow_pk)
            .where(workflows.c.workflow_id == wid).order_by(workflow_signals.c.id)
        ).all())


def _pending_wakes(store: Store, wid: str) -> list[int]:
    with store.connect() as conn:
        return list(conn.execute(
            sa.select(outbox.c.id).where(outbox.c.state == "pending",
                                         outbox.c.message_id.startswith(f"wake:{wid}:"))
            .order_by(outbox.c.id)).scalars())


def _take_wake(store: Store, wid: str) -> bool:
    """Deliver one pending wake of ``wid`` (the relay's part): True if one was taken."""
    for oid in _pending_wakes(store, wid):
        with store.begin() as conn:
            taken = conn.execute(sa.update(outbox).where(outbox.c.id == oid,
                                                         outbox.c.state == "pending")
                                 .values(state="sent")).rowcount
        if taken == 1:
            return True
    return False


def _drive(store: Store, wid: str, owner: str = "drv", timeout: float = 30) -> str:
    """Deliver the wakes of ``wid`` one at a time until it ends or none is left."""
    deadline = time.monotonic() + timeout
    state = engine.get_workflow(store, wid)["state"]
    while state in engine.ACTIVE_STATES and time.monotonic() < deadline:
        if not _take_wake(store, wid):
            break
        engine.advance(store, wid, owner=owner)
        state = engine.get_workflow(store, wid)["state"]
    return str(state)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_signal_returns_at_once_while_an_advance_is_paused_inside_its_transaction(
        pg_store: Store) -> None:
    """The advance holds the workflow row (its record transaction's fence check) and is
    paused there: ``signal`` returns in well under a second (on the old code it waited
    ``lock_timeout``, 30 s, and raised LockNotAvailable). Resumed, the advance consumes
    the signal exactly once."""

    @workflow(name="nw.paused")
    def paused(ctx: WorkflowContext) -> Any:
        ctx.transaction(lambda conn: "done", name="work")
        return ctx.wait_signal("go")

    inside, resume = threading.Event(), threading.Event()

    def hook(name: str) -> None:
        if name == "record.transaction.in" and not inside.is_set():
            inside.set()
            assert resume.wait(60)

    engine.start(pg_store, "nw.paused", "p1")
    assert _take_wake(pg_store, "p1")
    engine.crash_hook = hook
    t, out = _in_thread(lambda: engine.advance(pg_store, "p1", owner="holder"))
    assert inside.wait(30)
    t0 = time.monotonic()
    assert engine.signal(pg_store, "p1", "go", {"n": 1}, key="go:1") is True
    took = time.monotonic() - t0
    print(f"signal() returned in {took * 1000:.0f} ms with the advance paused in its transaction")
    assert took < 1.0, f"signal took {took:.2f} s while an advance held the row"
    assert engine.signal(pg_store, "p1", "go", {"n": 1}, key="go:1") is False  # same key
    resume.set()
    t.join(60)
    assert "error" not in out, out
    assert _drive(pg_store, "p1") == "completed"
    row = engine.get_workflow(pg_store, "p1")
    assert row["result"] == {"n": 1}
    sigs = _signals(pg_store, "p1")
    assert [s.consumed_seq for s in sigs] == [2]


def test_busy_wake_makes_the_holder_read_a_signal_whose_bump_was_skipped(
        pg_store: Store) -> None:
    """The lost wake-up the ``wake_seq`` bump guards against, with the bump skipped: the
    holder read the inbox (nothing), a signal commits while another transaction holds the
    row (no bump, wake ``sig<id>``), and that wake's advance finds the holder's lease live
    before the holder releases. The busy advance bumps ``wake_seq`` itself, so the holder's
    release fails and its code runs again and consumes the signal; without that the
    workflow went to sleep with its signal unread and no wake left."""

    @workflow(name="nw.race")
    def race(ctx: WorkflowContext) -> Any:
        return ctx.wait_signal("go")

    engine.start(pg_store, "nw.race", "r1")
    busy: list[str] = []

    def hook(name: str) -> None:
        if name != "advance.before_release" or busy:
            return
        with pg_store.begin() as other:  # a writer holds the row while the signal is sent
            other.execute(sa.select(workflows.c.id).where(workflows.c.workflow_id == "r1")
                          .with_for_update(key_share=True))
            t0 = time.monotonic()
            assert engine.signal(pg_store, "r1", "go", "v", key="r1:go") is True
            assert time.monotonic() - t0 < 1.0
        with pg_store.connect() as conn:
            ids = list(conn.execute(sa.select(outbox.c.message_id).where(
                outbox.c.message_id.startswith("wake:r1:sig"))).scalars())
        assert len(ids) == 1, ids  # the bump was skipped
        assert _take_wake(pg_store, "r1")  # the signal's wake reaches a second worker now
        busy.append(engine.advance(pg_store, "r1", owner="second"))

    assert _take_wake(pg_store, "r1")
    engine.crash_hook = hook
    outcome = engine.advance(pg_store, "r1", owner="holder")
    engine.crash_hook = None
    assert busy == ["busy"]
    assert outcome == "completed", outcome
    assert engine.get_workflow(pg_store, "r1")["result"] == "v"
    assert [s.consumed_seq for s in _signals(pg_store, "r1")] == [1]


def test_sweep_wakes_a_workflow_whose_signal_wake_did_not_get_through(
        pg_store: Store) -> None:
    """A signal sent while another transaction held the row (bump skipped) whose wake's
    advance failed (a frozen holder's row lock timed it out): the workflow sits ``waiting``
    on ``wait_signal`` with ``wake_seq == claimed_wake_seq``. The re-dispatch sweep sees the
    unconsumed signal of the name it waits for and wakes it, once per window."""

    @workflow(name="nw.sweep")
    def sweep(ctx: WorkflowContext) -> Any:
        return ctx.wait_signal("go")

    engine.start(pg_store, "nw.sweep", "s1")
    assert _drive(pg_store, "s1") == "waiting"
    with pg_store.begin() as other:
        other.execute(sa.select(workflows.c.id).where(workflows.c.workflow_id == "s1")
                      .with_for_update(key_share=True))
        assert engine.signal(pg_store, "s1", "go", 7) is True
    assert _take_wake(pg_store, "s1")  # ... and its advance never ran
    row = engine.get_workflow(pg_store, "s1")
    assert row["state"] == "waiting" and row["wake_seq"] == row["claimed_wake_seq"]
    with pg_store.begin() as conn:  # an hour passes (rows aged, not the clock patched)
        hour = sa.text("interval '1 hour'")
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id == "s1")
                     .values(updated_at=workflows.c.updated_at - hour))
        conn.execute(sa.update(workflow_signals)
                     .values(created_at=workflow_signals.c.created_at - hour))
    window = timedelta(minutes=1)
    assert engine.redispatch_workflows(pg_store, older_than=window) == 1
    assert engine.redispatch_workflows(pg_store, older_than=window) == 0  # once per window
    assert _take_wake(pg_store, "s1")  # the broker lost that one too
    # `workflows resume` calls it overdue (a wait_signal whose signal sits unread): a wake
    assert engine.resume(pg_store, "s1")["state"] == "waiting"
    assert _drive(pg_store, "s1") == "completed"
    assert engine.get_workflow(pg_store, "s1")["result"] == 7


def test_a_signal_racing_the_end_is_refused_after_it(pg_store: Store) -> None:
    """A transaction ending the workflow holds its row FOR UPDATE (lock_for_end): a signal
    sent meanwhile waits for it, then reads the ended state and is refused; nothing is
    stored."""

    @workflow(name="nw.end")
    def end(ctx: WorkflowContext) -> Any:
        return ctx.wait_signal("go")

    engine.start(pg_store, "nw.end", "e1")
    assert _drive(pg_store, "e1") == "waiting"
    with pg_store.begin() as ending:
        pk = ending.execute(sa.select(workflows.c.id)
                            .where(workflows.c.workflow_id == "e1")).scalar_one()
        engine.lock_for_end(ending, pk)
        ending.execute(sa.update(workflows).where(workflows.c.id == pk)
                       .values(state="completed"))
        t, out = _in_thread(lambda: engine.signal(pg_store, "e1", "go", 1))
        time.sleep(0.5)
        assert t.is_alive(), out  # it waits for the end to commit or roll back
    t.join(30)
    assert isinstance(out.get("error"), WorkflowConflict), out
    assert _signals(pg_store, "e1") == []


def test_an_end_racing_a_signal_waits_for_it(pg_store: Store) -> None:
    """A signal inside the caller's open transaction holds the row FOR KEY SHARE: a
    transaction ending the workflow waits until the caller commits, so the signal was
    stored while the workflow ran (never on an ended one)."""

    @workflow(name="nw.end2")
    def end2(ctx: WorkflowContext) -> Any:
        return ctx.wait_signal("go")

    engine.start(pg_store, "nw.end2", "e2")
    assert _drive(pg_store, "e2") == "waiting"
    with pg_store.begin() as caller:
        assert engine.signal(caller, "e2", "go", 1) is True

        def end_it() -> None:
            with pg_store.begin() as ending:
                pk = ending.execute(sa.select(workflows.c.id)
                                    .where(workflows.c.workflow_id == "e2")).scalar_one()
                engine.lock_for_end(ending, pk)
                ending.execute(sa.update(workflows).where(workflows.c.id == pk)
                               .values(state="completed"))

        t, out = _in_thread(end_it)
        time.sleep(0.5)
        assert t.is_alive(), out
        committed = time.monotonic()
    t.join(30)
    assert "error" not in out, out
    assert out["at"] >= committed
    assert len(_signals(pg_store, "e2")) == 1


@pytest.mark.parametrize("round_no", range(3))
def test_many_senders_while_the_workflow_loops_waiting(server_store: Store,
                                                       round_no: int) -> None:
    """4 threads send 15 signals each (60) while 3 worker threads deliver wakes and run
    advances of a workflow that waits for them one by one: every signal is consumed
    exactly once, oldest first, and no wake-up is lost (no sweep runs here). PostgreSQL
    (bumps skipped while an advance holds the row) and MariaDB (``-m mariadb``)."""
    senders, per_sender, workers = 4, 15, 3
    total = senders * per_sender
    name = f"nw.loop{round_no}"

    def hold(conn: sa.Connection) -> None:
        time.sleep(0.005)  # inside the record transaction: the row is locked meanwhile

    @workflow(name=name)
    def loop(ctx: WorkflowContext, n: int) -> Any:
        got = []
        for _ in range(n):
            got.append(ctx.wait_signal("tick"))
            ctx.transaction(hold, name="hold")
        return got

    wid = f"loop{round_no}"
    engine.start(server_store, name, wid, [total])
    stop = threading.Event()
    errors: list[BaseException] = []
    slow: list[float] = []

    def send(s: int) -> None:
        try:
            for i in range(per_sender):
                t0 = time.monotonic()
                engine.signal(server_store, wid, "tick", [s, i], key=f"{wid}:{s}:{i}")
                slow.append(time.monotonic() - t0)
                time.sleep(0.002 * (s + 1))
        except BaseException as exc:
            errors.append(exc)

    def work(w: int) -> None:
        try:
            while not stop.is_set():
                if _take_wake(server_store, wid):
                    engine.advance(server_store, wid, owner=f"w{w}",
                                   lease=timedelta(seconds=30))
                else:
                    time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
    threads += [threading.Thread(target=send, args=(s,), daemon=True) for s in range(senders)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not errors:
        if engine.get_workflow(server_store, wid)["state"] == "completed":
            break
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    row = engine.get_workflow(server_store, wid)
    sigs = _signals(server_store, wid)
    assert row["state"] == "completed", (row, [s.consumed_seq for s in sigs])
    assert len(sigs) == total
    # each signal consumed once, by one wait; each sender's signals in the order it sent
    # them. Signals of concurrent senders come in the order their transactions commit, which
    # on PostgreSQL (no workflow row lock taken: the point of signal()) need not be the order
    # of their ids: [2, 0] (id 3) can commit and be consumed before [0, 0] (id 1)
    got = row["result"]
    assert sorted(map(tuple, got)) == sorted(tuple(s.payload) for s in sigs)
    for sender in range(senders):
        assert [i for s, i in got if s == sender] == list(range(per_sender)), got
    assert sorted(s.consumed_seq for s in sigs) == list(range(1, 2 * total, 2))
    print(f"round {round_no}: {total} signals, slowest signal() {max(slow) * 1000:.0f} ms")


def test_a_terminate_waits_for_a_signal_in_flight_then_signals_are_refused(
        pg_store: Store) -> None:
    """``workflows cancel --no-compensate`` ends the workflow in one transaction: it takes
    the row FOR UPDATE first, so it waits for a signal the caller has not committed yet
    (stored while the workflow ran); a signal after it is refused."""
    from reliable_beat.workflows import cancel

    @workflow(name="nw.term")
    def term(ctx: WorkflowContext) -> Any:
        return ctx.wait_signal("go")

    engine.start(pg_store, "nw.term", "t1")
    assert _drive(pg_store, "t1") == "waiting"
    with pg_store.begin() as caller:
        assert engine.signal(caller, "t1", "other", 1) is True
        t, out = _in_thread(lambda: cancel(pg_store, "t1", compensate=False))
        time.sleep(0.5)
        assert t.is_alive(), out
        committed = time.monotonic()
    t.join(30)
    assert out["value"]["changed"] is True and out["at"] >= committed, out
    with pytest.raises(WorkflowConflict):
        engine.signal(pg_store, "t1", "go", 2)
    assert [s.payload for s in _signals(pg_store, "t1")] == [1]
