"""One bad row never stops the others (issue 12): real beat ticks and relay cycles over
malformed rows, on SQLite and PostgreSQL.

Rows are data a person, a migration or another version may write. Before, a malformed
entries row (``options`` a list, ``options.expires`` not a number, ``options.headers`` not an
object; on SQLite invalid JSON text) raised outside the per-entry guard: every beat crashed
at its first tick, on every restart; the same class of outbox row failed every relay claim.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any
from unittest import mock

import pytest
from sqlalchemy import select, text, update

from reliable_beat import outbox as ob
from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.celery import commands as _commands  # noqa: F401  (cli_status import cycle)
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, entries, outbox, runs
from reliable_beat.entries import EntryDefinition, resume
from reliable_beat.handlers import DestinationUnavailableError
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import MAX_UNCHARGED_RETURNS, Relay
from reliable_beat.settings import Settings

UTC = timezone.utc

#: column -> a well-typed JSON value of the wrong shape (valid on every dialect)
BAD_JSON: dict[str, dict[str, Any]] = {
    "options_list": {"options": ["queue", "q"]},
    "expires_text": {"options": {"expires": "soon"}},
    "expires_bool": {"options": {"expires": True}},
    "headers_text": {"options": {"headers": "x-a: 1"}},
    "priority_big": {"options": {"priority": 10_000}},
    "args_object": {"args": {"a": 1}},
    "kwargs_list": {"kwargs": [1, 2]},
    "schedule_garbage": {"schedule": {"kind": "cron", "expr": "every tuesday"}},
    "schedule_list": {"schedule": [1, 2, 3]},
    "schedule_zone": {"schedule": {"kind": "interval", "every_seconds": 60,
                                   "anchor": "2020-01-01T00:00:00+00:00",
                                   "timezone": "Mars/Olympus"}},
    "timezone_column": {"timezone": "Nowhere/Land"},
    "policy": {"misfire_policy": "sometimes"},
    "limit_huge": {"catch_up_limit": 50_000},
}
#: SQLite only: text that is not JSON, or not an instant, in typed columns
BAD_SQLITE_TEXT: dict[str, tuple[str, str]] = {
    "args_text": ("args", "[1,"),
    "kwargs_text": ("kwargs", "{'a': 1}"),
    "options_text": ("options", "{queue: q}"),
    "schedule_text": ("schedule", "not json"),
    "next_fire_text": ("next_fire_at", "2020-13-45 99:00:00"),
    "last_fire_text": ("last_fire_at", "yesterday"),
    "limit_text": ("catch_up_limit", "many"),
}


def _now(store: Store) -> datetime:
    with store.begin() as conn:
        return store.now(conn)


def _seed(store: Store, name: str, now: datetime) -> None:
    d = EntryDefinition(name=name, task="beatapp.tick", args=[name],
                        schedule=sch.IntervalSchedule(timedelta(seconds=60),
                                                      now - timedelta(seconds=30)))
    values = d.row_values()
    values.update(next_fire_at=now - timedelta(seconds=1), created_at=now, updated_at=now,
                  enabled=True, paused=False)
    with store.begin() as conn:
        conn.execute(entries.insert().values(**values))


def _bad_names(store: Store) -> list[str]:
    names = list(BAD_JSON)
    if store.dialect == "sqlite":
        names += list(BAD_SQLITE_TEXT)
    return names


def _poison_entries(store: Store, now: datetime) -> None:
    for name in ["good1", *_bad_names(store), "good2"]:
        _seed(store, name, now)
    with store.begin() as conn:
        for name, values in BAD_JSON.items():
            conn.execute(update(entries).where(entries.c.name == name).values(**values))
        if store.dialect == "sqlite":
            for name, (column, raw) in BAD_SQLITE_TEXT.items():
                conn.execute(text(f"UPDATE reliable_beat_entries SET {column} = :v "
                                  "WHERE name = :n"), {"v": raw, "n": name})


def test_malformed_entries_are_quarantined_and_the_others_fire(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    now = _now(store)
    _poison_entries(store, now)
    bad = _bad_names(store)
    for _ in range(2):  # a second tick (a restarted beat) is just as fine
        result = Beat(store, owner="t:1").tick()
        fired = sorted(t.payload["headers"]["reliable_beat_entry"] for t in result.triggers)
        if fired:
            assert fired == ["good1", "good2"]
            assert result.quarantined == len(bad)
    with store.engine.connect() as conn:
        rows = {r.name: r for r in conn.execute(
            select(entries.c.name, entries.c.enabled, entries.c.quarantine_reason,
                   entries.c.quarantined_at))}
        fired_runs = sorted(conn.execute(select(runs.c.entry_name)).scalars())
    assert fired_runs == ["good1", "good2"]
    for name in bad:
        assert not rows[name].enabled and rows[name].quarantined_at is not None, name
        assert rows[name].quarantine_reason, name
    assert rows["good1"].enabled and rows["good1"].quarantine_reason is None
    assert "expires" in rows["expires_text"].quarantine_reason
    assert "headers" in rows["headers_text"].quarantine_reason
    assert "Mars/Olympus" in rows["schedule_zone"].quarantine_reason
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    for name in bad:  # named at ERROR, with the fix
        assert any(repr(name) in m and "Fix:" in m for m in errors), name
    info = collect_status(store)
    assert sorted(q["name"] for q in info["quarantined"]) == sorted(bad)
    assert info["quarantined_rows"]["entries"] == len(bad)
    assert not info["ok"] and any("QUARANTINED" in p for p in info["problems"])
    status = {e["name"]: e["status"] for e in info["entries"]}
    assert status["options_list"] == "quarantined" and status["good1"] == "active"
    from reliable_beat.metrics import StoreCollector

    scraped = StoreCollector(store)._read()
    assert scraped["quarantined"]["entries"] == len(bad)
    assert scraped["entries"]["quarantined"] == len(bad)


def test_repaired_entry_is_released_by_resume(store: Store) -> None:
    now = _now(store)
    _seed(store, "e", now)
    with store.begin() as conn:
        conn.execute(update(entries).values(options=["oops"]))
    Beat(store, owner="t:1").tick()
    with store.begin() as conn:
        conn.execute(update(entries).values(options={}))
    resume(store, "e")
    with store.engine.connect() as conn:
        row = conn.execute(select(entries)).one()
    assert row.enabled and row.quarantine_reason is None
    result = Beat(store, owner="t:1").tick()
    assert result.quarantined == 0


def _add_outbox(store: Store) -> None:
    with store.begin() as conn:
        for i in range(6):
            ob.add(conn, "sink", {"i": i}, key=f"k{i}")
        # rows outbox.add refuses now, as an earlier version (or a person with SQL) wrote them
        with mock.patch.object(ob, "check_payload", lambda *args, **kwargs: None):
            ob.add(conn, "celery", ["not", "a", "trigger"], key="trigger:list")
            ob.add(conn, "celery", {"task": "t", "args": "1", "kwargs": {}}, key="trigger:args")
        conn.execute(update(outbox).where(outbox.c.message_id == "k1")
                     .values(headers=["not", "an", "object"]))
        if store.dialect == "sqlite":
            conn.execute(text("UPDATE reliable_beat_outbox SET payload = '{oops' "
                              "WHERE message_id = 'k2'"))
            conn.execute(text("UPDATE reliable_beat_outbox SET run_id = 'x' "
                              "WHERE message_id = 'k3'"))
            conn.execute(text("UPDATE reliable_beat_outbox SET created_at = 'never' "
                              "WHERE message_id = 'k4'"))


def test_malformed_outbox_rows_are_dead_lettered_and_the_others_delivered(
    store: Store,
) -> None:
    _add_outbox(store)
    delivered: list[Any] = []
    relay = Relay(store, handlers={"sink": lambda m: delivered.append(m.payload),
                                   "celery": lambda m: None})
    relay.run_once()
    relay.run_once()
    bad = {"k1", "trigger:list", "trigger:args"}
    if store.dialect == "sqlite":
        bad |= {"k2", "k3", "k4"}
    with store.engine.connect() as conn:
        states = dict(conn.execute(select(outbox.c.message_id, outbox.c.state)).all())
        dead = conn.execute(select(dead_letters.c.key, dead_letters.c.reason,
                                   dead_letters.c.payload)).all()
    assert {k for k, s in states.items() if s == "dead"} == bad
    assert {k for k, s in states.items() if s == "sent"} == set(states) - bad
    assert sorted(p["i"] for p in delivered) == sorted(
        int(k[1:]) for k in states if k.startswith("k") and k not in bad)
    assert sorted(d.key for d in dead) == sorted(bad)
    assert {d.reason for d in dead} == {"malformed"}
    assert all(d.payload["message_id"] == d.key for d in dead)  # the original row is kept
    assert collect_status(store)["quarantined_rows"]["outbox"] == len(bad)


class _Flaky:
    """Delivers every message except ``poison``, which always looks like an outage."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def __call__(self, m: OutboxMessage) -> None:
        raise AssertionError("batch only")

    def deliver_batch(self, messages: list[OutboxMessage]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        for m in messages:
            if m.message_id == "poison":
                out.append(DestinationUnavailableError("looks like an outage"))
            else:
                self.sent.append(m.message_id)
                out.append(None)
        return out


def test_row_handed_back_uncharged_is_capped(sqlite_store: Store) -> None:
    store = sqlite_store
    settings = Settings(outbox_max_attempts=2, outbox_retry_base_seconds=0.01,
                        outbox_retry_cap_seconds=0.01)
    handler = _Flaky()
    relay = Relay(store, handlers={"x": handler}, settings=settings)
    for cycle in range(4 * MAX_UNCHARGED_RETURNS):
        with store.begin() as conn:
            ob.add(conn, "x", {}, key=f"good{cycle}")
            if cycle == 0:
                ob.add(conn, "x", {}, key="poison")
            conn.execute(update(outbox).where(outbox.c.state == "pending")
                         .values(available_at=datetime(2000, 1, 1, tzinfo=UTC)))
        relay.run_once()
    with store.engine.connect() as conn:
        state = conn.execute(select(outbox.c.state).where(outbox.c.message_id == "poison"))
        dead = conn.execute(select(dead_letters.c.key, dead_letters.c.reason)).all()
    assert state.scalar_one() == "dead"
    assert [(d.key, d.reason) for d in dead] == [("poison", "exhausted")]
    assert len(handler.sent) == 4 * MAX_UNCHARGED_RETURNS


def test_malformed_buffered_run_is_dead_lettered_and_the_others_released(store: Store) -> None:
    now = _now(store)
    for name in ("a", "b"):
        _seed(store, name, now + timedelta(hours=1))  # not due: only the release runs
    with store.begin() as conn:
        for name, args in (("a", [1]), ("b", {"not": "a list"})):
            conn.execute(runs.insert().values(
                idempotency_key=f"{name}@slot", entry_name=name, fire_at=now, trigger="schedule",
                task="beatapp.tick", args=args, kwargs={}, state="buffered", created_at=now,
                updated_at=now))
        if store.dialect == "sqlite":
            conn.execute(runs.insert().values(
                idempotency_key="c@slot", entry_name="c", fire_at=now, trigger="schedule",
                task="beatapp.tick", args=[], kwargs={}, state="buffered", created_at=now,
                updated_at=now))
            conn.execute(text("UPDATE reliable_beat_runs SET kwargs = '{x' "
                              "WHERE idempotency_key = 'c@slot'"))
    result = Beat(store, owner="t:1").tick()
    assert [t.key for t in result.triggers] == ["a@slot"]
    with store.engine.connect() as conn:
        states = dict(conn.execute(select(runs.c.idempotency_key, runs.c.state)).all())
        dead = sorted(conn.execute(
            select(dead_letters.c.key).where(dead_letters.c.reason == "malformed")).scalars())
    bad = ["b@slot"] + (["c@slot"] if store.dialect == "sqlite" else [])
    assert dead == bad
    assert states == {"a@slot": "scheduled", **{k: "dead" for k in bad}}
    assert collect_status(store)["quarantined_rows"]["runs"] == len(bad)


@pytest.mark.parametrize("options", [{"headers": "x-a: 1"}, {"priority": "high"},
                                     {"queue": 5}])
def test_config_refuses_the_shapes_the_beat_would_quarantine(options: dict[str, Any]) -> None:
    from reliable_beat.entries import definition_from_celery
    from reliable_beat.errors import EntryValidationError

    with pytest.raises(EntryValidationError) as info:
        definition_from_celery("e", {"task": "t", "schedule": 60, "options": options},
                               default_timezone="UTC", settings=Settings(),
                               now=datetime(2030, 1, 1, tzinfo=UTC))
    assert "entry 'e'" in str(info.value) and "options." in str(info.value)


def test_manual_trigger_of_a_malformed_entry_is_refused(store: Store) -> None:
    from reliable_beat.errors import ConfigurationError
    from reliable_beat.runtime import trigger

    _seed(store, "e", _now(store) + timedelta(hours=1))
    with store.begin() as conn:
        conn.execute(update(entries).values(options={"headers": [1]}))
    with pytest.raises(ConfigurationError, match="malformed"):
        trigger(store, "e")
    with store.engine.connect() as conn:
        assert conn.execute(select(runs.c.id)).first() is None


def test_a_malformed_run_read_by_two_beats_is_dead_lettered_once(store: Store) -> None:
    """The release reads buffered runs without a lock: two beats may both find the same
    malformed run; only the one that moves it writes the dead letter (found by the fault
    run's poison_row kind)."""
    from reliable_beat.rows import read_buffered_runs

    now = _now(store)
    with store.begin() as conn:
        conn.execute(runs.insert().values(
            idempotency_key="x@slot", entry_name="x", fire_at=now, trigger="schedule",
            task="t", args="not a list", kwargs={}, state="buffered", created_at=now,
            updated_at=now))
    with store.engine.connect() as peek:  # the second beat reads the row ...
        values = dict(peek.execute(select(runs)).one()._mapping)
    with store.begin() as first:  # ... the first one settles it ...
        assert read_buffered_runs(first, now, limit=10) == []
    with store.begin() as second:  # ... then the second settles what it read
        from reliable_beat.rows import dead_letter_run

        dead_letter_run(second, values, ["args='not a list': expected a JSON array"], now)
    with store.engine.connect() as conn:
        assert conn.execute(select(dead_letters.c.key)).scalars().all() == ["x@slot"]
