"""store identity; index for the retention purge of runs

Revision ID: 0003_store_identity
Revises: 0002_groups
Create Date: 2026-12-01

* ``reliable_beat_store``: one row, a random ``store_id`` written when the schema is created
  (or upgraded to this revision). Beats carry it in every trigger's headers
  (``reliable_beat_store``); a worker whose own store has another id refuses the trigger
  (mixed stores, e.g. a beat on the default SQLite file while workers use PostgreSQL).
* ``ix_reliable_beat_runs_created_at``: the retention purge finds old runs by ``created_at``.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

import reliable_beat.db.types

revision = "0003_store_identity"
down_revision = "0002_groups"
branch_labels = None
depends_on = None


def upgrade() -> None:
    store = op.create_table(
        "reliable_beat_store",
        sa.Column("store_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", reliable_beat.db.types.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("store_id", name=op.f("pk_reliable_beat_store")),
    )
    op.bulk_insert(store, [{"store_id": uuid.uuid4().hex,
                            "created_at": datetime.now(timezone.utc)}])
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.create_index("ix_reliable_beat_runs_created_at", ["created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_reliable_beat_runs_created_at")
    op.drop_table("reliable_beat_store")
