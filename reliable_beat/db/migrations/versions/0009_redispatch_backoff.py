"""runs: redispatches (how many times the run's trigger was re-sent; re-sends back off)

A run whose trigger waits in a backlogged queue looks exactly like one whose message the
broker lost: ``dispatched`` and unclaimed. Re-sending it every ``redispatch_seconds`` adds a
duplicate message per stuck run per period to the very backlog that made it look stuck
(a congestion collapse, found by the fault run on RabbitMQ). The k-th re-send of a run now
waits ``redispatch_seconds * 2**k`` (k capped), which needs the count per run.

Revision ID: 0009_redispatch_backoff
Revises: 0008_sagas
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_redispatch_backoff"
down_revision = "0008_sagas"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("redispatches", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.drop_column("redispatches")
