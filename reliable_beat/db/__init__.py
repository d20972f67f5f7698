"""SQL store: tables, dialect quirks, hot statements and migrations."""

from __future__ import annotations

import logging

from reliable_beat.redaction import get_logger


class _NoPluginSetupChatter(logging.Filter):
    """Drops Alembic's ``setup plugin alembic.autogenerate.*`` INFO records.

    Alembic (1.18+) logs one per built-in autogenerate plugin when it is imported, which
    every command that reads the schema revision does: with a root logger at INFO (Django's
    ``LOGGING``) each ``reliable-beat`` / ``manage.py reliable_beat`` command printed seven
    such lines. Alembic's other records (``Running upgrade ...``) are kept.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO
                    and str(record.msg).startswith("setup plugin "))


# Attached before reliable_beat.db.migrate imports alembic (this package runs first).
get_logger("alembic.runtime.plugins").addFilter(_NoPluginSetupChatter())
