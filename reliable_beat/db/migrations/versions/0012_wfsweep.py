"""workflow_events: redispatches, redispatched_at (the workflow sweep's re-sends back off)

The workflow sweep (:func:`reliable_beat.workflows.engine.redispatch_workflows`) re-sends the
message of an activity or compensation that no worker took, and wakes a workflow whose timer
is overdue. An activity message waiting in a backlogged queue looks exactly like a lost one,
and re-sending it once per ``redispatch_seconds`` window fed the very backlog that made it
look stuck (the RabbitMQ fault run). Like the run sweep since ``0009_redispatch_backoff``,
the k-th re-send of one event now waits ``redispatch_seconds * 2**k`` (k capped), counted on
the event row: an activity's run row does not exist before a worker claims its message.

Revision ID: 0012_wfsweep
Revises: 0011_relaywatch
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import reliable_beat.db.types

revision = "0012_wfsweep"
down_revision = "0011_relaywatch"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflow_events", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("redispatches", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column(
            "redispatched_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflow_events", schema=None) as batch_op:
        batch_op.drop_column("redispatched_at")
        batch_op.drop_column("redispatches")
