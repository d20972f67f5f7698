"""operator_actions: who did what, when, through the dashboard

Every action the web dashboard takes (pause, resume, trigger, backfill, requeue a dead
letter, clear a lease) is recorded here: who (the authenticated name), with which role, what
(the action and its target), when (the store's clock), from where, and how it ended. Rows are
never purged automatically.

Revision ID: 0013_dashboard
Revises: 0012_wfsweep
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import reliable_beat.db.types

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

revision = "0013_dashboard"
down_revision = "0012_wfsweep"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reliable_beat_operator_actions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True,
                  nullable=False),
        sa.Column("at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=400), nullable=False),
        sa.Column("detail", JSON, nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("remote", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_operator_actions")),
    )
    op.create_index(op.f("ix_reliable_beat_operator_actions_at"),
                    "reliable_beat_operator_actions", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_reliable_beat_operator_actions_at"),
                  table_name="reliable_beat_operator_actions")
    op.drop_table("reliable_beat_operator_actions")
