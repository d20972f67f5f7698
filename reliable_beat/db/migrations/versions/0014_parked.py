"""dead_letters: handled_at, handled_by (a failure the application handled by design)

A saga's forward step that dies leaves a run dead letter; when the saga's compensations all
complete, the failure was handled by design (the order was declined and undone). The dead
letter stays (visible in ``dead-letters list``, requeueable), but is marked handled: it no
longer counts in ``status --check`` nor in the ``reliable_beat_dead_letters`` metric.

Revision ID: 0014_parked
Revises: 0013_dashboard
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import reliable_beat.db.types

revision = "0014_parked"
down_revision = "0013_dashboard"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_dead_letters", schema=None) as batch_op:
        batch_op.add_column(sa.Column(
            "handled_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("handled_by", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_dead_letters", schema=None) as batch_op:
        batch_op.drop_column("handled_by")
        batch_op.drop_column("handled_at")
