"""A schedule group whose outbox rows no live relay or beat publishes is loud, not silent.

Since 0010 a workflow's messages (and an entry's triggers) carry a schedule group, and only
that group's relays and beats publish them. Before 0011_relaywatch relays kept no heartbeat,
so an app whose relay never started (or a starter and a relay that disagree on the group:
``Celery(__name__)`` run as ``__main__`` is group ``default``) left its rows pending forever
while ``status --check`` exited 0. Now relays record a heartbeat row (``role = 'relay'``) and
``status`` names the group, since when its rows wait, and the fix. Also: the
``reliable_beat_outbox_pending`` gauge counts the backlog, not delayed rows not yet due.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from alembic import command
from celery import Celery
from click.testing import CliRunner, Result
from sqlalchemy import func, select, update

from reliable_beat import entries as rb_entries
from reliable_beat import outbox as ob
from reliable_beat import schedules as sch
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db import migrate
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import beats, outbox, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.groups import (
    group_health,
    record_beat,
    record_relay,
    relay_row_owner,
    unserved_outbox,
)
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def _add(store: Store, key: str, *, group: str | None, due_ago: timedelta,
         destination: str = "celery", run_id: int | None = None) -> None:
    """A pending outbox row due ``due_ago`` (a workflow wake-like row when ``group``)."""
    with store.begin() as conn:
        ob.add(conn, destination, {"task": "wf.advance", "args": [key], "kwargs": {}},
               key=key, schedule_group=group, run_id=run_id)
        now = store.now(conn)
        conn.execute(update(outbox).where(outbox.c.message_id == key).values(
            available_at=now - due_ago, created_at=now - due_ago))


def _relay(store: Store, app_name: str, sent: list[OutboxMessage], owner: str) -> Relay:
    """A relay of the app ``Celery(app_name)`` (its schedule group: ``app_name``); its
    ``celery`` handler records instead of publishing."""
    app = Celery(app_name, broker="memory://", set_as_current=False)
    return Relay(store, app, handlers={"celery": sent.append}, settings=Settings(),
                 owner=owner)


def _now(store: Store) -> Any:
    with store.engine.connect() as conn:
        return store.now(conn)


def test_rows_of_a_group_no_live_relay_or_beat_serves_are_a_problem_naming_it(
        pg_store: Store) -> None:
    store = pg_store
    two_min = timedelta(minutes=2)
    _add(store, "wake:w1:1", group="other", due_ago=two_min)
    _add(store, "wake:w2:1", group="other", due_ago=timedelta(seconds=90))
    _add(store, "wake:w3:1", group="other", due_ago=timedelta(seconds=5))  # just due: not yet
    sent: list[OutboxMessage] = []
    relay = _relay(store, "default", sent, owner="host-a:1")
    relay.run_once()  # heartbeat + claim
    assert sent == []  # a relay of 'default' leaves group 'other''s rows alone (0010)

    r = cli(store, "status", "--check")
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if "UNSERVED OUTBOX" in ln)
    assert ("UNSERVED OUTBOX: group 'other': 2 outbox rows (celery) due for more than 60 s"
            in line), line
    assert "no live relay or beat of group 'other' (last seen never)" in line, line
    assert "live ones serve groups: 'default'" in line, line
    assert "reliable-beat -A <app> relay" in line, line
    info = json.loads(cli(store, "status", "--json").output)
    [u] = info["unserved_outbox"]
    assert (u["group"], u["rows"], u["destinations"], u["last_seen_at"]) == (
        "other", 2, ["celery"], None)
    assert u["served_groups"] == ["default"] and info["ok"] is False
    [g] = [g for g in info["groups"] if g["group"] == "default"]
    assert (g["relays_alive"], g["beats_alive"]) == (1, 0)  # a relay is not a beat
    # rows due 2 min (plus however long the test has run) are not yet due for 10 min
    assert cli(store, "status", "--check", "--unserved-after", "600").exit_code == 0

    # a relay of 'other' starts: its heartbeat makes the group served; it publishes them
    stop = threading.Event()
    other = _relay(store, "other", sent, owner="host-b:2")
    worker = threading.Thread(target=other.run_forever, args=(stop,), daemon=True)
    worker.start()
    deadline = time.monotonic() + 30
    while len(sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(m.message_id for m in sent) == ["wake:w1:1", "wake:w2:1", "wake:w3:1"]
    _add(store, "wake:w4:1", group="other", due_ago=two_min)  # taken by the live relay soon
    r = cli(store, "status", "--check")
    assert "UNSERVED OUTBOX" not in r.output, r.output
    deadline = time.monotonic() + 30  # let the live relay publish it before it stops
    while len(sent) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "wake:w4:1" in {m.message_id for m in sent}
    stop.set()
    worker.join(timeout=30)
    assert not worker.is_alive()

    # it stopped (row marked stopped): the group's rows are unserved again, "last seen" set
    with store.engine.connect() as conn:
        stopped = conn.execute(select(beats.c.stopped_at).where(
            beats.c.owner == relay_row_owner("host-b:2", "other"))).scalar_one()
    assert stopped is not None
    _add(store, "wake:w5:1", group="other", due_ago=two_min)
    r = cli(store, "status", "--check")
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if "UNSERVED OUTBOX" in ln)
    assert "group 'other': 1 outbox rows" in line and "last seen never" not in line, line


def test_unserved_rows_per_group_triggers_by_entry_and_who_serves_them(store: Store) -> None:
    """The row's group: its own schedule_group, else (a trigger) its run's entry's group;
    served by a live beat of the group (its sweep), a live relay of the group with the
    destination's handler, or a live relay without an app that has that handler."""
    rb_entries.save_runtime_entry(store, EntryDefinition(
        name="nightly", task="other.pay", schedule=sch.CronSchedule("0 2 * * *", "UTC")),
        create=True, schedule_group="other")
    with store.begin() as conn:
        now = store.now(conn)
        run_id = conn.execute(runs.insert().values(
            idempotency_key="nightly@1", entry_name="nightly", fire_at=now, task="other.pay",
            state="scheduled", created_at=now, updated_at=now)).inserted_primary_key[0]
    _add(store, "trigger:nightly@1", group=None, run_id=int(run_id),
         due_ago=timedelta(minutes=3))  # a trigger: group of its entry
    _add(store, "email:1", group=None, destination="email",
         due_ago=timedelta(minutes=3))  # no group: any relay with 'email' (not this check)

    def unserved() -> list[dict[str, Any]]:
        with store.engine.connect() as conn:
            return unserved_outbox(conn, store.now(conn), due_seconds=60, alive_seconds=60)

    [u] = unserved()
    assert (u["group"], u["rows"], u["destinations"]) == ("other", 1, ["celery"])
    # a relay without an app and without a `celery` handler does not serve it
    record_relay(store, owner="plain:1", group=None, destinations=["email"])
    [u] = unserved()
    assert u["served_groups"] == ["*"]
    # a relay of 'other' without a `celery` handler neither
    record_relay(store, owner="mail:1", group="other", destinations=["email"])
    [u] = unserved()
    assert u["last_seen_at"] is not None
    # a live beat of 'other' does (its sweep publishes its group's triggers)
    record_beat(store, owner="beat:1", group="other", config_hash=None, unregistered={})
    assert unserved() == []
    with store.begin() as conn:
        conn.execute(update(beats).where(beats.c.owner == "beat:1").values(
            seen_at=store.now(conn) - timedelta(minutes=5)))
    assert [u["group"] for u in unserved()] == ["other"]
    # so does a relay without an app that has the handler (e.g. a Dramatiq-style relay)
    record_relay(store, owner="any:1", group=None, destinations=["celery", "email"])
    assert unserved() == []
    with store.engine.connect() as conn:
        health = {g["group"]: g for g in group_health(conn, store.now(conn), alive_seconds=60)}
    # the group's own relay and the two relays of no group (they serve every group)
    assert health["other"]["beats_alive"] == 0 and health["other"]["relays_alive"] == 3


def test_a_relay_records_its_heartbeat_and_never_fails_delivery_on_it(
        sqlite_store: Store) -> None:
    store = sqlite_store
    sent: list[OutboxMessage] = []
    relay = Relay(store, handlers={"email": sent.append, "sms": sent.append},
                  settings=Settings(), owner="host:7")
    relay.run_once()
    with store.engine.connect() as conn:
        row = conn.execute(select(beats)).one()
    assert (row.owner, row.role, row.schedule_group, row.destinations, row.stopped_at) == (
        "relay:*:host:7", "relay", None, ["email", "sms"], None)
    assert relay.maybe_heartbeat() is False  # at most one every HEARTBEAT_SECONDS
    with store.begin() as conn:  # deleted by hand: recorded again at the next heartbeat
        conn.execute(beats.delete())
    relay._last_heartbeat = float("-inf")
    assert relay.maybe_heartbeat() is True
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(beats)).scalar_one() == 1


def test_a_store_before_0011_keeps_delivering_and_says_why_no_heartbeat(
        sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = Store.from_url(sqlite_url, role="cli")
    try:
        migrate.upgrade(store, "0010_fixwfgroup")
        _add(store, "mail:1", group=None, destination="email", due_ago=timedelta(seconds=1))
        sent: list[OutboxMessage] = []
        relay = Relay(store, handlers={"email": sent.append}, settings=Settings(), owner="o")
        with caplog.at_level(logging.WARNING, logger="reliable_beat"):
            assert relay.run_once() == 1
        assert [m.message_id for m in sent] == ["mail:1"]
        lines = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
        assert len(lines) == 1 and "db upgrade" in lines[0], lines
    finally:
        store.dispose()


def test_migration_0011_downgrades_and_upgrades_with_relay_rows(store: Store) -> None:
    record_relay(store, owner="r:1", group=None, destinations=["email"])
    record_beat(store, owner="b:1", group="g", config_hash=None, unregistered={})
    with store.begin() as conn:
        cfg = migrate._config(store.url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0010_fixwfgroup")
    with store.engine.connect() as conn:
        owners = [r[0] for r in conn.exec_driver_sql("SELECT owner FROM reliable_beat_beats")]
    assert owners == ["b:1"]  # relay rows are heartbeats only: dropped with the column
    migrate.upgrade(store)
    with store.engine.connect() as conn:
        assert conn.execute(select(beats.c.role)).scalars().all() == ["beat"]


def test_outbox_pending_gauge_counts_the_backlog_not_delayed_rows(store: Store) -> None:
    pytest.importorskip("prometheus_client")
    from reliable_beat.metrics import make_registry

    _add(store, "due", group=None, destination="email", due_ago=timedelta(seconds=30))
    with store.begin() as conn:
        ob.add(conn, "email", {"n": 1}, key="timer-wake", delay=timedelta(hours=1))
        ob.add(conn, "email", {"n": 2}, key="failed", delay=timedelta(minutes=5))
        ob.add(conn, "email", {"n": 3}, key="held", delay=timedelta(seconds=30))
        conn.execute(update(outbox).where(outbox.c.message_id == "failed").values(
            attempts=1, last_error="smtp 451"))  # backing off: still backlog
        conn.execute(update(outbox).where(outbox.c.message_id == "held").values(
            claimed_by="relay-x", attempts=1))  # a relay holds it now: neither
    registry = make_registry(store)
    labels = {"destination": "email"}
    assert registry.get_sample_value("reliable_beat_outbox_pending", labels) == 2.0
    assert registry.get_sample_value("reliable_beat_outbox_scheduled", labels) == 1.0
    assert registry.get_sample_value(
        "reliable_beat_outbox_oldest_pending_age_seconds", labels) >= 29.0
