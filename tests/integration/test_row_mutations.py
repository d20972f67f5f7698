"""Row mutations (issue 12): any column of any row the pipeline reads, set to a value of the
wrong type, shape or size, never stops a beat tick or a relay cycle, and never hides.

Each example seeds a small store (due entries, pending outbox rows, a buffered run), mutates
ONE column of ONE target row (an entry, an outbox row or a run) to a hostile value, then runs
real :class:`~reliable_beat.beat.Beat` ticks and :class:`~reliable_beat.relay.Relay` cycles
and checks:

* nothing raises (no process would exit);
* every other row is still served: the good entries fire, the good outbox rows are sent;
* the target is accounted for: served, or quarantined / dead-lettered with a reason and
  visible in ``status``, or not claimable for a reason ``status`` shows (disabled, paused,
  a future instant, another state, a destination without a handler here);
* ``status`` and ``entries list`` still work.

SQLite (dynamic typing: any value in any column, invalid JSON text, garbage instants) runs
the hypothesis strategy; PostgreSQL (the server enforces column types: only JSON shapes,
strings and numbers can be wrong) runs a fixed sample.

CI size: ``RB_ROW_MUTATION_EXAMPLES`` (default 40). Full size (docs/operations.md)::

    RB_ROW_MUTATION_EXAMPLES=2000 .venv/bin/python -m pytest -q \\
        tests/integration/test_row_mutations.py
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from datetime import timedelta, timezone
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Table, delete, select, text, update
from sqlalchemy.exc import IntegrityError

from reliable_beat import outbox as ob
from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.celery.commands import reliable_beat as reliable_beat_cli
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import attempts, dead_letters, entries, outbox, runs
from reliable_beat.entries import EntryDefinition, list_entries
from reliable_beat.metrics import StoreCollector
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay

UTC = timezone.utc
EXAMPLES = int(os.environ.get("RB_ROW_MUTATION_EXAMPLES", "40"))
GOOD_ENTRIES = ("good0", "good1", "good2")
GOOD_OUTBOX = ("ok0", "ok1", "ok2")
HANDLED = ("sink", "celery")
#: every column of the rows the beat and the relay read, except the primary key
MUTABLE: dict[str, list[str]] = {
    "entries": [c.name for c in entries.c if c.name != "id"],
    "outbox": [c.name for c in outbox.c if c.name != "id"],
    "runs": [c.name for c in runs.c if c.name != "id"],
}
TABLES: dict[str, Table] = {"entries": entries, "outbox": outbox, "runs": runs}


# --------------------------------------------------------------------------- seeding


def _seed(store: Store) -> dict[str, int]:
    """A small store; returns the target row id per table."""
    with store.begin() as conn:
        for table in (attempts, dead_letters, outbox, runs, entries):
            conn.execute(delete(table))
        now = store.now(conn)
        ids: dict[str, int] = {}
        for name in (*GOOD_ENTRIES, "target", "buf"):
            due = now + timedelta(hours=1) if name == "buf" else now - timedelta(seconds=1)
            d = EntryDefinition(  # next_fire_at on the grid: due 1 s ago
                name=name, task="beatapp.tick", args=[name], kwargs={"k": 1},
                options={"queue": "celery", "expires": 30, "headers": {"h": 1}},
                schedule=sch.IntervalSchedule(timedelta(seconds=60), due - timedelta(seconds=60)),
                overlap_policy="buffer_one" if name == "buf" else "allow",
            )
            values = d.row_values()
            values.update(next_fire_at=due, created_at=now, updated_at=now, enabled=True,
                          paused=False)
            new_id = conn.execute(entries.insert().values(**values)).inserted_primary_key[0]
            if name == "target":
                ids["entries"] = int(new_id)
        ids["runs"] = int(conn.execute(runs.insert().values(
            idempotency_key="buf@slot", entry_name="buf", fire_at=now, trigger="schedule",
            task="beatapp.tick", args=[1], kwargs={}, state="buffered", created_at=now,
            updated_at=now)).inserted_primary_key[0])
        for key in GOOD_OUTBOX:
            ob.add(conn, "sink", {"key": key}, key=key)
        ob.add(conn, "celery", {"task": "t", "args": [1], "kwargs": {}, "options": {},
                                "headers": {}, "task_id": "tid", "expires_at": None},
               key="target-message", headers={"h": 1})
        ids["outbox"] = int(conn.execute(
            select(outbox.c.id).where(outbox.c.message_id == "target-message")).scalar_one())
    return ids


def _run_cycles(store: Store) -> list[OutboxMessage]:
    delivered: list[OutboxMessage] = []
    relay = Relay(store, handlers={d: delivered.append for d in HANDLED})
    for _ in range(2):
        Beat(store, owner="t:1").tick()
        relay.run_once()
    return delivered


# --------------------------------------------------------------------------- checks


def _check(store: Store, ids: dict[str, int], table: str, column: str) -> None:
    with store.engine.connect() as conn:
        now = store.now(conn)
        fired = set(conn.execute(
            select(runs.c.entry_name).where(runs.c.trigger.in_(("schedule", "catch_up")))
        ).scalars())
        sent = set(conn.execute(
            select(outbox.c.message_id).where(outbox.c.state == "sent")).scalars())
        dead_ids = {
            (k, i) for k, i in conn.execute(
                select(dead_letters.c.kind,
                       dead_letters.c.outbox_id if table == "outbox" else dead_letters.c.run_id))
        }
    assert set(GOOD_ENTRIES) <= fired, f"a good entry did not fire: {fired}"
    assert set(GOOD_OUTBOX) <= sent, f"a good outbox row was not sent: {sent}"
    info = collect_status(store)  # visibility: must work whatever the rows hold
    list_entries(store, include_disabled=True)
    StoreCollector(store)._read()  # the metrics scrape too
    for args in (["entries", "list", "--all"], ["status", "--all"]):  # and the CLI's rendering
        out = CliRunner().invoke(reliable_beat_cli, ["--database-url", store.url, *args],
                                 catch_exceptions=False)
        assert out.exit_code in (0, 1), out.output
    by_id = _raw(store, TABLES[table], ids[table])
    if table == "entries":
        quarantined = by_id["quarantine_reason"] is not None
        served = any(n not in (*GOOD_ENTRIES, "buf") for n in fired)
        if quarantined:
            shown = [e for e in info["entries"] if e["status"] == "quarantined"]
            assert shown, "quarantined entry not shown by status"
            return
        if served:
            return
        assert column in ("enabled", "paused", "next_fire_at", "end_at", "start_at",
                          "name", "schedule", "schedule_kind", "config_hash", "origin",
                          "created_at", "updated_at", "paused_at", "last_fire_at",
                          "quarantine_reason", "quarantined_at"), (
            f"entry neither fired nor quarantined after mutating {column}: {by_id}")
        if column == "next_fire_at":  # only NULL (ended) or a future instant may wait
            value = by_id[column]
            assert value is None or (isinstance(value, str) and value > str(now)[:19]), by_id
    elif table == "outbox":
        state = by_id["state"]
        if state == "sent" or ("outbox", ids["outbox"]) in dead_ids:
            return
        if state == "dead":
            assert ("outbox", ids["outbox"]) in dead_ids, "dead outbox row without dead letter"
            return
        # not claimable for a reason status shows: another state, a future instant, an
        # ordering key behind another row, or a destination this relay has no handler for
        assert column in ("state", "available_at", "destination", "ordering_key",
                          "claimed_by", "sent_at", "last_error", "created_at",
                          "attempts", "headers", "payload", "message_id", "run_id"), (
            f"outbox row neither served nor dead-lettered after mutating {column}: {by_id}")
        if column == "state":
            return
        if column == "destination" and by_id["destination"] not in HANDLED:
            return
        if column == "available_at":
            return
        pytest.fail(f"outbox row pending after mutating {column}: {by_id}")
    else:
        state = by_id["state"]
        if state in ("scheduled", "dispatched") or ("run", ids["runs"]) in dead_ids:
            return
        assert column in ("state", "entry_name", "created_at", "updated_at"), (
            f"buffered run neither released nor dead-lettered after mutating {column}: {by_id}")


def _raw(store: Store, table: Table, row_id: int) -> dict[str, Any]:
    with store.engine.connect() as conn:
        row = conn.execute(
            text(f"SELECT * FROM {table.name} WHERE id = :i"), {"i": row_id}).one()
    return dict(row._mapping)


# --------------------------------------------------------------------------- SQLite: hypothesis


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
hostile = st.one_of(
    json_values.map(json.dumps),  # valid JSON text of any shape
    st.text(max_size=30),  # arbitrary text: invalid JSON, garbage instants, names
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.none(),
    st.sampled_from(["2020-13-45 99:00:00", "yesterday", "", "[1,", "{'a': 1}", "NaN", "1",
                     "9999-99-99", "zzz", "true", "-1", "1e999"]),
    st.integers(1_000, 100_000).map(lambda n: "x" * n),  # sizes
    st.integers(100, 2_000).map(lambda n: json.dumps(list(range(n)))),
)
target = st.sampled_from(sorted(MUTABLE)).flatmap(
    lambda t: st.tuples(st.just(t), st.sampled_from(MUTABLE[t])))


@pytest.fixture(scope="module")
def sqlite_mutation_store() -> Iterator[Store]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.from_url(f"sqlite:///{tmp}/mut.sqlite3", role="cli")
        upgrade(store)
        yield store
        store.dispose()


def _mutate_sqlite(store: Store, table: str, row_id: int, column: str, value: Any) -> bool:
    try:
        with store.begin() as conn:
            conn.execute(text(f"UPDATE {TABLES[table].name} SET {column} = :v WHERE id = :i"),
                         {"v": value, "i": row_id})
    except IntegrityError:  # NOT NULL / UNIQUE: the database refuses that row itself
        return False
    return True


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(where=target, value=hostile)
def test_hostile_rows_on_sqlite(sqlite_mutation_store: Store, where: tuple[str, str],
                                value: Any) -> None:
    store = sqlite_mutation_store
    table, column = where
    ids = _seed(store)
    if not _mutate_sqlite(store, table, ids[table], column, value):
        return
    _run_cycles(store)
    _check(store, ids, table, column)


# --------------------------------------------------------------------------- PostgreSQL: sample


PG_SAMPLE: list[tuple[str, str, Any]] = [
    ("entries", "options", ["queue", "q"]),
    ("entries", "options", {"expires": "soon"}),
    ("entries", "options", {"expires": -1}),
    ("entries", "options", {"headers": [1, 2]}),
    ("entries", "options", {"priority": "high"}),
    ("entries", "options", {"queue": 5}),
    ("entries", "args", {"a": 1}),
    ("entries", "args", "text"),
    ("entries", "kwargs", [1, 2]),
    ("entries", "schedule", []),
    ("entries", "schedule", {"kind": "cron", "expr": "every tuesday"}),
    ("entries", "schedule", {"kind": "interval", "every_seconds": "60"}),
    ("entries", "schedule", {"kind": "interval", "every_seconds": 60, "anchor": "x"}),
    ("entries", "schedule", {"kind": "once", "at": "2020-01-01T00:00:00",
                             "timezone": "Bad/Zone"}),
    ("entries", "timezone", "Nowhere/Land"),
    ("entries", "misfire_policy", "sometimes"),
    ("entries", "overlap_policy", "never"),
    ("entries", "misfire_grace_seconds", -5.0),
    ("entries", "catch_up_limit", -1),
    ("entries", "catch_up_window_seconds", -1.0),
    ("entries", "task", ""),
    ("outbox", "payload", [1, 2]),
    ("outbox", "payload", {"task": 5}),
    ("outbox", "payload", {"task": "t", "args": "x"}),
    ("outbox", "payload", {"task": "t", "kwargs": [1]}),
    ("outbox", "payload", {"task": "t", "options": "q"}),
    ("outbox", "payload", {"task": "t", "headers": [1]}),
    ("outbox", "payload", {"task": "t", "expires_at": "soon"}),
    ("outbox", "payload", {"task": "t", "task_id": 7}),
    ("outbox", "payload", "x" * 100_000),
    ("outbox", "headers", [1]),
    ("outbox", "headers", "x"),
    ("outbox", "message_id", ""),
    ("runs", "args", "x"),
    ("runs", "kwargs", [1]),
    ("runs", "task", ""),
    ("runs", "trigger", ""),
]


def test_hostile_rows_on_postgresql_sample(pg_store: Store) -> None:
    store = pg_store
    for table, column, value in PG_SAMPLE:
        ids = _seed(store)
        with store.begin() as conn:
            table_obj = TABLES[table]
            conn.execute(update(table_obj).where(table_obj.c.id == ids[table])
                         .values({column: value}))
        _run_cycles(store)
        _check_pg(store, ids, table, column, value)


def _check_pg(store: Store, ids: dict[str, int], table: str, column: str, value: Any) -> None:
    """On the fixed sample every target is malformed: it must be quarantined /
    dead-lettered, and everything else served."""
    _check(store, ids, table, column)
    row = _raw(store, TABLES[table], ids[table])
    where = f"{table}.{column}={value!r:.60}"
    if table == "entries":
        assert row["quarantine_reason"], where
    elif table == "outbox":
        assert row["state"] == "dead", where
    else:
        assert row["state"] == "dead", where

