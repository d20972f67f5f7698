"""MySQL/MariaDB: a composite index standing for the partial due-entry index

MySQL and MariaDB have no partial indexes, so on them ``ix_reliable_beat_entries_due`` is a
plain index on ``next_fire_at`` that also holds disabled and paused entries. This one,
(enabled, paused, next_fire_at), serves the due-entry claim and the earliest-next-fire read
as an index range instead. (The pending-outbox scan is served by the existing
``ix_reliable_beat_outbox_state_sent_at``: ``state = 'pending'`` is a ref of it.)
Nothing happens on PostgreSQL and SQLite.

Revision ID: 0005_composite_due_index
Revises: 0004_quarantine
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0005_composite_due_index"
down_revision = "0004_quarantine"
branch_labels = None
depends_on = None

MYSQL_DIALECTS = ("mysql", "mariadb")


def _mysql() -> bool:
    return op.get_context().dialect.name in MYSQL_DIALECTS


def upgrade() -> None:
    if not _mysql():
        return
    op.create_index("ix_reliable_beat_entries_due_mysql", "reliable_beat_entries",
                    ["enabled", "paused", "next_fire_at"], unique=False)


def downgrade() -> None:
    if not _mysql():
        return
    op.drop_index("ix_reliable_beat_entries_due_mysql", table_name="reliable_beat_entries")
