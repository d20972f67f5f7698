"""traceparent on workflow signals: the advance that consumes a signal links to its sender

A signal row keeps the W3C ``traceparent`` of the ``signal <name>`` span that stored it (itself
linked to the caller's span), so the ``receive signal <name>`` span of the advance that
consumes it links back to it. NULL: stored without tracing (or before this revision): the
receive span has no such link.

Revision ID: 0019_signaltrace
Revises: 0018_tracecontext
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_signaltrace"
down_revision = "0018_tracecontext"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reliable_beat_workflow_signals",
                  sa.Column("traceparent", sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column("reliable_beat_workflow_signals", "traceparent")
