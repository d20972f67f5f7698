"""The schema upgrade how-to shows what `db upgrade` / `db current` / `db check` print today."""

from __future__ import annotations

from pathlib import Path

from reliable_beat.db import migrate

HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto.md"


def test_the_upgrade_howto_names_the_current_head() -> None:
    text = HOWTO.read_text()
    head = migrate.head()
    for shown in (f"schema at {head}", f"\n{head}\n", f"up to date ({head})"):
        assert shown in text, f"docs/howto.md should show {shown.strip()!r} (the head)"
