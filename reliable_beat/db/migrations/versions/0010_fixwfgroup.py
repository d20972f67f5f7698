"""workflows and outbox: schedule_group (a workflow's messages go to its own app's broker)

Several apps with their own brokers may share one store. A workflow records the schedule
group of the app that started it (a child its parent's, a scheduled workflow its entry's),
and every outbox row it writes (wakes, activity messages, compensations, the sweep's
re-sends) carries that group: only the relays, beats and sweeps of that group publish it.
Rows with no group (stored before this revision, or written outside workflows) are
published by any, as before.

Revision ID: 0010_fixwfgroup
Revises: 0009_redispatch_backoff
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_fixwfgroup"
down_revision = "0009_redispatch_backoff"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        batch_op.add_column(sa.Column("schedule_group", sa.String(200), nullable=True))
    with op.batch_alter_table("reliable_beat_outbox", schema=None) as batch_op:
        batch_op.add_column(sa.Column("schedule_group", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_outbox", schema=None) as batch_op:
        batch_op.drop_column("schedule_group")
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        batch_op.drop_column("schedule_group")
