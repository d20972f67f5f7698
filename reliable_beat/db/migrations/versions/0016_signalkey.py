"""workflow_signals: a dedup key is unique per workflow, not per store

``signal(store, "A", "go", key="approve")`` and then the same key for workflow B used to
return False and store nothing (the key was unique across the store): B waited for ever for
a signal its sender believed delivered. The unique constraint becomes
``(workflow_pk, dedup_key)``.

Safe with existing rows: keys unique across the store are unique per workflow, so the new
constraint is created (first) from rows that already satisfy it, then the old one dropped.
PostgreSQL builds the new unique index while inserts into the signals table wait (a short
lock on a small table); MariaDB/MySQL add it in place; SQLite copies the table (batch mode).

Rolling deploy (schema first, then code): a process still on the older code keeps working on
this schema. Its insert is ``ON CONFLICT DO NOTHING`` / ``INSERT IGNORE`` with no named
constraint, so it deduplicates per workflow too; the only change it sees is that a key
another workflow used is stored instead of silently dropped.

Revision ID: 0016_signalkey
Revises: 0015_retrysweep
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_signalkey"
down_revision = "0015_retrysweep"
branch_labels = None
depends_on = None

TABLE = "reliable_beat_workflow_signals"


def upgrade() -> None:
    with op.batch_alter_table(TABLE, schema=None) as batch_op:
        batch_op.create_unique_constraint(
            op.f("uq_reliable_beat_workflow_signals_workflow_pk_dedup_key"),
            ["workflow_pk", "dedup_key"],
        )
        batch_op.drop_constraint(
            op.f("uq_reliable_beat_workflow_signals_dedup_key"), type_="unique"
        )


def downgrade() -> None:
    shared = op.get_bind().execute(sa.text(
        f"SELECT dedup_key FROM {TABLE} WHERE dedup_key IS NOT NULL "
        "GROUP BY dedup_key HAVING COUNT(*) > 1"
    )).scalars().first()
    if shared is not None:
        raise RuntimeError(
            f"cannot downgrade below 0016_signalkey: dedup key {shared!r} is used by more "
            "than one workflow's signals, and the older schema allows one key per store; "
            f"delete or rename the extra rows of {TABLE} first"
        )
    with op.batch_alter_table(TABLE, schema=None) as batch_op:
        batch_op.create_unique_constraint(
            op.f("uq_reliable_beat_workflow_signals_dedup_key"), ["dedup_key"]
        )
        batch_op.drop_constraint(
            op.f("uq_reliable_beat_workflow_signals_workflow_pk_dedup_key"), type_="unique"
        )
