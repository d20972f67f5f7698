"""MySQL/MariaDB: composite indexes standing for the partial due / pending indexes

MySQL and MariaDB have no partial indexes, so on them ``ix_reliable_beat_entries_due`` and
``ix_reliable_beat_outbox_pending`` are plain single-column indexes that also hold disabled
entries and sent outbox rows. These two serve the due-entry scan and the pending-outbox scan
as index ranges instead. Nothing happens on PostgreSQL and SQLite.

Revision ID: 0002_mariadb
Revises: 0002_groups
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0002_mariadb"
down_revision = "0002_groups"
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
    op.create_index("ix_reliable_beat_outbox_pending_mysql", "reliable_beat_outbox",
                    ["state", "available_at"], unique=False)


def downgrade() -> None:
    if not _mysql():
        return
    op.drop_index("ix_reliable_beat_outbox_pending_mysql", table_name="reliable_beat_outbox")
    op.drop_index("ix_reliable_beat_entries_due_mysql", table_name="reliable_beat_entries")
