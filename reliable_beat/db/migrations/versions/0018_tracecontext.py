"""traceparent on outbox rows and workflows: the trace a delivery / an advance joins

An outbox row keeps the W3C ``traceparent`` of the span that wrote it (a slot's firing, a
task body, a workflow advance), so the relay's delivery span joins that trace; a workflow
keeps the ``traceparent`` of its start span, so every advance, activity, timer wake, signal
and compensation over its days is a span of one trace. NULL: written without tracing (or
before this revision): the delivery / advance starts a trace of its own.

Revision ID: 0018_tracecontext
Revises: 0017_wfrunaway
Create Date: 2026-12-12
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018_tracecontext"
down_revision = "0017_wfrunaway"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reliable_beat_outbox",
                  sa.Column("traceparent", sa.String(length=128), nullable=True))
    op.add_column("reliable_beat_workflows",
                  sa.Column("traceparent", sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column("reliable_beat_workflows", "traceparent")
    op.drop_column("reliable_beat_outbox", "traceparent")
