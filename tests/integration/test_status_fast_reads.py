"""The fast reads of ``reliable-beat status`` find what the slow ones found.

MALFORMED ENTRY reads the JSON columns as text and decodes each distinct text once
(:class:`reliable_beat.rows.LabelledReader`); a value that is not JSON (SQLite) is still a
problem of its column. The entry checker skips the config-hash digest for a schedule it
built before, yet a definition's row (its digest matches) is still never reported for a
schedule that fails to build, although an equal spec of another row failed first. MALFORMED
RUN ROWS counts the ranges between the known states: every other state is counted, as
``NOT IN`` counted it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import insert, text, update

from reliable_beat import schedules as sch
from reliable_beat.cli.status import malformed_entries
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.rows import KNOWN_RUN_STATES, stored_config_hashes, unknown_state_runs


def _rows(store: Store, names: list[str]) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        values = []
        for name in names:
            v = EntryDefinition(name=name, task="app.work", args=[1],
                                schedule=sch.CronSchedule("*/5 * * * *", "UTC")).row_values()
            v.update(next_fire_at=now + timedelta(minutes=5), created_at=now, updated_at=now,
                     enabled=True, paused=False, origin="runtime")
            values.append(v)
        conn.execute(insert(entries), values)


def test_repeated_json_values_are_checked_and_a_bad_one_is_found(store: Store) -> None:
    names = [f"e-{i:03d}" for i in range(30)]
    _rows(store, names)
    with store.begin() as conn:
        conn.execute(text("UPDATE reliable_beat_entries SET kwargs = '[1]' "
                          "WHERE name = 'e-007'"))
        conn.execute(text("UPDATE reliable_beat_entries SET options = '{\"expires\": -1}' "
                          "WHERE name = 'e-021'"))
        if store.engine.dialect.name == "sqlite":  # dynamic typing: text that is not JSON
            conn.execute(text("UPDATE reliable_beat_entries SET args = 'not json' "
                              "WHERE name = 'e-013'"))
    with store.engine.connect() as conn:
        found = {m["name"]: m["problems"] for m in malformed_entries(conn)}
    want: dict[str, Any] = {
        "e-007": ["kwargs=[1]: expected a JSON object"],
        "e-021": ["options.expires=-1: expected seconds (a number > 0) or null"],
    }
    if store.engine.dialect.name == "sqlite":
        want["e-013"] = ["args: unreadable value"]
    assert found == want


def test_a_definitions_row_is_not_reported_for_a_spec_that_failed_on_another_row(
        store: Store) -> None:
    """``a`` (changed by SQL: no matching digest) and ``b`` (its digest matches its stored
    values: the library wrote it) hold the same unbuildable spec; ``a`` is checked first and
    its failure is remembered, yet only ``a`` is reported, as before the memo."""
    _rows(store, ["a-sql", "b-definition"])
    bad = {"kind": "cron", "expr": "61 * * * *", "timezone": "UTC"}
    with store.begin() as conn:
        conn.execute(update(entries).values(schedule=bad, config_hash=None))
        row = dict(conn.execute(entries.select().where(entries.c.name == "b-definition"))
                   .mappings().one())
        digest = sorted(stored_config_hashes(row))[0]
        conn.execute(update(entries).where(entries.c.name == "b-definition")
                     .values(config_hash=digest))
    with store.engine.connect() as conn:
        found = malformed_entries(conn)
    assert [m["name"] for m in found] == ["a-sql"], found
    assert found[0]["problems"][0].startswith("schedule=")


def test_unknown_run_states_between_the_known_ones_are_counted(store: Store) -> None:
    odd = ["", "aaa", "cancelled", "pending", "stopped", "zzz"]  # below, between, above
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(insert(runs), [
            {"idempotency_key": f"k-{state or 'empty'}-{i}", "entry_name": None,
             "fire_at": None, "task": "t", "args": [], "kwargs": {}, "state": state,
             "created_at": now, "updated_at": now}
            for i, state in enumerate([*odd, *sorted(KNOWN_RUN_STATES)])])
    with store.engine.connect() as conn:
        count, keys = unknown_state_runs(conn)
    assert count == len(odd)
    assert sorted(keys) == sorted(f"k-{s or 'empty'}-{i}" for i, s in enumerate(odd))
