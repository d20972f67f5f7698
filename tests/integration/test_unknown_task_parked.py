"""A beat_schedule entry whose task the beat's app does not register (a typo) is parked at
the beat's sync, like a malformed row is quarantined: written disabled with the reason, never
fired (no `dispatched` run per slot that every worker drops), QUARANTINED in `status` (so
`status --check` fails) and `quarantined` in `entries list`. An entry that says its task is
registered by workers elsewhere (`task_elsewhere`) fires; once the task is registered (the
name fixed, or its module imported) the next beat start lifts the park.

Real beat ticks on the `store` fixture (SQLite, PostgreSQL, MariaDB). Fails on the old code:
the typo entry was synced enabled and its slot fired.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from click.testing import CliRunner
from sqlalchemy import select, update

from reliable_beat.cli import reliable_beat as rb_cli
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, runs
from reliable_beat.entries import EntryDefinition, definition_from_celery
from reliable_beat.loop import BeatLoop
from reliable_beat.settings import Settings
from tests.apps.quiet_handler import QuietHandler as _Publisher

SCHEDULE = {
    "ok": {"task": "shop.tick", "schedule": 60.0},
    "typo": {"task": "shop.tikc", "schedule": 60.0},
    "remote": {"task": "billing.close_day", "schedule": 60.0,
               "options": {"reliable_beat": {"task_elsewhere": True}}},
}


def _loop(store: Store, registered: set[str]) -> BeatLoop:
    def definitions(now: datetime) -> list[EntryDefinition]:
        return [definition_from_celery(name, raw, default_timezone="UTC", settings=Settings(),
                                       now=now, origin="config")
                for name, raw in SCHEDULE.items()]

    loop = BeatLoop(store, Settings(), _Publisher(), owner="t:1", definitions=definitions,
                    is_registered=registered.__contains__, schedule_group="shop")
    loop.stop_event = threading.Event()
    return loop


def _due_now_and_tick(store: Store, loop: BeatLoop) -> dict[str, int]:
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(entries).values(next_fire_at=now - timedelta(seconds=1)))
    loop.step()
    with store.connect() as conn:
        names = list(conn.execute(select(runs.c.entry_name)).scalars())
    return {name: names.count(name) for name in SCHEDULE}


def test_an_unregistered_task_is_parked_at_sync_and_never_fired(
        store: Store) -> None:
    loop = _loop(store, {"shop.tick"})
    assert loop.start() is True
    fired = _due_now_and_tick(store, loop)
    assert fired["typo"] == 0 and fired["ok"] >= 1 and fired["remote"] >= 1, fired
    with store.connect() as conn:
        row = conn.execute(select(entries.c.enabled, entries.c.quarantine_reason)
                           .where(entries.c.name == "typo")).one()
    assert row.enabled is False or row.enabled == 0
    assert "task 'shop.tikc' is not registered in this beat's app" in row.quarantine_reason
    assert "task_elsewhere" in row.quarantine_reason  # the fix for a task run elsewhere
    info = collect_status(store)
    assert [q["name"] for q in info["quarantined"]] == ["typo"]
    assert any(p.startswith("QUARANTINED") and "typo" in p for p in info["problems"])
    assert not info["ok"]  # status --check fails
    listing = CliRunner().invoke(rb_cli, ["--database-url", store.url, "entries", "list"])
    line = next(ln for ln in listing.output.splitlines() if ln.startswith("typo"))
    assert "quarantined" in line, listing.output
    # a restart with the same config keeps it parked (and when), never fires it
    loop.close()
    loop = _loop(store, {"shop.tick"})
    assert loop.start() is True
    assert _due_now_and_tick(store, loop)["typo"] == 0
    # the module is imported now (or the name fixed): the next start lifts the park
    loop.close()
    loop = _loop(store, {"shop.tick", "shop.tikc"})
    assert loop.start() is True
    assert _due_now_and_tick(store, loop)["typo"] >= 1
    assert collect_status(store)["quarantined"] == []
    loop.close()
