"""``self.transaction()``: the body's transaction of an ``IdempotentTask``.

The body's effect, its outbox rows and the run's fenced completion commit in one
transaction on the store's database (design.md invariants 1 and 5): on the store's own
engine, on the caller's ``Engine`` / ``Connection`` / ``Session``, or on Django's connection
(``using=``, :mod:`reliable_beat.joins`). :class:`_BodyTransaction` is a base class of
:class:`~reliable_beat.celery.task.IdempotentTask`; the task's execution (claim, lease,
completion when the body opened no transaction) is in :mod:`reliable_beat.celery.task`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from celery import Task
from sqlalchemy.engine import Connection, Engine

from reliable_beat import handoff, joins, runs, tracing
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ConfigurationError, StaleFenceToken
from reliable_beat.execution import _renewer, _RunState
from reliable_beat.execution import storable_result as _storable_result
from reliable_beat.redaction import get_logger

__all__: list[str] = []

#: The task's logger: its records keep the name users configure.
log = get_logger("reliable_beat.celery.task")


class _BodyTransaction(Task):  # type: ignore[misc]
    """A base class of :class:`~reliable_beat.celery.task.IdempotentTask`:
    ``self.transaction()`` and ``self.returns()``."""

    if TYPE_CHECKING:  # defined by IdempotentTask

        def _state(self) -> _RunState: ...

    @contextmanager
    def transaction(
        self, *, bind: Engine | Connection | None = None, session: Any = None,
        using: str | None = None,
    ) -> Iterator[Connection]:
        """One transaction for the body's effect; leaving the block completes the run.

        Yields a SQLAlchemy ``Connection`` inside a transaction. On normal exit, the run is
        marked ``succeeded`` (fenced: ``WHERE fence_token = mine``) in this same
        transaction, which then commits: effect, outbox rows, key and state commit
        together or not at all. On an exception, everything rolls back. Use it once per
        execution.

        Args:
            bind: your own ``Engine`` (a connection + transaction is opened on it) or
                ``Connection`` (joined if already in a transaction, which you then commit
                before the body returns; else a transaction is begun and committed here).
                Must point at the store's database.
            session: your own SQLAlchemy ``Session`` on the store's database: its
                connection is yielded, the ORM can be used alongside, and the session is
                flushed and committed at the end of the block (rolled back on error).
            using: a Django database alias (``"default"``): the block is
                ``transaction.atomic(using=using)`` on Django's own connection and yields a
                ``Connection`` on it, so ORM writes in the block commit with the key (see
                :mod:`reliable_beat.contrib.django.db` and ``docs/django.md``). Without
                ``using``/``bind``/``session``, in a Django project with the app installed,
                it is the alias whose database is the store's (when one is).

        In a Django project with the app installed, a write on a Django connection other
        than the block's (another alias, or any when the block is not on Django's) raises
        ``ConfigurationError`` naming ``using=`` (:mod:`reliable_beat.contrib.django.join`).

        Raises:
            StaleFenceToken: the fence moved (another runner claimed the run after this
                one): everything written in the block was rolled back; the attempt is
                recorded ``fenced_out``.
            ConfigurationError: ``bind``/``session``/``using`` point at another database,
                ``using`` is given with ``bind``/``session``, Django is not installed, or
                (Django) an ORM write on another connection inside the block.
            RuntimeError: called outside an execution, or twice in one execution.
        """
        state = self._state()
        if state.transaction_used:
            raise RuntimeError(f"{self.name}: self.transaction() may be used once per run")
        state.transaction_used = True
        join = joins.registered()  # Django's, when the app is installed
        if using is None and bind is None and session is None and join is not None:
            using = join.default_alias(state.store)  # the store is this Django database
        if using is not None:
            if bind is not None or session is not None:
                raise ConfigurationError(
                    f"{self.name}: self.transaction(using={using!r}) runs on Django's "
                    "connection; pass bind=/session= or using=, not both"
                )
            join = joins.for_using(using, f"{self.name}: self.transaction")
            try:
                with join.atomic(using) as tx:
                    joins.check_same_database(tx.engine, state.store)
                    with self._guard(join, using, state):
                        yield tx
                    _renewer.discard(state)  # see below
                    with tracing.completion():
                        runs.complete(tx, state.claim, state.returned)
            except BaseException as exc:
                self._after_rollback(state, exc)
                raise
            state.write_result = join.result_writer(using, state.store, state.claim)
            state.completed = True
            return
        if session is not None:
            conn = session.connection()
            self._check_same_database(conn.engine, state.store)
            try:
                with self._guard(join, None, state):
                    yield conn
                session.flush()
                _renewer.discard(state)  # see below
                with tracing.completion():
                    runs.complete(conn, state.claim, state.returned)
                session.commit()
            except BaseException as exc:
                session.rollback()
                self._after_rollback(state, exc)
                raise
            state.completed = True
            return
        if isinstance(bind, Connection):
            self._check_same_database(bind.engine, state.store)
            if bind.in_transaction():
                lent = join.alias_of(bind) if join is not None else None  # atomic_connection()'s
                with self._guard(join, lent, state):
                    yield bind
                _renewer.discard(state)  # see below
                with tracing.completion():  # joins the caller's transaction
                    runs.complete(bind, state.claim, state.returned)
                state.completed = True
                return
            cm: Any = bind.begin()
            conn = bind
        else:
            engine = bind if bind is not None else state.store.engine
            if bind is not None:
                self._check_same_database(engine, state.store)
            cm = state.store.begin() if bind is None else engine.begin()
            conn = None
        try:
            # a workflow activity's wake is published right after the commit (handoff)
            with handoff.after_commit(state.store), cm as entered:
                tx = conn if conn is not None else entered
                with self._guard(join, None, state):
                    yield tx
                # The completion locks the run row until the commit: a renewal now would
                # wait on our own lock (and hold up the leases of other executions the
                # renewer serves). The fence is checked inside this transaction, so no
                # takeover can slip in before the commit; the lease is no longer needed.
                _renewer.discard(state)
                with tracing.completion():
                    runs.complete(tx, state.claim, state.returned)
        except BaseException as exc:
            self._after_rollback(state, exc)
            raise
        state.completed = True

    def _guard(self, join: joins.Join | None, alias: str | None,
               state: _RunState) -> AbstractContextManager[None]:
        """Writes on the framework's other connections refused inside the block."""
        return joins.guard(join, alias, where="self.transaction", task_name=self.name,
                           store=state.store)

    def returns(self, value: Any) -> None:
        """Declare the run's result inside ``self.transaction()``: it is stored by the
        completing transaction, with the effect (a workflow activity's result must be;
        the body's return value is otherwise stored after the commit, best effort).

        Raises:
            TypeError: ``value`` is not JSON-serialisable.
            RuntimeError: called outside an execution.
        """
        state = self._state()
        state.returned = _storable_result(self.name, state.claim.key, value)

    @staticmethod
    def _check_same_database(engine: Engine, store: Store) -> None:
        joins.check_same_database(engine, store)

    def _after_rollback(self, state: _RunState, exc: BaseException) -> None:
        if isinstance(exc, StaleFenceToken):
            log.warning("%s: %s", self.name, exc)
            tracing.annotate({tracing.OUTCOME: "fenced_out"})
            runs.record_fenced_out(state.store, state.claim)
            state.completed = True  # nothing more to record for this attempt
        else:
            # Rolled back without completing: the body may go on, so keep the lease alive.
            _renewer.add(state)

