"""workflows: takeovers (an advance whose lease keeps expiring parks its workflow)

An advance that never returns (workflow code stuck outside Python, a step that hangs, a
worker that dies each time) let its lease expire; the workflow sweep re-sent its wake and
the next worker took it over, again and again, until every worker held one. ``takeovers``
counts the claims that took over an expired advance since the last advance that finished;
past ``reliable_beat_workflow_max_takeovers`` the workflow is parked ``blocked`` instead of
handed to one more worker (:mod:`reliable_beat.workflows.runaway`).

Revision ID: 0017_wfrunaway
Revises: 0016_signalkey
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_wfrunaway"
down_revision = "0016_signalkey"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("takeovers", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("reliable_beat_workflows", schema=None) as batch_op:
        batch_op.drop_column("takeovers")
