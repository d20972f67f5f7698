"""Store identity: which store a trigger came from.

Every store has one random id, written into ``reliable_beat_store`` by the migration that
creates its schema. Beats put it in each trigger's headers (:data:`STORE_HEADER`); an
``IdempotentTask`` compares it with its own store's id before claiming the run and refuses a
trigger from another store (a mixed deployment: a beat on the default SQLite file while
workers use PostgreSQL, or two hosts each on their own file). Without the check such a
trigger would run silently against the wrong store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import store_identity
from reliable_beat.errors import ConfigurationError

__all__ = ["STORE_HEADER", "ForeignStoreError", "store_id", "store_id_in"]

#: Trigger header carrying the id of the store the trigger's run was written to.
STORE_HEADER = "reliable_beat_store"



class ForeignStoreError(ConfigurationError):
    """A trigger was written to another store than the worker's (mixed deployment).

    The worker refuses it (CRITICAL log, a ``message`` dead letter in its own store) instead
    of running it against the wrong store. Fix: one ``reliable_beat_database_url`` for every
    beat, worker and relay.
    """


_cache: dict[str, str] = {}
_lock = threading.Lock()


def store_id(store: Store) -> str | None:
    """The store's id (32 hex digits), read once per process and URL.

    Returns:
        The id, or None when the schema predates store identity (not upgraded yet) or the
        table cannot be read: callers then skip the check rather than guess.

    Raises:
        StoreUnavailableError: the database cannot be reached.
    """
    def read() -> object:
        with store.connect() as conn:
            return conn.execute(select(store_identity.c.store_id).limit(1)).scalar()

    return _cached(store, read)


def store_id_in(conn: Connection, store: Store) -> str | None:
    """:func:`store_id` read through ``conn``, inside the caller's transaction (a savepoint:
    a schema without the table leaves the transaction usable). For code already inside a
    write transaction: on SQLite a second connection would wait for the write lock it
    holds. Cached per process and URL like :func:`store_id`."""
    def read() -> object:
        with conn.begin_nested():
            return conn.execute(select(store_identity.c.store_id).limit(1)).scalar()

    return _cached(store, read)


def _cached(store: Store, read: Callable[[], object]) -> str | None:
    """The store's cached id, else ``read()``'s value (cached when there is one); None when
    there is none or it cannot be read."""
    with _lock:
        found = _cache.get(store.url)
    if found is not None:
        return found
    try:
        value = read()
    except DBAPIError:
        return None
    if value is None:
        return None
    with _lock:
        _cache[store.url] = str(value)
    return str(value)
