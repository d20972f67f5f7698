"""``post_migrate``: keep reliable_beat's schema at head whenever ``manage.py migrate`` runs."""

from __future__ import annotations

from typing import Any

from reliable_beat.contrib.django import conf
from reliable_beat.redaction import get_logger

log = get_logger("reliable_beat.contrib.django")


def upgrade_for_alias(alias: str) -> bool:
    """Upgrade the store's schema to head if ``alias`` is the store's Django database.

    Returns:
        True when an upgrade ran (it is a no-op at head; safe from several processes).
    """
    if alias != conf.database_alias():
        return False
    # imported here: Alembic takes half a second to import, and only a migrate needs it
    from reliable_beat.db.migrate import upgrade

    store = conf.store()
    upgrade(store)
    log.info("reliable_beat schema at head on %s", store.safe_url)
    return True


def on_post_migrate(sender: Any, using: str = "default", **kwargs: Any) -> None:
    """Django's ``post_migrate`` for this app: see :func:`upgrade_for_alias`."""
    upgrade_for_alias(using)
