"""The Django test project's tables as SQLAlchemy Core (the tests create and read them)."""

from __future__ import annotations

import sqlalchemy as sa

_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # a rowid alias on SQLite
meta = sa.MetaData()
payouts = sa.Table(
    "dj_payouts", meta,
    sa.Column("id", _BigId, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("run_id", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)
audit = sa.Table(
    "dj_audit", meta,
    sa.Column("id", _BigId, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("what", sa.String(50), nullable=False),
)
progress = sa.Table(
    "dj_progress", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("what", sa.String(50), nullable=False),
)
