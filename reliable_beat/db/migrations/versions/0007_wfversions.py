"""workflows: version at start, a child's parent, a slot's entry; retention index

Revision ID: 0007_wfversions
Revises: 0006_workflows
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import reliable_beat.db.types

revision = "0007_wfversions"
down_revision = "0006_workflows"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        # @workflow(version=...) recorded at start; min_supported_version guards against it
        batch_op.add_column(sa.Column("version", sa.String(length=64), nullable=True))
        batch_op.create_index("ix_reliable_beat_workflows_finished_at", ["finished_at"],
                              unique=False)
        # a child workflow's parent event: its end completes (parent, run, seq) and wakes it
        batch_op.add_column(sa.Column("parent_pk", BigId, nullable=True))
        batch_op.add_column(sa.Column("parent_run_no", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("parent_seq", sa.Integer(), nullable=True))
        # started by a beat entry's slot (reliable_beat.workflow.start): the overlap policy
        batch_op.add_column(sa.Column("entry_name", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column(
            "fire_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True))
        batch_op.create_index("ix_reliable_beat_workflows_entry_name_state",
                              ["entry_name", "state"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_workflows_entry_name_state")
        batch_op.drop_column("fire_at")
        batch_op.drop_column("entry_name")
        batch_op.drop_column("parent_seq")
        batch_op.drop_column("parent_run_no")
        batch_op.drop_column("parent_pk")
        batch_op.drop_index("ix_reliable_beat_workflows_finished_at")
        batch_op.drop_column("version")
