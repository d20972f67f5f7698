"""schedule groups: entries.schedule_group / disabled_at, schedule configs, beat heartbeats

Revision ID: 0002_groups
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import reliable_beat.db.types

revision = "0002_groups"
down_revision = "0001"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _instant(name: str, nullable: bool) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(name, reliable_beat.db.types.UTCDateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_entries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("schedule_group", sa.String(length=200), nullable=True))
        batch_op.add_column(_instant("disabled_at", True))
        batch_op.create_index(
            "ix_reliable_beat_entries_schedule_group", ["schedule_group"], unique=False
        )

    op.create_table(
        "reliable_beat_schedule_configs",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("schedule_group", sa.String(length=200), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("entry_names", JSON, nullable=False),
        _instant("first_synced_at", False),
        _instant("synced_at", False),
        sa.Column("synced_by", sa.String(length=200), nullable=True),
        _instant("superseded_at", True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reliable_beat_schedule_configs")),
        sa.UniqueConstraint(
            "schedule_group", "config_hash",
            name=op.f("uq_reliable_beat_schedule_configs_schedule_group_config_hash"),
        ),
    )
    op.create_table(
        "reliable_beat_beats",
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("schedule_group", sa.String(length=200), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=True),
        _instant("started_at", False),
        _instant("seen_at", False),
        _instant("stopped_at", True),
        sa.Column("unregistered", JSON, nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_reliable_beat_beats")),
    )
    with op.batch_alter_table("reliable_beat_beats", schema=None) as batch_op:
        batch_op.create_index(
            "ix_reliable_beat_beats_schedule_group_seen_at",
            ["schedule_group", "seen_at"], unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_beats", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_beats_schedule_group_seen_at")
    op.drop_table("reliable_beat_beats")
    op.drop_table("reliable_beat_schedule_configs")
    with op.batch_alter_table("reliable_beat_entries", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_entries_schedule_group")
        batch_op.drop_column("disabled_at")
        batch_op.drop_column("schedule_group")
