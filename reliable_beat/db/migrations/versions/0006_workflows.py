"""durable workflows: workflows, their events (the history), signals

Revision ID: 0006_workflows
Revises: 0005_composite_due_index
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import reliable_beat.db.types

revision = "0006_workflows"
down_revision = "0005_composite_due_index"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
ACTIVE = "state IN ('pending', 'running', 'waiting')"


def _instant(name: str, nullable: bool) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, reliable_beat.db.types.UTCDateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "reliable_beat_workflows",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("workflow_id", sa.String(length=400), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("run_no", sa.Integer(), server_default="1", nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("args", JSON, nullable=False),
        sa.Column("kwargs", JSON, nullable=False),
        sa.Column("result", JSON, nullable=True),
        sa.Column("error", JSON, nullable=True),
        sa.Column("block_reason", sa.Text(), nullable=True),
        sa.Column("queue", sa.String(length=200), nullable=True),
        sa.Column("random_seed", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("fence_token", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("leased_by", sa.String(length=200), nullable=True),
        _instant("lease_expires_at", True),
        sa.Column("wake_seq", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("claimed_wake_seq", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("history_len", sa.Integer(), server_default="0", nullable=False),
        sa.Column("history_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("advances", sa.Integer(), server_default="0", nullable=False),
        _instant("created_at", False),
        _instant("updated_at", False),
        _instant("finished_at", True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_workflows")),
        sa.UniqueConstraint("workflow_id", name=op.f("uq_reliable_beat_workflows_workflow_id")),
    )
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reliable_beat_workflows_active", ["updated_at"], unique=False,
            postgresql_where=sa.text(ACTIVE), sqlite_where=sa.text(ACTIVE),
        )
        batch_op.create_index(
            "ix_reliable_beat_workflows_name_state", ["name", "state"], unique=False
        )
    op.create_table(
        "reliable_beat_workflow_events",
        sa.Column("workflow_pk", BigId, nullable=False),
        sa.Column("run_no", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=True),
        sa.Column("args_digest", sa.String(length=16), nullable=False),
        sa.Column("args", JSON, nullable=True),
        sa.Column("state", sa.String(length=12), nullable=False),
        sa.Column("result", JSON, nullable=True),
        sa.Column("error", JSON, nullable=True),
        _instant("fire_at", True),
        sa.Column("run_key", sa.String(length=400), nullable=True),
        sa.Column("fence_token", sa.BigInteger(), nullable=False),
        _instant("created_at", False),
        _instant("completed_at", True),
        sa.ForeignKeyConstraint(
            ["workflow_pk"], ["reliable_beat_workflows.id"],
            name=op.f("fk_reliable_beat_workflow_events_workflow_pk_reliable_beat_workflows"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "workflow_pk", "run_no", "seq", name=op.f("pk_reliable_beat_workflow_events")
        ),
    )
    op.create_table(
        "reliable_beat_workflow_signals",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("workflow_pk", BigId, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("payload", JSON, nullable=True),
        sa.Column("dedup_key", sa.String(length=400), nullable=True),
        sa.Column("consumed_run_no", sa.Integer(), nullable=True),
        sa.Column("consumed_seq", sa.Integer(), nullable=True),
        _instant("created_at", False),
        sa.ForeignKeyConstraint(
            ["workflow_pk"], ["reliable_beat_workflows.id"],
            name=op.f("fk_reliable_beat_workflow_signals_workflow_pk_reliable_beat_workflows"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_workflow_signals")),
        sa.UniqueConstraint(
            "dedup_key", name=op.f("uq_reliable_beat_workflow_signals_dedup_key")
        ),
    )
    with op.batch_alter_table("reliable_beat_workflow_signals", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reliable_beat_workflow_signals_workflow_pk_name_id",
            ["workflow_pk", "name", "id"], unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflow_signals", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_workflow_signals_workflow_pk_name_id")
    op.drop_table("reliable_beat_workflow_signals")
    op.drop_table("reliable_beat_workflow_events")
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_workflows_name_state")
        batch_op.drop_index("ix_reliable_beat_workflows_active")
    op.drop_table("reliable_beat_workflows")
