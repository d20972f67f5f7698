"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import reliable_beat.db.types

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reliable_beat_dead_letters",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("outbox_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("key", sa.String(length=400), nullable=False),
        sa.Column("entry_name", sa.String(length=200), nullable=True),
        sa.Column("task", sa.String(length=255), nullable=True),
        sa.Column("destination", sa.String(length=200), nullable=True),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("requeued_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("requeued_by", sa.String(length=200), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_dead_letters")),
    )
    with op.batch_alter_table("reliable_beat_dead_letters", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reliable_beat_dead_letters_created_at", ["created_at"], unique=False
        )

    op.create_table(
        "reliable_beat_entries",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("task", sa.String(length=255), nullable=False),
        sa.Column(
            "args",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "kwargs",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "options",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("schedule_kind", sa.String(length=16), nullable=False),
        sa.Column(
            "schedule",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("timezone", sa.String(length=64), server_default="UTC", nullable=False),
        sa.Column(
            "misfire_policy", sa.String(length=16), server_default="fire_once", nullable=False
        ),
        sa.Column("misfire_grace_seconds", sa.Float(), server_default="60", nullable=False),
        sa.Column("catch_up_limit", sa.Integer(), server_default="100", nullable=False),
        sa.Column("catch_up_window_seconds", sa.Float(), nullable=True),
        sa.Column("overlap_policy", sa.String(length=16), server_default="allow", nullable=False),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("paused_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("origin", sa.String(length=16), server_default="runtime", nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=True),
        sa.Column("start_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("end_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("next_fire_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("last_fire_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_entries")),
        sa.UniqueConstraint("name", name=op.f("uq_reliable_beat_entries_name")),
    )
    with op.batch_alter_table("reliable_beat_entries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reliable_beat_entries_due",
            ["next_fire_at"],
            unique=False,
            postgresql_where=sa.text("enabled AND NOT paused AND next_fire_at IS NOT NULL"),
            sqlite_where=sa.text("enabled AND NOT paused AND next_fire_at IS NOT NULL"),
        )

    op.create_table(
        "reliable_beat_outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("message_id", sa.String(length=400), nullable=False),
        sa.Column("destination", sa.String(length=200), nullable=False),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "headers",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("ordering_key", sa.String(length=200), nullable=True),
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("state", sa.String(length=16), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "available_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False
        ),
        sa.Column("claimed_by", sa.String(length=200), nullable=True),
        sa.Column("created_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("sent_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_outbox")),
        sa.UniqueConstraint("message_id", name=op.f("uq_reliable_beat_outbox_message_id")),
    )
    with op.batch_alter_table("reliable_beat_outbox", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reliable_beat_outbox_ordering_key_id", ["ordering_key", "id"], unique=False
        )
        batch_op.create_index(
            "ix_reliable_beat_outbox_pending",
            ["available_at"],
            unique=False,
            postgresql_where=sa.text("state = 'pending'"),
            sqlite_where=sa.text("state = 'pending'"),
        )
        batch_op.create_index(
            "ix_reliable_beat_outbox_state_sent_at", ["state", "sent_at"], unique=False
        )

    op.create_table(
        "reliable_beat_runs",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("idempotency_key", sa.String(length=400), nullable=False),
        sa.Column("entry_name", sa.String(length=200), nullable=True),
        sa.Column("fire_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("trigger", sa.String(length=16), server_default="schedule", nullable=False),
        sa.Column("task", sa.String(length=255), nullable=False),
        sa.Column(
            "args",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "kwargs",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("fence_token", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("leased_by", sa.String(length=200), nullable=True),
        sa.Column(
            "lease_expires_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "result",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column(
            "dispatched_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("started_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("finished_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_runs")),
        sa.UniqueConstraint(
            "entry_name", "fire_at", name=op.f("uq_reliable_beat_runs_entry_name_fire_at")
        ),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_reliable_beat_runs_idempotency_key")),
    )
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reliable_beat_runs_entry_name_created_at",
            ["entry_name", "created_at"],
            unique=False,
        )
        batch_op.create_index("ix_reliable_beat_runs_state", ["state"], unique=False)

    op.create_table(
        "reliable_beat_attempts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("fence_token", sa.BigInteger(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.Column("task_id", sa.String(length=64), nullable=True),
        sa.Column("started_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("finished_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("retry_in_seconds", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["reliable_beat_runs.id"],
            name=op.f("fk_reliable_beat_attempts_run_id_reliable_beat_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_attempts")),
    )
    with op.batch_alter_table("reliable_beat_attempts", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_reliable_beat_attempts_run_id"), ["run_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_reliable_beat_attempts_run_id"))

    op.drop_table("reliable_beat_attempts")
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_runs_state")
        batch_op.drop_index("ix_reliable_beat_runs_entry_name_created_at")

    op.drop_table("reliable_beat_runs")
    with op.batch_alter_table("reliable_beat_outbox", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_outbox_state_sent_at")
        batch_op.drop_index(
            "ix_reliable_beat_outbox_pending",
            postgresql_where=sa.text("state = 'pending'"),
            sqlite_where=sa.text("state = 'pending'"),
        )
        batch_op.drop_index("ix_reliable_beat_outbox_ordering_key_id")

    op.drop_table("reliable_beat_outbox")
    with op.batch_alter_table("reliable_beat_entries", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_reliable_beat_entries_due",
            postgresql_where=sa.text("enabled AND NOT paused AND next_fire_at IS NOT NULL"),
            sqlite_where=sa.text("enabled AND NOT paused AND next_fire_at IS NOT NULL"),
        )

    op.drop_table("reliable_beat_entries")
    with op.batch_alter_table("reliable_beat_dead_letters", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_dead_letters_created_at")

    op.drop_table("reliable_beat_dead_letters")
