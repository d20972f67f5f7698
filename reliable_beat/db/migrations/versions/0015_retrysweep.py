"""runs.retry_at: when a ``retrying`` run's next try is due (the run sweep re-sends it then)

A run waits in ``retrying`` for its retry message. When that message is lost (a retry the
framework dropped, a broker that lost it, a fenced-out attempt that sends none), the
re-dispatch sweep re-sends the run. It used to count from ``updated_at`` plus the retry cap
(12 min at the defaults), while ``status`` raised RETRY OVERDUE from the retry's due time, so
the alarm fired before anything was done. ``retry_at`` is that due time (the retry's
countdown end, or the sweep's last re-send): the sweep re-sends ``redispatch_seconds`` after
it, doubling per re-send, and ``status`` alarms only when a re-send did not help. NULL on
rows written before this revision: the sweep counts from ``updated_at`` plus the cap, as
before.

Revision ID: 0015_retrysweep
Revises: 0014_parked
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import reliable_beat.db.types

revision = "0015_retrysweep"
down_revision = "0014_parked"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column(
            "retry_at", reliable_beat.db.types.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_runs", schema=None) as batch_op:
        batch_op.drop_column("retry_at")
