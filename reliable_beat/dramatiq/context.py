"""The run an :class:`~reliable_beat.dramatiq.IdempotentActor` body executes:
:func:`current` and its :class:`RunContext` (key, run id, fence token, attempt,
``transaction()``, ``outbox``), and the context variables the middleware and the actor class
bind for each message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from reliable_beat import execution, joins, runs, tracing
from reliable_beat.errors import StaleFenceToken
from reliable_beat.settings import Settings

__all__ = ["RunContext", "current"]

_message: ContextVar[Any] = ContextVar("reliable_beat_dramatiq_message", default=None)
_run: ContextVar[RunContext | None] = ContextVar("reliable_beat_dramatiq_run", default=None)


@dataclass
class RunContext:
    """The run an :class:`IdempotentActor` body executes (``current()``).

    Attributes:
        state: the core run state (claim, lease, flags).
        settings: the middleware's settings.
    """

    state: execution.RunState
    settings: Settings
    _outbox: execution.RunOutbox | None = field(default=None, repr=False)

    @property
    def idempotency_key(self) -> str:
        return self.state.claim.key

    @property
    def run_id(self) -> int:
        """``reliable_beat_runs.id``; stamp it on every row the body writes."""
        return self.state.claim.run_id

    @property
    def fence_token(self) -> int:
        """This runner's fence token; stamp it on writes to other stores to fence them."""
        return self.state.claim.fence_token

    @property
    def attempt(self) -> int:
        """This try's number (1 = first), counted in the database, crashes included."""
        return self.state.claim.attempt

    @property
    def lease_lost(self) -> bool:
        """True once a renewal found the fence moved: the commit will be rejected."""
        return self.state.lease_lost

    @property
    def outbox(self) -> execution.RunOutbox:
        """``current().outbox.add(tx, destination, payload, ...)``: see
        :class:`~reliable_beat.execution.RunOutbox`."""
        if self._outbox is None:
            self._outbox = execution.RunOutbox(lambda: self.state, lambda: self.settings)
        return self._outbox

    @contextmanager
    def transaction(self, *, using: str | None = None) -> Iterator[Connection]:
        """One transaction on the store's database for the body's effect; leaving the block
        marks the run ``succeeded`` (fenced) in it and commits: effect, outbox rows and key
        together or not at all. Use it once per execution.

        Args:
            using: a Django database alias: the block is ``transaction.atomic(using=using)``
                on Django's own connection (its database must be the store's), so ORM
                writes in it commit with the key. In a Django project with
                ``reliable_beat.contrib.django`` installed it defaults to the alias whose
                database is the store's, and a write on any other Django connection inside
                the block raises ``ConfigurationError`` naming ``using=`` (``docs/django.md``).

        Raises:
            StaleFenceToken: the fence moved (a newer runner owns the run); everything
                rolled back, the attempt is recorded ``fenced_out``.
            ConfigurationError: ``using`` names another database than the store's, or
                (Django) an ORM write on another connection inside the block.
            RuntimeError: used twice in one execution.
        """
        state = self.state
        if state.transaction_used:
            raise RuntimeError(f"{state.task_name}: transaction() may be used once per run")
        state.transaction_used = True
        join = joins.registered()  # Django's, when the app is installed
        if using is None and join is not None:
            using = join.default_alias(state.store)  # the store is this Django database
        if using is not None:
            join = joins.for_using(using, f"{state.task_name}: current().transaction")
        try:
            opened = join.atomic(using) if join is not None and using is not None \
                else state.store.begin()
            with opened as conn:
                joins.check_same_database(conn.engine, state.store)
                with joins.guard(join, using, where="current().transaction",
                                 task_name=state.task_name, store=state.store):
                    yield conn
                execution.renewer().discard(state)
                with tracing.completion():
                    runs.complete(conn, state.claim, None)
        except StaleFenceToken:
            runs.record_fenced_out(state.store, state.claim)
            raise
        if join is not None and using is not None:
            state.write_result = join.result_writer(using, state.store, state.claim)
        state.completed = True


def current() -> RunContext:
    """The run of the :class:`IdempotentActor` body executing in this context.

    Raises:
        RuntimeError: not inside an IdempotentActor execution.
    """
    ctx = _run.get()
    if ctx is None:
        raise RuntimeError("reliable_beat.dramatiq.current(): not inside an IdempotentActor")
    return ctx
