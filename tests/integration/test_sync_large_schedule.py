"""A large ``beat_schedule`` syncs in a bounded number of statements, with the same outcome.

A fresh user's 20,000-entry ``beat_schedule`` took 4 min 11 s to sync on a loaded machine (a
read, and an insert, per entry), holding the sync lock every other beat of the group waits
for at start, and even an unchanged config (every beat restart) re-read each entry with its
own statement: 5,000 entries took 34 s to change nothing. Now a sync reads and locks 500
names per statement and inserts the new ones in multi-row statements.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import event, func, select

from reliable_beat import schedules as sch
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries
from reliable_beat.entries import EntryDefinition, sync_schedule_group

N = 1_200


def _defs(n: int, *, changed: int | None = None) -> list[EntryDefinition]:
    cron = sch.schedule_from_spec({"kind": "cron", "expr": "26 * * * *", "timezone": "UTC"})
    out = []
    for i in range(n):
        d = EntryDefinition(name=f"big-{i:05d}", task="t.big", schedule=cron, origin="config",
                            kwargs={"i": i})
        if i == changed:
            d.kwargs = {"i": i, "changed": True}
        out.append(d)
    return out


@contextmanager
def _statements(store: Store) -> Iterator[list[str]]:
    seen: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", count)


def test_a_large_schedule_syncs_in_a_bounded_number_of_statements(store: Store) -> None:
    with _statements(store) as first:
        result = sync_schedule_group(store, _defs(N), group="big")
    assert result.counts["inserted"] == N
    # on the old code: one read and one insert per entry (> 2,400 statements)
    assert len(first) < 60, f"{len(first)} statements to insert {N} entries"

    with _statements(store) as again:
        result = sync_schedule_group(store, _defs(N), group="big")
    assert result.outcome == "current" and result.counts["unchanged"] == N
    assert len(again) < 40, f"{len(again)} statements to change nothing in {N} entries"

    with _statements(store) as one:
        result = sync_schedule_group(store, _defs(N, changed=7), group="big")
    assert result.counts["updated"] == 1 and result.counts["unchanged"] == N - 1
    assert len(one) < 45, f"{len(one)} statements to update 1 of {N} entries"

    with store.begin() as conn:
        stored = conn.execute(
            select(func.count()).select_from(entries).where(
                entries.c.schedule_group == "big", entries.c.enabled.is_(True))
        ).scalar_one()
        changed = conn.execute(
            select(entries.c.kwargs).where(entries.c.name == "big-00007")).scalar_one()
        nexts = set(conn.execute(select(entries.c.next_fire_at).where(
            entries.c.schedule_group == "big")).scalars())
    assert stored == N
    assert changed == {"i": 7, "changed": True}
    # every new entry starts on the same slot of its grid: the next :26
    assert len(nexts) == 1
    (nxt,) = nexts
    assert nxt.minute == 26 and nxt.second == 0


def test_the_same_name_twice_in_one_sync_is_one_entry(store: Store) -> None:
    """A list of definitions (not a dict) may name an entry twice: the later one wins, as
    when each was upserted in turn."""
    cron = sch.schedule_from_spec({"kind": "cron", "expr": "0 * * * *", "timezone": "UTC"})
    every = sch.schedule_from_spec({"kind": "cron", "expr": "*/5 * * * *", "timezone": "UTC"})
    defs = [EntryDefinition(name="twice", task="t.a", schedule=cron, origin="config"),
            EntryDefinition(name="other", task="t.b", schedule=every, origin="config"),
            EntryDefinition(name="twice", task="t.c", schedule=cron, origin="config")]
    sync_schedule_group(store, defs, group="dup")
    with store.begin() as conn:
        rows = conn.execute(select(entries.c.name, entries.c.task).where(
            entries.c.schedule_group == "dup").order_by(entries.c.name)).all()
    assert [tuple(r) for r in rows] == [("other", "t.b"), ("twice", "t.c")]
