"""sagas and cancellation: reliable_beat_workflows.cancel_requested

Revision ID: 0008_sagas
Revises: 0007_wfversions
Create Date: 2026-12-01

Compensations are ordinary history rows (kind ``compensation``, new states ``registered`` and
``released`` fit the existing columns); the only new column records what a person asked for
(``workflows cancel`` / ``workflows compensate``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_sagas"
down_revision = "0007_wfversions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "reliable_beat_workflows",
        sa.Column("cancel_requested", sa.String(length=16), nullable=True),
    )


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflows") as batch:
        batch.drop_column("cancel_requested")
