"""A body's transaction in a Django project: on Django's connection by default, and no ORM
write on another connection inside it (design.md invariant 10).

The app registers :data:`JOIN` with :func:`reliable_beat.joins.register` in
``AppConfig.ready()``. Then, in an ``IdempotentTask`` (or ``IdempotentActor``) body:

* ``self.transaction()`` with no ``using=``/``bind=``/``session=`` is
  ``self.transaction(using=ALIAS)`` when the store is the database of Django alias ``ALIAS``
  (:meth:`DjangoJoin.default_alias`): the ORM writes in the block commit with the key;
* inside any such block, a statement on the connection of another alias that writes
  (:func:`.readonly.is_write`: ``INSERT``, ``UPDATE``, ``DELETE``, ``MERGE``, ``COPY``,
  ``CALL``, ``DO``, DDL ... anywhere in it) raises ``ConfigurationError`` before it reaches
  the database, naming ``using=``; every other statement there runs read-only at the
  database (:class:`.readonly.ReadOnly`), whose refusal of a write (``SELECT
  fn_that_inserts()``) is the same ``ConfigurationError`` (:meth:`DjangoJoin.guard`, one
  ``connection.execute_wrapper()`` per alias). Reads, savepoints and row locks there are
  let through.

The guard sees what goes through Django's cursors in this thread (the ORM, raw SQL on
``connections[alias].cursor()``); SQLAlchemy engines of your own and other threads are not
watched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from django.core.signals import setting_changed
from django.db import DEFAULT_DB_ALIAS, connections
from sqlalchemy.engine import Connection

from reliable_beat import runs
from reliable_beat.contrib.django import conf, db, readonly
from reliable_beat.contrib.django.readonly import is_write
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError
from reliable_beat.joins import same_database

__all__ = ["JOIN", "DjangoJoin", "is_write"]


class _RefuseWrites:
    """A Django execute wrapper on alias ``other`` refusing writes during a block."""

    def __init__(self, other: str, block: str | None, *, where: str, task_name: str,
                 store: Store, fix: str | None = None) -> None:
        self.other, self.block, self.where = other, block, where
        self.task_name, self.store, self.fix = task_name, store, fix
        self.read_only = readonly.ReadOnly(connections[other])

    def __call__(self, execute: Callable[..., Any], sql: Any, params: Any, many: bool,
                 context: Any) -> Any:
        raw = context["connection"].connection
        if is_write(sql, raw):
            raise ConfigurationError(self.message(readonly.statement_text(sql, raw) or sql))
        self.read_only.before()
        try:
            return execute(sql, params, many, context)
        except Exception as exc:
            if readonly.refused_by_database(exc):
                raise ConfigurationError(
                    self.message(readonly.statement_text(sql, raw) or sql,
                                 by=f"the database refused it ({exc.__cause__ or exc})".strip())
                ) from exc
            raise

    def message(self, sql: Any, *, by: str = "") -> str:
        other, block, where = self.other, self.block, self.where
        statement = " ".join(str(sql).split())[:160]
        refused = f"refused: {' '.join(by.split())[:200]}" if by else "refused"
        head = (f"{self.task_name}: a write on Django database {other!r} inside {where}() "
                "would commit on its own connection, outside the transaction of the "
                "idempotency key (a retry, a redelivery or a stale runner writes it again); "
                f"{refused}")
        if self.fix is not None:
            return f"{head}. {self.fix}. Statement: {statement}"
        if block is not None:
            return (
                f"{head}. The block runs in Django's transaction on {block!r}: write through "
                f"it (Model.objects.using({block!r}), or a router that picks it), or, when "
                f"{other!r} is the store's database, open the block there with "
                f"{where}(using={other!r}); a write that may repeat goes after the block. "
                f"Statement: {statement}"
            )
        return (
            f"{head}. The block runs on a connection of the store ({self.store.safe_url}), "
            "not on Django's. Make the store this Django database (without a "
            "reliable_beat_database_url setting the store is DATABASES[RELIABLE_BEAT"
            "['DATABASE_ALIAS'] or 'default']): the block then joins it, or name it with "
            f"{where}(using={other!r}); else write the effect on the block's connection "
            "(tx.execute(...)), or after the block if it may repeat. "
            f"Statement: {statement}"
        )


class DjangoJoin:
    """Django's connections for a body's transaction (:class:`reliable_beat.joins.Join`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aliases: dict[str, str | None] = {}
        self._unloadable: set[str] = set()
        setting_changed.connect(self._forget, weak=False,
                                dispatch_uid="reliable_beat_join_setting_changed")

    def _forget(self, **_: Any) -> None:
        with self._lock:
            self._aliases.clear()
            self._unloadable.clear()

    def default_alias(self, store: Store) -> str | None:
        """The Django alias whose database is ``store``'s and whose connection can be lent
        (PostgreSQL, SQLite): ``RELIABLE_BEAT["DATABASE_ALIAS"]`` first, then
        ``"default"``, then the others in ``DATABASES`` order; None when none is."""
        key = store.engine.url.render_as_string(hide_password=True)
        with self._lock:
            if key in self._aliases:
                return self._aliases[key]
        found: str | None = None
        preferred = [conf.database_alias(), DEFAULT_DB_ALIAS]
        for alias in dict.fromkeys(preferred + list(connections.settings)):
            if alias not in connections.settings:
                continue
            try:
                driver = db._driver_of(alias)
                url = db._url(alias, driver, for_store=False)
            except ConfigurationError:
                continue  # MySQL, Oracle, an in-memory SQLite: cannot be lent
            if same_database(url, store.engine.url):
                found = alias
                break
        with self._lock:
            self._aliases[key] = found
        return found

    def atomic(self, alias: str) -> Any:
        """:func:`reliable_beat.contrib.django.db.atomic_connection`."""
        return db.atomic_connection(alias)

    def alias_of(self, conn: Connection) -> str | None:
        """The alias whose connection ``conn`` lends (from :meth:`atomic`), or None."""
        return db.lent_alias(conn.engine)

    def _guarded(self, block: str | None) -> list[str]:
        names = []
        for alias in connections.settings:
            if alias == block or alias in self._unloadable:
                continue
            try:
                connections[alias]  # this thread's wrapper (no connection is opened)
            except Exception:  # its backend cannot be loaded: the ORM cannot write there
                with self._lock:
                    self._unloadable.add(alias)
                continue
            names.append(alias)
        return names

    @contextmanager
    def guard(self, alias: str | None, *, where: str, task_name: str, store: Store,
              fix: str | None = None) -> Iterator[None]:
        """Refuse writes on every Django connection but ``alias``'s for the block (the
        message says what to do: ``fix``, else how to use ``using=``)."""
        with ExitStack() as stack:
            for other in self._guarded(alias):
                refuse = _RefuseWrites(other, alias, where=where, task_name=task_name,
                                       store=store, fix=fix)
                stack.callback(refuse.read_only.restore)
                stack.enter_context(connections[other].execute_wrapper(refuse))
            yield

    def result_writer(self, alias: str, store: Store,
                      claim: runs.Claim) -> Callable[[Any], None] | None:
        """:func:`reliable_beat.contrib.django.db.result_writer`."""
        return db.result_writer(alias, store, claim)


#: The join the app registers (:mod:`reliable_beat.joins`).
JOIN = DjangoJoin()
