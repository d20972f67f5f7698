"""``reliable-beat status`` on a large store: a bounded text output (a fresh user's 20,000
entries printed 20,008 lines and no summary) and a statement count that does not grow with
the number of entries."""

from __future__ import annotations

import json
from datetime import timedelta

from click.testing import CliRunner, Result
from sqlalchemy import event
from sqlalchemy.engine import Connection

from reliable_beat import schedules as sch
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries
from reliable_beat.entries import EntryDefinition

N = 1200
DEFAULT_ENTRY_ROWS = 50  # reliable_beat.cli.status.DEFAULT_ENTRY_ROWS


def _seed(store: Store, n: int, *, missed: str | None = None) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        slot = (now + timedelta(minutes=30)).replace(microsecond=0)
        rows = []
        for i in range(n):
            name = f"big-{i:05d}"
            d = EntryDefinition(name=name, task="bigapp.work", args=[i],
                                schedule=sch.IntervalSchedule(timedelta(hours=1), slot))
            v = d.row_values()
            v.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                     paused=False, origin="runtime")
            if name == missed:  # overdue far beyond misfire_grace + margin: a missed slot
                v["next_fire_at"] = now - timedelta(hours=2)
            rows.append(v)
        conn.execute(entries.insert(), rows)


def _cli(store: Store, *args: str) -> Result:
    result = CliRunner().invoke(reliable_beat, ["--database-url", store.url, "status", *args],
                                catch_exceptions=False)
    assert result.exit_code in (0, 1), result.output
    return result


def test_text_status_is_bounded_and_summarises_the_rest(store: Store) -> None:
    _seed(store, N, missed="big-01111")
    out = _cli(store).output.splitlines()
    assert len(out) < DEFAULT_ENTRY_ROWS + 30, len(out)  # main printed one line per entry
    # the entry needing attention is listed although it sorts late by name
    assert any(line.startswith("big-01111 (MISSED)") for line in out), "\n".join(out[:80])
    rest = N - DEFAULT_ENTRY_ROWS
    assert f"... and {rest} more entries ({rest} active)" in "\n".join(out)
    assert f"entries: {DEFAULT_ENTRY_ROWS} shown of {N} ({N} active)" in out
    every = _cli(store, "--all").output.splitlines()
    assert sum(line.startswith("big-") for line in every) == N
    few = _cli(store, "--rows", "3").output.splitlines()
    assert sum(line.startswith("big-") for line in few) == 3
    data = json.loads(_cli(store, "--json").output)
    assert len(data["entries"]) == N  # JSON keeps every entry
    assert data["entry_counts"] == {"active": N}


def test_status_statements_do_not_grow_with_entries(store: Store) -> None:
    def statements() -> int:
        seen: list[str] = []

        def count(conn: Connection, cursor: object, statement: str, *args: object) -> None:
            seen.append(statement)

        event.listen(store.engine, "before_cursor_execute", count)
        try:
            collect_status(store)
        finally:
            event.remove(store.engine, "before_cursor_execute", count)
        return len(seen)

    _seed(store, 5)
    statements()  # warm: the first call also caches the store id
    few = statements()
    with store.begin() as conn:
        conn.execute(entries.delete())
    _seed(store, N)
    assert statements() == few  # not one per entry (1,200 entries)
