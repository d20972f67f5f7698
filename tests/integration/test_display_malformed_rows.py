"""Every command that shows rows to a person survives one malformed row of the tables the
row-mutation test does not cover: the heartbeat rows of beats and relays
(``reliable_beat_beats``), the synced configs (``reliable_beat_schedule_configs``), attempts
and dead letters — and the runs shown by ``runs`` / ``runs show``.

Before, one such value failed the whole command with a traceback: a heartbeat ``seen_at`` a
person set to ``'zz{'`` (SQLite) failed ``status`` and ``schedule list``; a dead letter's
``created_at`` failed ``dead-letters list``; an ``entry_names`` that is not JSON failed
``schedule list``; on PostgreSQL a heartbeat's ``unregistered`` holding a JSON list failed
``status``. Now the value is shown as unreadable (or ignored where only liveness depends on
it: an unreadable heartbeat is no heartbeat) and every other row is shown as before.

SQLite takes any value in any column (text that is not JSON or not an instant); PostgreSQL
only wrong JSON shapes and ``'infinity'``.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from reliable_beat import schedules as sch
from reliable_beat.celery.commands import reliable_beat as reliable_beat_cli
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, runs
from reliable_beat.entries import EntryDefinition, sync_schedule_group
from reliable_beat.groups import record_beat, record_relay
from reliable_beat.metrics import StoreCollector

UTC = timezone.utc
KEY = "nightly@2026-12-01T02:00:00Z"

#: (table, column, value written by raw SQL) on SQLite
SQLITE_CASES: list[tuple[str, str, Any]] = [
    (table, column, value)
    for table, columns in {
        "reliable_beat_beats": ["seen_at", "stopped_at", "started_at", "unregistered",
                                "destinations"],
        "reliable_beat_schedule_configs": ["synced_at", "first_synced_at", "superseded_at",
                                           "entry_names"],
        "reliable_beat_dead_letters": ["created_at", "requeued_at", "payload"],
        "reliable_beat_attempts": ["started_at", "finished_at"],
        "reliable_beat_runs": ["created_at", "lease_expires_at", "args", "result"],
    }.items()
    for column in columns
    for value in ("zz{", "2020-13-45 99:00:00", 12345)
]
#: the values PostgreSQL's column types let through
PG_CASES: list[tuple[str, str, Any]] = [
    ("reliable_beat_beats", "seen_at", "infinity"),
    ("reliable_beat_beats", "stopped_at", "-infinity"),
    ("reliable_beat_beats", "unregistered", "[1, 2]"),
    ("reliable_beat_beats", "destinations", '"celery"'),
    ("reliable_beat_schedule_configs", "synced_at", "infinity"),
    ("reliable_beat_schedule_configs", "entry_names", '{"a": 1}'),
    ("reliable_beat_schedule_configs", "entry_names", "7"),
    ("reliable_beat_dead_letters", "created_at", "infinity"),
    ("reliable_beat_dead_letters", "payload", "[1]"),
    ("reliable_beat_attempts", "started_at", "-infinity"),
]
JSON_COLUMNS = {"unregistered", "destinations", "entry_names", "payload", "args", "result"}


def _seed(store: Store) -> int:
    """A beat and a relay heartbeat, a synced config, a run with an attempt, a dead letter;
    returns the dead letter's id."""
    record_relay(store, owner="relay:1", group="shop", destinations=["celery"])
    record_beat(store, owner="beat:1", group="shop", config_hash="c" * 64,
                unregistered={}, destinations=["celery"])
    sync_schedule_group(store, [EntryDefinition(
        name="nightly", task="shop.tasks.nightly",
        schedule=sch.IntervalSchedule(timedelta(hours=1), datetime(2026, 1, 1, tzinfo=UTC)))],
        group="shop", owner="beat:1")
    with store.begin() as conn:
        now = store.now(conn)
        run_id = conn.execute(runs.insert().values(
            idempotency_key=KEY, entry_name="nightly", fire_at=now, trigger="schedule",
            task="shop.tasks.nightly", args=[1], kwargs={}, state="dead", attempts=1,
            created_at=now, updated_at=now)).inserted_primary_key[0]
        conn.execute(attempts.insert().values(
            run_id=run_id, attempt=1, fence_token=1, worker="w1", task_id="t1",
            started_at=now, finished_at=now, outcome="failed", error="boom"))
        return int(conn.execute(dead_letters.insert().values(
            kind="run", run_id=run_id, key=KEY, entry_name="nightly",
            task="shop.tasks.nightly", destination="celery", payload={"args": [1]},
            reason="max_retries", error="boom", attempts=1, created_at=now,
        )).inserted_primary_key[0])


def _cli(store: Store, *args: str) -> Any:
    return CliRunner().invoke(reliable_beat_cli, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def _check_every_view(store: Store, dead_letter_id: int) -> None:
    collect_status(store)
    StoreCollector(store)._read()
    for args in (["status", "--all"], ["status", "--json"], ["schedule", "list"],
                 ["schedule", "list", "--json"], ["runs"], ["runs", "--json"],
                 ["runs", "show", KEY], ["dead-letters", "list"],
                 ["dead-letters", "list", "--json"], ["dead-letters", "show",
                                                      str(dead_letter_id)]):
        out = _cli(store, *args)
        assert out.exit_code in (0, 1), (args, out.output)
        assert "Traceback" not in out.output, (args, out.output)


def _mutate(store: Store, table: str, column: str, value: Any) -> None:
    value_sql = ":v"
    if store.dialect == "postgresql":
        value_sql = f"CAST(:v AS {'jsonb' if column in JSON_COLUMNS else 'timestamptz'})"
    with store.begin() as conn:
        conn.execute(text(f"UPDATE {table} SET {column} = {value_sql}"), {"v": value})


@pytest.mark.parametrize(("table", "column", "value"), SQLITE_CASES)
def test_sqlite_one_malformed_value_fails_no_view(
    sqlite_store: Store, table: str, column: str, value: Any
) -> None:
    dead_letter_id = _seed(sqlite_store)
    _mutate(sqlite_store, table, column, value)
    _check_every_view(sqlite_store, dead_letter_id)


@pytest.mark.parametrize(("table", "column", "value"), PG_CASES)
def test_postgresql_one_malformed_value_fails_no_view(
    pg_store: Store, table: str, column: str, value: Any
) -> None:
    dead_letter_id = _seed(pg_store)
    _mutate(pg_store, table, column, value)
    _check_every_view(pg_store, dead_letter_id)


def test_an_unreadable_value_is_shown_as_such_and_the_others_as_before(
    sqlite_store: Store
) -> None:
    dead_letter_id = _seed(sqlite_store)
    _mutate(sqlite_store, "reliable_beat_dead_letters", "created_at", "yesterday")
    _mutate(sqlite_store, "reliable_beat_attempts", "finished_at", "zz{")
    out = _cli(sqlite_store, "dead-letters", "show", str(dead_letter_id))
    assert out.exit_code == 0, out.output
    assert "unreadable: 'yesterday'" in out.output and "max_retries" in out.output
    shown = _cli(sqlite_store, "runs", "show", KEY)
    assert shown.exit_code == 0, shown.output
    assert "unreadable: 'zz{'" in shown.output and "w1" in shown.output


def test_an_unreadable_heartbeat_is_no_heartbeat(sqlite_store: Store) -> None:
    _seed(sqlite_store)
    before = {g["group"]: g for g in collect_status(sqlite_store)["groups"]}
    assert before["shop"]["beats_alive"] == 1 and before["shop"]["relays_alive"] == 1
    _mutate(sqlite_store, "reliable_beat_beats", "seen_at", "zz{")  # both rows
    after = {g["group"]: g for g in collect_status(sqlite_store)["groups"]}
    assert after["shop"]["beats_alive"] == 0 and after["shop"]["relays_alive"] == 0


def test_the_outbox_line_adds_up(sqlite_store: Store) -> None:
    """Every pending row is counted once in ``status``'s outbox line: a row a relay (or a
    beat, claimed ahead) holds was counted as pending but neither due nor scheduled
    (a fresh user read ``1 pending (0 due), oldest -, 0 scheduled``)."""
    from reliable_beat import outbox as ob

    with sqlite_store.begin() as conn:
        for key in ("due", "held"):
            ob.add(conn, "celery", {"task": "t", "kwargs": {"k": key}}, key=key)
        ob.add(conn, "celery", {"task": "t", "kwargs": {"k": "later"}}, key="later",
               delay=timedelta(hours=1))
        conn.execute(text(
            "UPDATE reliable_beat_outbox SET claimed_by = 'relay:1', "
            "available_at = datetime('now', '+60 seconds') WHERE message_id = 'held'"))
    out = _cli(sqlite_store, "status")
    assert ("celery: 3 pending = 1 backlog (1 due, oldest " in out.output
            and "+ 1 scheduled (not yet due) + 1 claimed" in out.output), out.output
