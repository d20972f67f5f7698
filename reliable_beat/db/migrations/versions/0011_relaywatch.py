"""beats: role and destinations (relays record a heartbeat too); schedule_group nullable

Relays now keep a row in ``reliable_beat_beats`` the way beats do (owner id, schedule group,
heartbeat), so ``reliable-beat status`` can tell a schedule group whose outbox rows no live
relay or beat publishes. ``role`` is ``beat`` (every row before this revision) or ``relay``;
``destinations`` lists a relay's handler destinations (NULL for beats); ``schedule_group``
becomes nullable: a relay without an app claims the rows of every group.

Revision ID: 0011_relaywatch
Revises: 0010_fixwfgroup
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011_relaywatch"
down_revision = "0010_fixwfgroup"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("reliable_beat_beats", schema=None) as batch_op:
        batch_op.add_column(sa.Column("role", sa.String(length=16), nullable=False,
                                      server_default="beat"))
        batch_op.add_column(sa.Column("destinations", JSON, nullable=True))
        batch_op.alter_column("schedule_group", existing_type=sa.String(length=200),
                              nullable=True)


def downgrade() -> None:
    # relay rows are heartbeats only (no history): drop them, then the columns
    op.execute(sa.text("DELETE FROM reliable_beat_beats WHERE role <> 'beat'"))
    with op.batch_alter_table("reliable_beat_beats", schema=None) as batch_op:
        batch_op.alter_column("schedule_group", existing_type=sa.String(length=200),
                              nullable=False)
        batch_op.drop_column("destinations")
        batch_op.drop_column("role")
