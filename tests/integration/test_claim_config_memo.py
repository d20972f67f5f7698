"""A beat decodes and checks each distinct entry config once (rows.ClaimedEntries), on a
real PostgreSQL: what a row's config holds is decided by its stored values (a change made by
SQL, ``config_hash`` left as it was, is seen at the next claim), and a row of a config seen
before still has its own columns checked (its name, its instants)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import select, text, update

from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.entries import EntryDefinition

pytestmark = pytest.mark.postgres

NAMES = ("memo-a", "memo-b", "memo-c", "memo-d")


def _seed(store: Store, now: datetime) -> None:
    with store.begin() as conn:
        for name in NAMES:  # one config for all: the same task, arguments and schedule
            d = EntryDefinition(name=name, task="beatapp.tick", args=[1, "x"],
                                options={"queue": "q"},
                                schedule=sch.IntervalSchedule(timedelta(hours=1),
                                                              now - timedelta(seconds=30)))
            values = d.row_values()
            values.update(next_fire_at=now - timedelta(seconds=30), created_at=now,
                          updated_at=now, enabled=True, paused=False)
            conn.execute(entries.insert().values(**values))


def _due_again(store: Store) -> None:
    with store.begin() as conn:
        conn.execute(update(entries).values(next_fire_at=text("now() - interval '1 second'")))


def test_config_memo_follows_the_stored_values_and_checks_each_row(pg_store: Store) -> None:
    with pg_store.begin() as conn:
        now = pg_store.now(conn)
    _seed(pg_store, now)
    beat = Beat(pg_store, owner="memo")
    first = beat.tick()
    assert sorted(t.key.split("@")[0] for t in first.triggers) == list(NAMES)
    assert {tuple(t.payload["args"]) for t in first.triggers} == {(1, "x")}

    with pg_store.begin() as conn:
        hashes = dict(conn.execute(select(entries.c.name, entries.c.config_hash)).all())
        # changed by SQL, config_hash untouched: the next claim must read the new values
        conn.execute(text("UPDATE reliable_beat_entries SET args = '[2, \"y\"]'::jsonb "
                          "WHERE name = 'memo-a'"))
        # the known config turned malformed by SQL: quarantined, not served from the memo
        conn.execute(text("UPDATE reliable_beat_entries SET options = '[\"q\"]'::jsonb "
                          "WHERE name = 'memo-b'"))
        # the known config, a row's own instant unreadable: quarantined as before
        conn.execute(text("UPDATE reliable_beat_entries SET last_fire_at = 'infinity' "
                          "WHERE name = 'memo-d'"))
    _due_again(pg_store)
    second = beat.tick()

    fired = {t.key.split("@")[0]: t.payload for t in second.triggers}
    assert sorted(fired) == ["memo-a", "memo-c"]
    assert fired["memo-a"]["args"] == [2, "y"]
    assert fired["memo-c"]["args"] == [1, "x"]
    assert second.quarantined == 2
    with pg_store.begin() as conn:
        rows = {r.name: r for r in conn.execute(select(entries))}
        assert {n for n, r in rows.items() if not r.enabled} == {"memo-b", "memo-d"}
        assert "options=" in rows["memo-b"].quarantine_reason
        assert "last_fire_at='infinity'" in rows["memo-d"].quarantine_reason
        assert {n: r.config_hash for n, r in rows.items()} == hashes
        stored = dict(conn.execute(
            select(runs.c.idempotency_key, runs.c.args).where(runs.c.entry_name == "memo-a")
        ).all())
        assert sorted(stored.values()) == [[1, "x"], [2, "y"]]
        assert conn.execute(select(outbox.c.id)).all() == []  # due: the runs are the record
        assert set(conn.execute(select(runs.c.state).where(
            runs.c.entry_name.in_(["memo-a", "memo-c"]))).scalars()) == {"scheduled"}
