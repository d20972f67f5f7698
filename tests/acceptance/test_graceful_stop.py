"""A graceful stop (SIGTERM) of a real ``celery beat`` holding a claimed-ahead trigger.

With ``reliable_beat_claim_ahead_seconds`` > 0 a beat claims a slot shortly before its
instant, commits its run and trigger row, and holds the trigger in memory to publish it
exactly at the slot. A SIGTERM that lands while it holds one must not leave the row to the
sweep (slot + 10 s): the beat publishes it at its slot, then exits 0; a second beat running
meanwhile never publishes it again. Two moments of the stop, real processes, real
PostgreSQL + Redis (or RabbitMQ with ``--broker rabbitmq``):

* ``waiting``: the beat holds the slot and waits for its instant (SIGTERM 100-500 ms before
  it, the default 0.5 s claim-ahead);
* ``just_claimed``: the SIGTERM lands right after the claim's commit, before the loop holds
  the triggers (the return from the claim is slowed to 1 s by ``RB_PAUSE_AFTER_CLAIM_AHEAD``,
  as on a loaded host). Before the fix Celery's stop handler ran there, inside the section
  that should have held it back (a per-thread signal mask, while the kernel delivered the
  signal to the beat's retention thread), and the rows waited for the sweep.

Each prints its figures (lateness of the held slots, exit delay) for the closing note.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from reliable_beat.db.tables import outbox, runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import procs as procs_mod  # tests/apps
import test_beats as tb  # tests/acceptance: its harness and fixtures
from test_beats import SECOND, Harness, Recorder, check_window, owner_of, stop_all, wait_running

h = tb.h  # fixtures: a PostgreSQL store, a broker queue of the test's own, the beat processes
procs = tb.procs

#: Published by the holder at the slot: well under the sweep delay (10 s) a swept row shows.
AT_SLOT_TOLERANCE = 1.0
#: Wait this long past the last held slot for a sweep that would publish it a second time.
SWEEP_WAIT = 13 * SECOND


def _wait_held_sent(h: Harness, held: dict[str, datetime]) -> None:
    """Wait until no held trigger row is pending: the holder marked it sent before exiting,
    or (what the checks then fail) the other beat's sweep published it after its slot + 10 s
    sweep delay. A sent row is never published again, so no further message of a held slot
    can come; the holder has exited. At most the last held slot + 3 x SWEEP_WAIT."""
    keys = {"trigger:" + k for k in held}
    last = max(held.values())
    procs_mod.wait_for(lambda: not [o for o in h.outbox() if o.message_id in keys
                                    and o.state == "pending"]
                       or h.now() > last + 3 * SWEEP_WAIT, 60 + 3 * SWEEP_WAIT.total_seconds(),
                       "the held triggers to be sent")


def _held_by(h: Harness, owner: str, after: datetime, before: datetime) -> list[tuple[str,
                                                                                      datetime]]:
    """(key, slot) of trigger rows pending under ``owner`` whose slot is in (after, before]."""
    with h.store.engine.connect() as conn:
        rows = conn.execute(
            select(runs.c.idempotency_key, runs.c.fire_at)
            .join(outbox, outbox.c.run_id == runs.c.id)
            .where(outbox.c.state == "pending", outbox.c.claimed_by == owner,
                   runs.c.fire_at > after, runs.c.fire_at <= before))
        return [(r.idempotency_key, r.fire_at) for r in rows]


#: ``waiting`` is marked ``full``: CI covers its kind with
#: ``test_beats.py::test_sigterm_while_holding_publishes_at_the_slots_then_exits`` (a SIGTERM
#: while the beat waits for held slots); ``just_claimed`` (the fixed bug) runs in CI.
MOMENTS = [pytest.param("waiting", marks=pytest.mark.full), "just_claimed"]


@pytest.mark.parametrize("moment", MOMENTS)
def test_sigterm_while_holding_a_trigger_publishes_it_at_its_slot_once(
        h: Harness, tmp_path: Path, moment: str) -> None:
    spec = {f"e{i}": {"cron": "* * * * * */1", "reliable_beat": {"misfire_policy": "catch_up"}}
            for i in range(3)}
    h.schedule(spec)
    rec = Recorder(h)
    flag = tmp_path / "pause-after-claim-ahead"
    if moment == "waiting":
        holder = h.procs.start("holder")  # the default claim-ahead (0.5 s)
        other = h.procs.start("other")
    else:
        holder = h.procs.start("holder", RB_CLAIM_AHEAD="2", RB_PAUSE_SECONDS="1",
                               RB_PAUSE_AFTER_CLAIM_AHEAD=str(flag))
        other = h.procs.start("other", RB_CLAIM_AHEAD="2")
    t0 = wait_running(h, len(spec)) + 2 * SECOND
    procs_mod.wait_for(lambda: h.now() > t0, 30, "both beats up")
    owner = owner_of(holder)

    if moment == "waiting":
        def holding() -> list[tuple[str, datetime]]:
            now = h.now()
            return _held_by(h, owner, now + timedelta(milliseconds=100),
                            now + timedelta(milliseconds=500))
        procs_mod.wait_for(holding, 60, "the holder to hold a slot 100-500 ms ahead",
                           interval=0.01)
        asked = h.now()
        os.kill(holder.pid, signal.SIGTERM)
    else:
        flag.touch()
        line = procs_mod.wait_for(
            lambda: re.search(r"PAUSED after claiming ahead (.+)", holder.output()), 60,
            "the holder to claim ahead", interval=0.01)
        asked = h.now()
        os.kill(holder.pid, signal.SIGTERM)  # during the pause: the claim just committed
        print(f"\n[{moment}] SIGTERM right after the claim of {line.group(1)}")
    try:
        holder.proc.wait(timeout=30)
    except Exception:
        pytest.fail(f"holder still running 30 s after SIGTERM\n{h.logs()}")
    exited = h.now()
    assert holder.proc.returncode == 0, holder.output()[-3000:]
    assert other.alive(), other.output()[-3000:]

    # read before any sweep could take them (slot + 10 s): claimed by the holder, whatever
    # their state (sent by it, or left pending for the sweep)
    held = dict(_claimed_by(h, owner, asked))
    assert held, f"the holder held nothing at the SIGTERM\n{h.logs()}"
    last = max(held.values())
    # a held row left pending is swept by the other beat (slot + 10 s): wait until every
    # held row is sent, by the holder (at once) or by that sweep (the checks below fail it)
    _wait_held_sent(h, held)
    t1 = h.now() - 2 * SECOND
    procs_mod.wait_for(lambda: not [o for o in h.outbox() if o.state == "pending"
                                    and o.created_at <= t1], 20, "publishes")
    stop_all(h)
    rec.stop()

    late = rec.lateness()
    seen = Counter(k for k, _, _ in rec.stamps)
    ob = {o.message_id: o for o in h.outbox()}
    figures = {k: (round(late[k] * 1000, 1) if k in late else None) for k in sorted(held)}
    print(f"[{moment}] {len(held)} held trigger(s) at the SIGTERM, lateness ms {figures}; "
          f"exit {(exited - asked).total_seconds():.2f} s after the SIGTERM")
    for key, slot in held.items():
        row = ob["trigger:" + key]
        assert key in late, f"{key}: never published\n{h.logs()}"
        assert seen[key] == 1, f"{key}: published {seen[key]} times"
        assert row.state == "sent" and row.claimed_by == owner, (
            f"{key}: {row.state} by {row.claimed_by}: the holder left it to the sweep")
        assert 0 <= late[key] < AT_SLOT_TOLERANCE, (
            f"{key} published {late[key]:.3f} s after its slot {slot:%H:%M:%S.%f}\n{h.logs()}")
    assert exited >= last, "exited before its held slots"
    assert rec.early() == [], rec.early()[:10]
    check_window(h, sorted(spec), t0, t1, f"SIGTERM while holding ({moment})")


# -- `celery worker -B`: the beat embedded in the worker, in a child process ----------------
#: Where the SIGTERM goes: the worker's pid (``kill PID``, ``docker stop``: the worker then
#: stops its beat child with a SIGTERM of its own) or the whole process group (systemd's
#: default ``KillMode=control-group``, a terminal's Ctrl-C: the beat child gets it directly
#: too, besides the worker's).
EMBEDDED = [pytest.param("waiting", "worker", marks=pytest.mark.full),
            ("just_claimed", "worker"), ("waiting", "group")]


def _embedded_owner(h: Harness, others: set[str]) -> str:
    """The owner id (``host:pid`` of the beat child process) of the one beat not in
    ``others`` that has claimed trigger rows."""
    def owners() -> set[str]:
        with h.store.engine.connect() as conn:
            found = set(conn.execute(select(outbox.c.claimed_by).distinct()).scalars())
        return {o for o in found if o and o not in others}
    found = procs_mod.wait_for(owners, 60, "the embedded beat to claim")
    assert len(found) == 1, found
    return str(found.pop())


@pytest.mark.parametrize(("moment", "target"), EMBEDDED)
def test_worker_dash_b_sigterm_while_holding_publishes_at_its_slot_once(
        h: Harness, tmp_path: Path, moment: str, target: str) -> None:
    """``celery worker -B``: Celery runs the beat in a child process (billiard), whose
    SIGTERM handler raises ``SystemExit``; the beat service's ``finally`` closes the
    scheduler, i.e. :meth:`BeatLoop.close`, which publishes the held slots at their instants.
    Same two moments as the ``celery beat`` test, a second (``celery beat``) beat running; the
    held rows are published once, by the embedded beat, at their slot, and the worker exits
    0 after them."""
    spec = {f"e{i}": {"cron": "* * * * * */1", "reliable_beat": {"misfire_policy": "catch_up"}}
            for i in range(3)}
    h.schedule(spec)
    rec = Recorder(h)
    flag = tmp_path / "pause-after-claim-ahead"
    env = ({} if moment == "waiting" else
           {"RB_CLAIM_AHEAD": "2", "RB_PAUSE_SECONDS": "1",
            "RB_PAUSE_AFTER_CLAIM_AHEAD": str(flag)})
    holder = h.procs.start("holder", command=[
        "worker", "-B", "-l", "info", "-Q", f"{h.queue}-work", "-c", "1", "-P", "solo",
        "-n", f"holder-{os.getpid()}@%h", "-s", str(tmp_path / "holder-schedule"),
        "--without-mingle", "--without-gossip"], **env)
    env.pop("RB_PAUSE_AFTER_CLAIM_AHEAD", None)
    other = h.procs.start("other", **env)
    child: int | None = None
    try:
        t0 = wait_running(h, len(spec)) + 2 * SECOND
        procs_mod.wait_for(lambda: h.now() > t0, 30, "both beats up")
        owner = _embedded_owner(h, {owner_of(other)})
        child = int(owner.rpartition(":")[2])
        assert child != holder.pid  # the beat runs in the worker's child process

        if moment == "waiting":
            def holding() -> list[tuple[str, datetime]]:
                now = h.now()
                return _held_by(h, owner, now + timedelta(milliseconds=100),
                                now + timedelta(milliseconds=500))
            procs_mod.wait_for(holding, 60, "the embedded beat to hold a slot 100-500 ms "
                               "ahead", interval=0.01)
        else:
            flag.touch()
            procs_mod.wait_for(lambda: "PAUSED after claiming ahead" in holder.output(), 60,
                               "the embedded beat to claim ahead", interval=0.01)
        asked = h.now()
        if target == "worker":
            os.kill(holder.pid, signal.SIGTERM)
        else:
            os.killpg(os.getpgid(holder.pid), signal.SIGTERM)
        try:
            holder.proc.wait(timeout=30)
        except Exception:
            pytest.fail(f"worker -B still running 30 s after SIGTERM\n{h.logs()}")
        procs_mod.wait_for(lambda: not _alive(child), 30, "the beat child to exit")
        exited = h.now()
        assert holder.proc.returncode == 0, holder.output()[-3000:]
        assert other.alive(), other.output()[-3000:]

        held = dict(_claimed_by(h, owner, asked))
        assert held, f"the embedded beat held nothing at the SIGTERM\n{h.logs()}"
        last = max(held.values())
        _wait_held_sent(h, held)
        t1 = h.now() - 2 * SECOND
        procs_mod.wait_for(lambda: not [o for o in h.outbox() if o.state == "pending"
                                        and o.created_at <= t1], 20, "publishes")
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    stop_all(h)
    rec.stop()

    late = rec.lateness()
    seen = Counter(k for k, _, _ in rec.stamps)
    ob = {o.message_id: o for o in h.outbox()}
    figures = {k: (round(late[k] * 1000, 1) if k in late else None) for k in sorted(held)}
    print(f"\n[worker -B {moment}, SIGTERM to the {target}] {len(held)} held trigger(s), "
          f"lateness ms {figures}; exit {(exited - asked).total_seconds():.2f} s after the "
          f"SIGTERM, {(exited - last).total_seconds():.2f} s after the last held slot")
    for key, slot in held.items():
        row = ob["trigger:" + key]
        assert key in late, f"{key}: never published\n{h.logs()}"
        assert seen[key] == 1, f"{key}: published {seen[key]} times"
        assert row.state == "sent" and row.claimed_by == owner, (
            f"{key}: {row.state} by {row.claimed_by}: the embedded beat left it to the sweep"
            f"\n{h.logs()}")
        assert 0 <= late[key] < AT_SLOT_TOLERANCE, (
            f"{key} published {late[key]:.3f} s after its slot {slot:%H:%M:%S.%f}\n{h.logs()}")
    assert rec.early() == [], rec.early()[:10]
    check_window(h, sorted(spec), t0, t1, f"worker -B SIGTERM while holding ({moment})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone for our purpose
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _claimed_by(h: Harness, owner: str, after: datetime) -> list[tuple[str, datetime]]:
    """(key, slot) of every trigger row claimed by ``owner`` whose slot is after ``after``
    (whatever its state now): the triggers the holder held at the SIGTERM."""
    with h.store.engine.connect() as conn:
        rows = conn.execute(
            select(runs.c.idempotency_key, runs.c.fire_at)
            .join(outbox, outbox.c.run_id == runs.c.id)
            .where(outbox.c.claimed_by == owner, runs.c.fire_at > after))
        return [(r.idempotency_key, r.fire_at) for r in rows]


# -- the Dramatiq beat: the same loop, its own stop handler (a flag, then close()) ---------
@pytest.fixture
def dq(pg_url: str, broker_url: str, pg_store: Any, tmp_path: Path) -> Iterator[Any]:
    """The Dramatiq harness of tests/acceptance/test_dramatiq_adapter.py (skipped without
    dramatiq)."""
    pytest.importorskip("dramatiq")
    import test_dramatiq_adapter as tda
    from dq_app import meta

    meta.create_all(pg_store.engine)
    env = tda.DqEnv(pg_url, broker_url, pg_store, tmp_path)
    try:
        yield env
    finally:
        env.kill_all()


@pytest.mark.parametrize("moment", MOMENTS)
def test_dramatiq_beat_sigterm_while_holding_publishes_at_its_slot_once(
        dq: Any, tmp_path: Path, moment: str) -> None:
    """``reliable-beat dramatiq beat``: its SIGTERM handler only sets the stop flag; the loop
    finishes its round and :meth:`BeatLoop.close` publishes the held slots at their instants.
    Same two moments as above, a second beat running; the held rows are ``sent`` by the
    holder at their slot (``sent_at``, database clock), well before any sweep."""
    dq.extra["RB_PERIOD"] = "1"
    flag = tmp_path / "pause-after-claim-ahead"
    if moment == "just_claimed":
        dq.extra.update(RB_CLAIM_AHEAD="2", RB_PAUSE_SECONDS="1",
                        RB_PAUSE_AFTER_CLAIM_AHEAD=str(flag))
    holder = dq.beat("holder")
    dq.extra.pop("RB_PAUSE_AFTER_CLAIM_AHEAD", None)
    other = dq.beat("other")
    owner = f"{socket.gethostname()}:{holder.pid}"

    def now() -> datetime:
        with dq.store.begin() as conn:
            return dq.store.now(conn)  # type: ignore[no-any-return]

    dq.wait("both beats to fire", lambda: len(dq.rows(select(runs.c.id))) >= 4, 120)
    if moment == "waiting":
        def holding() -> list[Any]:
            t = now()
            return dq.rows(select(runs.c.id).join(outbox, outbox.c.run_id == runs.c.id).where(
                outbox.c.state == "pending", outbox.c.claimed_by == owner,
                runs.c.fire_at > t + timedelta(milliseconds=100),
                runs.c.fire_at <= t + timedelta(milliseconds=500)))
        procs_mod.wait_for(holding, 60, "the holder to hold a slot 100-500 ms ahead",
                           interval=0.01)
    else:
        flag.touch()
        procs_mod.wait_for(lambda: "PAUSED after claiming ahead" in dq.logs(), 60,
                           "the holder to claim ahead", interval=0.01)
    asked = now()
    os.kill(holder.pid, signal.SIGTERM)
    try:
        holder.wait(timeout=30)
    except Exception:
        pytest.fail(f"holder still running 30 s after SIGTERM\n{dq.logs()}")
    exited = now()
    assert holder.returncode == 0, dq.logs()
    assert other.poll() is None, dq.logs()
    held = dq.rows(select(runs.c.idempotency_key, runs.c.fire_at, outbox.c.state,
                          outbox.c.sent_at)
                   .join(outbox, outbox.c.run_id == runs.c.id)
                   .where(outbox.c.claimed_by == owner, runs.c.fire_at > asked))
    assert held, f"the holder held nothing at the SIGTERM\n{dq.logs()}"
    late = {r["idempotency_key"]: (round((r["sent_at"] - r["fire_at"]).total_seconds()
                                         * 1000, 1) if r["sent_at"] else None) for r in held}
    print(f"\n[dramatiq {moment}] {len(held)} held trigger(s), marked sent ms after the slot "
          f"{late}; exit {(exited - asked).total_seconds():.2f} s after the SIGTERM")
    for r in held:
        assert r["state"] == "sent", f"{r['idempotency_key']}: left {r['state']} to the sweep"
        assert 0 <= (r["sent_at"] - r["fire_at"]).total_seconds() < AT_SLOT_TOLERANCE, r
    # no second publish: the other beat's sweep (slot + 10 s) finds every held row sent
    last = max(r["fire_at"] for r in held)
    procs_mod.wait_for(lambda: now() > last + SWEEP_WAIT, 60, "the sweep delay to pass")
    keys = [r["idempotency_key"] for r in held]
    rows = dq.rows(select(outbox.c.state, outbox.c.claimed_by, outbox.c.attempts)
                   .join(runs, outbox.c.run_id == runs.c.id)
                   .where(runs.c.idempotency_key.in_(keys)))
    assert all(r["state"] == "sent" and r["claimed_by"] == owner for r in rows), rows
