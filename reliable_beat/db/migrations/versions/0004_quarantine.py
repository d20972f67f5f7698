"""entries: quarantine_reason and quarantined_at (malformed rows are quarantined, issue 12)

Revision ID: 0004_quarantine
Revises: 0003_store_identity
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import reliable_beat.db.types

revision = "0004_quarantine"
down_revision = "0003_store_identity"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_entries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("quarantine_reason", sa.Text(), nullable=True))
        batch_op.add_column(
            sa.Column(
                "quarantined_at",
                reliable_beat.db.types.UTCDateTime(timezone=True),
                nullable=True,
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_entries", schema=None) as batch_op:
        batch_op.drop_column("quarantined_at")
        batch_op.drop_column("quarantine_reason")
