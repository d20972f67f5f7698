"""Workflow start and signal on both dialects: each writes its wake message with the row
(PostgreSQL once reported no rowcount for INSERT ... ON CONFLICT DO NOTHING, so the start and
the signal were stored without their wake and only the re-dispatch sweep woke them)."""

from __future__ import annotations

import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.workflows import engine


def _wakes(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return sorted(conn.execute(sa.text(
            "SELECT message_id FROM reliable_beat_outbox WHERE message_id LIKE 'wake:%'"
        )).scalars())


def test_start_and_signal_write_their_wake_messages(store: Store) -> None:
    """On every dialect, MariaDB included (it was refused with a ConfigurationError before
    the engine's statements stopped relying on ``UPDATE ... RETURNING``)."""
    handle = engine.start(store, "x.flow", "order:1", [1])
    assert handle.created
    assert _wakes(store) == ["wake:order:1:start"]
    again = engine.start(store, "x.flow", "order:1", [1])
    assert not again.created and _wakes(store) == ["wake:order:1:start"]
    assert engine.signal(store, "order:1", "go", {"v": 1}, key="k1") is True
    assert engine.signal(store, "order:1", "go", {"v": 2}, key="k1") is False  # dedup
    assert _wakes(store) == ["wake:order:1:s2", "wake:order:1:start"]
    row = engine.get_workflow(store, "order:1", events=True)
    assert [s["payload"] for s in row["signals"]] == [{"v": 1}]
