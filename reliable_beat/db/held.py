"""One pooled connection for an execution's claim and its own transaction.

An ``IdempotentTask`` execution claims its run (one autocommit statement on PostgreSQL) and
then opens one transaction on the store for the body's effect and the fenced completion
(``self.transaction()``, or the completion after a body that opened none). Each was a pool
check-out and check-in of its own. Inside :func:`holding`, the claim's connection stays
checked out and that one transaction runs on it: one check-out per execution.

It changes no statement and no transaction boundary: the claim is still committed before
the body runs (its lease and fence visible to every runner), the completion still checks
the fence inside the effect's transaction. The connection is lent only:

* on PostgreSQL;
* when the pool has room (fewer than ``size - 1`` connections checked out besides it), so
  holding one during a body never pushes other threads into overflow connections;
* to the transaction of the claim it served (:meth:`Held.begin` with that claim), when the
  connection is not inside a transaction and was last used less than the worker's
  ping-after-idle window ago (:data:`~reliable_beat.db.dialects.PING_AFTER_IDLE_SECONDS`):
  a connection that sat longer goes back to the pool, which pings it on the next check-out;
* once: after that transaction, or at the end of the block, it goes back to the pool.

Otherwise everything takes its connection from the pool as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from sqlalchemy.engine import Connection

from reliable_beat.db.dialects import PING_AFTER_IDLE_SECONDS, Store

__all__ = ["Held", "holding", "lent"]

#: How long a held connection may sit unused and still be lent (the worker's ping window).
_FRESH_SECONDS = PING_AFTER_IDLE_SECONDS.get("worker", 1.0)

_local = threading.local()


class Held:
    """The connection held in one :func:`holding` block (at most one at a time)."""

    def __init__(self) -> None:
        self.store: Store | None = None
        self.owner: object = None
        self.conn: Connection | None = None
        self._cm: AbstractContextManager[Connection] | None = None
        self._used_at = 0.0

    def take(self, store: Store) -> Connection | None:
        """Check a connection out of ``store``'s pool and hold it, or None (one is held
        already, another dialect, or the pool has no room)."""
        if self.conn is not None or store.dialect != "postgresql":
            return None
        pool: Any = store.engine.pool
        size, out = getattr(pool, "size", None), getattr(pool, "checkedout", None)
        if size is None or out is None or out() >= size() - 1:
            return None
        self._cm = store.connect()
        self.conn = self._cm.__enter__()
        self.store = store
        self._used_at = time.monotonic()
        return self.conn

    def served(self, owner: object) -> None:
        """The held connection served ``owner`` (a claim): :meth:`begin` lends it to it."""
        self.owner = owner
        self._used_at = time.monotonic()

    def failed(self, exc: BaseException) -> None:
        """The statement on the held connection raised ``exc``: give the connection back the
        way ``with store.connect()`` would (its error translation may raise instead)."""
        cm, self._cm, self.conn, self.owner = self._cm, None, None, None
        if cm is not None:
            cm.__exit__(type(exc), exc, exc.__traceback__)

    def release(self) -> None:
        """Back to the pool (no-op when nothing is held)."""
        cm, self._cm, self.conn, self.owner = self._cm, None, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def lendable(self, store: Store, owner: object) -> Connection | None:
        """The held connection, when it may carry ``owner``'s transaction on ``store``."""
        conn = self.conn
        if conn is None or self.store is not store or self.owner is not owner:
            return None
        if (conn.invalidated or conn.in_transaction()
                or time.monotonic() - self._used_at > _FRESH_SECONDS):
            self.release()
            return None
        return conn


def current() -> Held | None:
    """The :class:`Held` of this thread's innermost :func:`holding` block, or None."""
    return getattr(_local, "held", None)


@contextmanager
def holding() -> Iterator[Held]:
    """Within the block, a claim may hold its connection for its own transaction; released
    at the end. Nested blocks share the outer one's."""
    outer = current()
    if outer is not None:
        yield outer
        return
    held = _local.held = Held()
    try:
        yield held
    finally:
        _local.held = None
        held.release()


@contextmanager
def lent(store: Store, owner: object) -> Iterator[Connection]:
    """``store.begin()``, on the connection held for ``owner`` when there is one (then given
    back to the pool after the transaction)."""
    held = current()
    conn = held.lendable(store, owner) if held is not None else None
    if conn is None or held is None:
        with store.begin() as tx:
            yield tx
        return
    try:
        with store._unavailable_on_disconnect(), conn.begin():
            yield conn
    finally:
        held.release()
