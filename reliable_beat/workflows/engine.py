"""The durable workflow engine: start, signal, the advance (claim, replay, record, release).

Framework-neutral: messages are outbox rows (destination :data:`WAKE_DESTINATION`, payload
``{"task", "args", "kwargs", "headers"?, "options"?}``) that an adapter's relay publishes;
the Celery adapter (:mod:`reliable_beat.celery.workflows`) registers the advance task
:data:`ADVANCE_TASK` that calls :func:`advance`.

The protocol (docs/workflows.md):

1. **claim**: ``UPDATE workflows SET fence_token = fence_token + 1, lease_expires_at = db now
   + lease, state = 'running', claimed_wake_seq = wake_seq WHERE workflow_id = :id AND state
   IN ('pending', 'waiting', 'running') AND (lease_expires_at IS NULL OR lease_expires_at <
   db now)``. No row: someone holds a live lease (it will see our ``wake_seq`` bump; a
   signal on PostgreSQL may have skipped its bump, so a busy advance that finds an
   unconsumed signal bumps it itself: :func:`_nudge_holder`) or the workflow is terminal /
   blocked.
2. **load** the run's events, **run** the function from the top with a
   :class:`~reliable_beat.workflows.context.WorkflowContext`: recorded calls are answered from
   the history, the first unrecorded call (the frontier) is recorded in one transaction that
   starts with the fence check (``UPDATE ... WHERE fence_token = :mine``) and holds whatever it
   dispatches (activity run message, timer wake row).
3. **release**: ``UPDATE ... SET state = 'waiting', lease NULL WHERE fence_token = :mine AND
   wake_seq = :seen``; zero rows with our fence means something woke the workflow while we
   ran: run again (bounded), so no wake-up is lost.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import signal as _signal
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Text, and_, cast, func, or_, select, update
from sqlalchemy.engine import Connection

from reliable_beat import outbox, tracing
from reliable_beat import values as rb_values
from reliable_beat.db.dialects import Store, update_returning
from reliable_beat.db.tables import runs, workflow_events, workflow_signals, workflows
from reliable_beat.outbox import db_now, insert_ignore
from reliable_beat.redaction import get_logger, redact_value
from reliable_beat.workflows import limits, runaway, signal_keys
from reliable_beat.workflows.errors import (
    WorkflowBlockedError,
    WorkflowConflict,
    WorkflowFailed,
    WorkflowNotFound,
)

if TYPE_CHECKING:
    from reliable_beat.redispatch import QueueDepthFn

__all__ = [
    "ACTIVE_STATES",
    "ADVANCE_TASK",
    "DEFAULT_HISTORY_LIMIT",
    "TERMINAL_STATES",
    "WAKE_DESTINATION",
    "WorkflowDefinition",
    "WorkflowHandle",
    "activity_key",
    "advance",
    "args_digest",
    "get_definition",
    "get_workflow",
    "list_workflows",
    "on_run_finished",
    "redispatch_workflows",
    "register",
    "resume",
    "signal",
    "start",
]

log = get_logger("reliable_beat.workflows")

#: Name of the advance task (a Celery task registered by the adapter).
ADVANCE_TASK = "reliable_beat.workflow.advance"
#: Outbox destination of advance and activity messages.
WAKE_DESTINATION = "celery"
ACTIVE_STATES = ("pending", "running", "waiting")
TERMINAL_STATES = ("completed", "failed", "cancelled")
#: Events per run past which a frontier record blocks the workflow (``history_limit``).
DEFAULT_HISTORY_LIMIT = 2000
#: Longest workflow id (its activity keys and wake message ids must fit 400 characters).
MAX_WORKFLOW_ID = 300
#: Advance loops (a wake arrived while running) before the advance hands over to a message.
MAX_LOOPS = 20

# ------------------------------------------------------------------ crash points ----

#: Test seam: called with the name of each crash point (see :func:`crash_point`).
crash_hook: Callable[[str], None] | None = None
_kill_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """A named point where tests crash the process (docs/workflows.md lists them).

    ``crash_hook`` (in-process tests) is called with the name. With ``RB_WF_KILL_AT=name``
    (optionally ``name:n``, the n-th hit in this process) and ``RB_WF_KILL_FILE=path`` in the
    environment, the process SIGKILLs itself at that point once: the file records that the
    kill happened so the restarted process goes on.
    """
    if crash_hook is not None:
        crash_hook(name)
    spec = os.environ.get("RB_WF_KILL_AT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _kill_counts[name] = _kill_counts.get(name, 0) + 1
    if _kill_counts[name] != int(nth or 1):
        return
    marker = os.environ.get("RB_WF_KILL_FILE")
    if marker:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, name.encode())
        os.close(fd)
    os.kill(os.getpid(), _signal.SIGKILL)


# ------------------------------------------------------------------ helpers ----


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces (the digest's input)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def args_digest(kind: str, name: str | None, args: Any) -> str:
    """``sha256(canonical JSON of [kind, name, args])[:16]``: what a position must match."""
    return hashlib.sha256(canonical_json([kind, name, args]).encode()).hexdigest()[:16]


def to_json(value: Any, what: str) -> Any:
    """``value`` as the JSON stored in the history, encoded as Celery's JSON serializer
    (kombu) encodes it (:func:`reliable_beat.values.to_json_value`): plain JSON, and
    ``datetime`` / ``date`` / ``time`` / ``Decimal`` / ``UUID`` / ``bytes`` as kombu's
    ``{"__type__", "__value__"}`` objects, which :func:`reliable_beat.values.from_json_value`
    turns back into the Python values the workflow code gets (the same on every replay).

    Raises:
        TypeError: a value neither JSON nor kombu carries (or a NaN, infinity or ``\\x00``);
            the message names the path to it (``workflow 'x' args[1]['when']``) and the fix.
    """
    try:
        return rb_values.to_json_value(value, what)
    except ValueError as exc:
        raise TypeError(f"{exc} (workflow data is stored as JSON)") from exc


def error_json(exc: BaseException) -> dict[str, str]:
    """``{"type", "message", "traceback"}`` of an exception (stored, never pickled)."""
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
    }


def activity_key(workflow_id: str, run_no: int, seq: int) -> str:
    """The idempotency key of the activity at ``seq``: ``wf:<workflow id>/<run>#<seq>``."""
    return f"wf:{workflow_id}/{run_no}#{seq}"


def parse_activity_key(key: str) -> tuple[str, int, int] | None:
    """``(workflow id, run, seq)`` of an activity key, or None for any other key."""
    if not key.startswith("wf:"):
        return None
    head, _, seq = key[3:].rpartition("#")
    wf, _, run = head.rpartition("/")
    if not (wf and run.isdigit() and seq.isdigit()):
        return None
    return wf, int(run), int(seq)


def _insert_one_ignored(conn: Connection, stmt: Any, table: Any) -> bool:
    """Run an insert-ignore of one row; True if it was stored, False if the unique key
    already existed.

    PostgreSQL / SQLite / MariaDB 10.5+: ``RETURNING`` the primary key (psycopg reports no
    useful rowcount for ``INSERT ... ON CONFLICT DO NOTHING`` with an implicit RETURNING).
    MySQL 8 has no ``RETURNING``: the ``INSERT IGNORE``'s rowcount (0 for a duplicate).
    """
    if conn.dialect.insert_returning:
        (pk,) = table.primary_key.columns
        return conn.execute(stmt.returning(pk)).first() is not None
    return int(conn.execute(stmt).rowcount) == 1


@contextmanager
def _tx(target: Store | Connection) -> Iterator[Connection]:
    """Join the caller's transaction (a Connection) or run one on the store."""
    if isinstance(target, Connection):
        if not target.in_transaction():
            with target.begin():
                yield target
            return
        yield target
        return
    with target.begin() as conn:
        yield conn


def now_sql(conn: Connection) -> Any:
    """The store's clock as a SQL expression evaluated inside the statement that uses it
    (saves the round trip of :func:`~reliable_beat.outbox.db_now` when the value is only
    written): ``clock_timestamp()`` on PostgreSQL, ``UTC_TIMESTAMP(6)`` on MySQL/MariaDB;
    on SQLite (no server) this host's clock, read now, as :func:`db_now` does."""
    name = conn.dialect.name
    if name == "postgresql":
        return func.clock_timestamp()
    if name in ("mysql", "mariadb"):
        return func.utc_timestamp(6)
    return db_now(conn)


def _first(rows: list[Any]) -> Any:
    return rows[0] if rows else None


def _wake_payload(workflow_id: str, queue: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"task": ADVANCE_TASK, "args": [workflow_id], "kwargs": {}}
    if queue:
        payload["options"] = {"queue": queue}
    return payload


def group_of(workflow_id: str) -> Any:
    """SQL: the schedule group of workflow ``workflow_id`` (NULL: none, or no such row), for
    the ``schedule_group`` of the outbox rows it writes: only the relays and beats of that
    group publish them, into the broker of the app that runs the workflow."""
    return (select(workflows.c.schedule_group)
            .where(workflows.c.workflow_id == workflow_id).scalar_subquery())


def add_wake(
    conn: Connection, workflow_id: str, queue: str | None, what: str,
    delay: timedelta | None = None,
) -> str:
    """Add the advance message ``wake:<workflow id>:<what>`` to the outbox (joins ``conn``),
    scoped to the workflow's schedule group (:func:`group_of`)."""
    return outbox.add(
        conn, WAKE_DESTINATION, _wake_payload(workflow_id, queue),
        key=f"wake:{workflow_id}:{what}", delay=delay, schedule_group=group_of(workflow_id),
    )


def drop_wakes(conn: Connection, workflow_id: str) -> int:
    """Delete the delayed wake rows of a workflow that just ended (joins ``conn``, the
    transaction that ends it): pending, not yet due and unclaimed. A 24 h ``ctx.sleep`` or
    signal timeout leaves such a wake; it would only find the workflow ended. Rows already
    due are left to the relay (a no-op advance): one may be the message being delivered
    right now. Activity messages are left alone. Returns the rows deleted."""
    from reliable_beat.db.tables import outbox as outbox_table

    o = outbox_table
    now = db_now(conn)
    still = (o.c.state == "pending", o.c.claimed_by.is_(None), o.c.available_at > now)
    found = conn.execute(
        select(o.c.id, o.c.payload).where(
            o.c.destination == WAKE_DESTINATION, *still,
            o.c.message_id.startswith(f"wake:{workflow_id}:", autoescape=True))
    ).all()
    ids = []
    for r in found:  # another workflow's id may extend this one's ("a" vs "a:b")
        payload = r.payload
        if isinstance(payload, str):
            try:
                payload = json.loads(payload)
            except ValueError:
                continue
        if isinstance(payload, dict) and payload.get("task") == ADVANCE_TASK \
                and payload.get("args") == [workflow_id]:
            ids.append(r.id)
    if not ids:
        return 0
    # re-checked: a relay may have claimed one since the read
    return int(conn.execute(o.delete().where(o.c.id.in_(ids), *still)).rowcount or 0)


# ------------------------------------------------------------------ registry ----


@dataclass
class WorkflowDefinition:
    """A registered workflow function.

    Attributes:
        name: the stable registered name (recorded on each workflow row; never rename it).
        fn: ``fn(ctx, *args, **kwargs) -> JSON value``.
        queue: queue of its advance messages (None: the adapter's default routing).
        history_limit: events per run before the workflow is blocked (``history_limit``).
        store_factory: returns this process's store (set by the adapter).
        version: this code's version (dot-separated integers), recorded on runs it starts.
        min_supported_version: runs recorded under a lower version (or none) are parked
            ``blocked`` by this code instead of replayed.
        continue_as_new_after: the position from which ``ctx.info.continue_as_new_suggested``
            is True (None: half the ``history_limit``); must be below ``history_limit``.
        schedule_group_factory: returns the schedule group of the app it is registered with
            (set by ``@workflow(app, ...)``; read at each start, so the app's configuration
            may load later): the workflows it starts record it, so only that group's relays
            publish their messages. None: no group (any relay).
    """

    name: str
    fn: Callable[..., Any]
    queue: str | None = None
    history_limit: int = DEFAULT_HISTORY_LIMIT
    store_factory: Callable[[], Store] | None = None
    version: str | None = None
    min_supported_version: str | None = None
    continue_as_new_after: int | None = None
    schedule_group_factory: Callable[[], str | None] | None = None

    def __post_init__(self) -> None:
        from reliable_beat.workflows.versioning import parse_version

        if self.version is not None:
            parse_version(self.version, f"workflow {self.name!r} version")
        if self.min_supported_version is not None:
            minimum = parse_version(self.min_supported_version,
                                    f"workflow {self.name!r} min_supported_version")
            if self.version is None or parse_version(self.version) < minimum:
                raise ValueError(
                    f"workflow {self.name!r}: min_supported_version "
                    f"{self.min_supported_version} needs a version at least as high (version="
                    f"{self.version!r}); this code would refuse the runs it starts"
                )
        after = self.continue_as_new_after
        if after is not None and not (0 < after < self.history_limit):
            raise ValueError(
                f"workflow {self.name!r}: continue_as_new_after must be between 1 and "
                f"history_limit - 1 ({self.history_limit - 1}), got {after}"
            )

    @property
    def suggest_continue_at(self) -> int:
        """The position from which ``continue_as_new_suggested`` is True."""
        if self.continue_as_new_after is not None:
            return self.continue_as_new_after
        return max(1, self.history_limit // 2)

    @property
    def schedule_group(self) -> str | None:
        """The schedule group the workflows it starts record (None: no group)."""
        return self.schedule_group_factory() if self.schedule_group_factory else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function directly (only inside tests that pass a context)."""
        return self.fn(*args, **kwargs)

    def _store(self, store: Store | None) -> Store:
        if store is not None:
            return store
        if self.store_factory is None:
            raise WorkflowNotFound(
                f"workflow {self.name!r} has no store: pass store= or conn=, or register it "
                "with an app (@workflow(app, name=...))"
            )
        return self.store_factory()

    def start(
        self,
        workflow_id: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        conn: Connection | None = None,
        store: Store | None = None,
    ) -> WorkflowHandle:
        """Start this workflow under ``workflow_id``; idempotent on the id.

        See :func:`start`. With ``conn`` the start joins the caller's transaction
        (transactional start: it exists if, and only if, the caller commits).
        """
        target: Store | Connection = conn if conn is not None else self._store(store)
        handle = start(target, self.name, workflow_id, args, kwargs, queue=self.queue,
                       version=self.version)
        if conn is None:
            handle.store = target if isinstance(target, Store) else None
        elif store is not None or self.store_factory is not None:
            handle.store = self._store(store)
        return handle


_registry: dict[str, WorkflowDefinition] = {}


def register(definition: WorkflowDefinition) -> WorkflowDefinition:
    """Register ``definition`` under its name (a second registration replaces the first)."""
    _registry[definition.name] = definition
    return definition


def get_definition(name: str) -> WorkflowDefinition | None:
    """The workflow registered as ``name`` in this process, or None."""
    return _registry.get(name)


# ------------------------------------------------------------------ start / signal ----


@dataclass
class WorkflowHandle:
    """A started workflow: read its status, wait for its result (polls the row).

    Attributes:
        workflow_id: the business id.
        store: the store to read from (None when started with ``conn=`` and no store known).
        created: True if this call created the workflow, False if it existed.
    """

    workflow_id: str
    store: Store | None = None
    created: bool = False

    def _need_store(self) -> Store:
        if self.store is None:
            raise WorkflowNotFound("this handle has no store; set handle.store first")
        return self.store

    def status(self) -> dict[str, Any]:
        """The workflow row: ``{"workflow_id", "name", "state", "run_no", "result",
        "error", "block_reason", "history_len", "fence_token", "wake_seq", ...}``.

        Raises:
            WorkflowNotFound: no such workflow (e.g. its start was rolled back).
        """
        return get_workflow(self._need_store(), self.workflow_id)

    def result(self, timeout: float | None = None, interval: float = 0.2) -> Any:
        """Wait until the workflow ends and return its result.

        Args:
            timeout: seconds to wait (None: forever).
            interval: seconds between polls of the row.

        Raises:
            WorkflowFailed: it ended ``failed`` or ``cancelled`` (``.error`` holds the
                recorded error, ``.state`` which of the two).
            WorkflowBlockedError: it is ``blocked`` (a person must act).
            TimeoutError: still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            row = self.status()
            if row["state"] == "completed":
                return rb_values.from_json_value(row["result"])
            if row["state"] in ("failed", "cancelled"):
                raise WorkflowFailed(self.workflow_id, row["error"], state=row["state"])
            if row["state"] == "blocked":
                raise WorkflowBlockedError(
                    f"workflow {self.workflow_id!r} is blocked: {row['block_reason']} (fix the "
                    f"code, then `reliable-beat workflows resume {self.workflow_id}`)"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"workflow {self.workflow_id!r} still {row['state']} after {timeout} s"
                )
            time.sleep(interval)


def _traced_start(fn: Callable[..., WorkflowHandle]) -> Callable[..., WorkflowHandle]:
    """``start`` in a ``start workflow <name>`` span, the root of the workflow's trace (linked
    to the caller's span): the row stores its traceparent, every advance joins it."""
    @functools.wraps(fn)
    def traced(target: Any, name: str, workflow_id: str, *args: Any, **kwargs: Any
               ) -> WorkflowHandle:
        if tracing.tracer() is None:
            return fn(target, name, workflow_id, *args, **kwargs)
        with tracing.span(f"start workflow {name}", root=True,
                          links=[tracing.current_traceparent()],
                          attributes=tracing.attributes(workflow_id=workflow_id)) as s:
            handle = fn(target, name, workflow_id, *args, **kwargs)
            s.set_attribute(tracing.OUTCOME, "started" if handle.created else "existed")
            return handle
    return traced


def _traced_advance(fn: Callable[..., str]) -> Callable[..., str]:
    """``advance`` in an ``advance workflow <name>`` span of the workflow's trace (the
    traceparent stored at start / continue-as-new), its outcome as ``reliable_beat.outcome``:
    activities, timers, signals and compensations it schedules are delivered under it."""
    @functools.wraps(fn)
    def traced(store: Store, workflow_id: str, **kwargs: Any) -> str:
        if tracing.tracer() is None:
            return fn(store, workflow_id, **kwargs)
        with store.connect() as conn:
            row = conn.execute(select(workflows.c.name, workflows.c.run_no,
                                      workflows.c.traceparent)
                               .where(workflows.c.workflow_id == workflow_id)).first()
        name = row.name if row is not None else "?"
        with tracing.span(f"advance workflow {name}", parent=row and row.traceparent,
                          root=True, attributes=tracing.attributes(
                              workflow_id=workflow_id,
                              workflow_run=row.run_no if row is not None else None)) as s:
            outcome = fn(store, workflow_id, **kwargs)
            s.set_attribute(tracing.OUTCOME, outcome)
            return outcome
    return traced


@_traced_start
def start(
    target: Store | Connection,
    name: str,
    workflow_id: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    queue: str | None = None,
    version: str | None = None,
    schedule_group: str | None = None,
) -> WorkflowHandle:
    """Create workflow ``workflow_id`` of registered name ``name`` and send its first advance.

    Idempotent on ``workflow_id``: if it exists (any state) nothing is written and the
    existing workflow's handle is returned (``created`` False). The row and its wake message
    (outbox, ``wake:<id>:start``) are written in one transaction: the caller's when
    ``target`` is a Connection (transactional start), else a new one.

    Args:
        target: the store, or a connection inside the caller's transaction on it.
        name: the registered workflow name.
        workflow_id: the business id, 1..300 characters (e.g. ``"order:42"``).
        args / kwargs: JSON-serialisable arguments of the workflow function.
        queue: the queue of its advance messages.
        version: the code version to record (``@workflow(version=...)``; None: the
            registered definition's, if any).
        schedule_group: the schedule group whose relays and beats publish its messages
            (wakes, activities, compensations), into the broker of the app that runs it
            (None: the registered definition's, i.e. its app's; none without an app: any
            relay publishes them). A child takes its parent's, a scheduled workflow its
            entry's.

    Raises:
        WorkflowConflict: ``workflow_id`` names a workflow of another name.
        ValueError: bad id; TypeError: arguments not JSON-serialisable.
        WorkflowValueError: ``args`` + ``kwargs`` over the size limit as JSON
            (:data:`~reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES`; every advance reads
            them); nothing is written.

    A second ``start`` of an existing id with other arguments (first run) returns the
    existing workflow too, and logs a WARNING naming the id: the new arguments are not used.
    """
    if not (0 < len(workflow_id) <= MAX_WORKFLOW_ID):
        raise ValueError(f"workflow_id must be 1..{MAX_WORKFLOW_ID} characters: {workflow_id!r}")
    call_args = to_json(list(args), f"workflow {name!r} args")
    call_kwargs = to_json(dict(kwargs or {}), f"workflow {name!r} kwargs")
    limits.check_size(f"workflow {name!r} arguments", call_args, call_kwargs)
    if version is None and name in _registry:
        version = _registry[name].version
    if schedule_group is None and name in _registry:
        schedule_group = _registry[name].schedule_group
    with _tx(target) as conn:
        now = db_now(conn)
        inserted = _insert_one_ignored(conn, insert_ignore(conn, workflows).values(
            workflow_id=workflow_id, name=name, version=version, run_no=1, state="pending",
            args=call_args, kwargs=call_kwargs, queue=queue, schedule_group=schedule_group,
            random_seed=secrets.randbits(62), fence_token=0, wake_seq=1,
            claimed_wake_seq=0, history_len=0, history_bytes=0, advances=0,
            created_at=now, updated_at=now, traceparent=tracing.current_traceparent(),
        ), workflows)
        if inserted:
            add_wake(conn, workflow_id, queue, "start")
        else:
            row = conn.execute(
                select(workflows.c.name, workflows.c.run_no, workflows.c.args,
                       workflows.c.kwargs, workflows.c.state)
                .where(workflows.c.workflow_id == workflow_id)
            ).one()
            existing = row.name
            if existing != name:
                raise WorkflowConflict(
                    f"workflow id {workflow_id!r} already names a {existing!r} workflow, not "
                    f"{name!r}; workflow ids are unique across names"
                )
            if row.run_no == 1 and (row.args, row.kwargs) != (call_args, call_kwargs):
                # the same id with other arguments is a second, different request: say so
                # (a continued run has its own arguments: not comparable)
                log.warning(
                    "workflow %r already exists (%s) with other arguments (stored args=%s "
                    "kwargs=%s); start() returned it unchanged (created=False) and the new "
                    "arguments were not used: give a new request its own workflow_id",
                    workflow_id, row.state, redact_value(row.args), redact_value(row.kwargs))
    store = target if isinstance(target, Store) else None
    return WorkflowHandle(workflow_id, store=store, created=inserted)


def signal(
    target: Store | Connection,
    workflow_id: str,
    name: str,
    payload: Any = None,
    *,
    key: str | None = None,
) -> bool:
    """Send signal ``name`` with ``payload`` to a workflow; it wakes the workflow.

    Writes the inbox row and a wake message in one transaction (the caller's when
    ``target`` is a Connection): when this returns True (and the caller committed) the
    signal is durable and will be consumed by exactly one ``ctx.wait_signal(name)``, oldest
    first, unless the workflow ends without waiting for it. Retrying after an error with
    the same ``key`` is safe: the signal is stored once.

    Never waits for a running advance (PostgreSQL): the workflow row is read ``FOR KEY
    SHARE``, which no advance's write conflicts with, and ``wake_seq`` is bumped only if the
    row is free (``FOR NO KEY UPDATE SKIP LOCKED``). When an advance holds the row, the
    bump is skipped and the wake message does its work: the advance it starts finds the
    holder's lease live, sees the unconsumed signal and bumps ``wake_seq`` itself (a worker
    may wait for a row lock; a web request must not), so the holder's release runs the code
    again; if that message fails (the holder frozen inside a transaction past the worker's
    ``lock_timeout``), the re-dispatch sweep wakes a ``waiting`` workflow parked on a
    ``wait_signal`` whose signal sits unconsumed (:func:`redispatch_workflows`). No wake-up
    is lost. The one wait left is the transaction that *ends* the workflow (it takes the
    row ``FOR UPDATE``): it lasts milliseconds, and it decides the race with a workflow
    completing concurrently: a signal is either committed before the end (stored; consumed
    if the code waits for it, like any signal sent while the workflow ran) or refused with
    :class:`WorkflowConflict`, never stored on an ended workflow. A process frozen inside
    that ending transaction makes ``signal`` wait up to the connection's ``lock_timeout``
    and raise; sending again with the same ``key`` is safe.

    SQLite (one writer at a time) and MariaDB/MySQL (InnoDB's foreign-key check of the inbox
    row takes a shared lock on the workflow row, which an advance's write holds) bump
    ``wake_seq`` first, locking the row as an advance does: there a signal waits for the
    advance's current transaction (``lock_timeout`` / the busy timeout, then an error).

    Args:
        target: the store, or a connection inside the caller's transaction on it.
        workflow_id: the business id.
        name: the signal's name (<= 200 characters), as ``ctx.wait_signal(name)`` asks it.
        payload: a JSON value (see :func:`to_json`); None reads as a timeout to a
            ``wait_signal(timeout=...)``: send a value.
        key: dedup key (<= 400 characters), unique per workflow: a second signal with
            the same key to the same workflow is a no-op (another workflow may use the same
            key). A re-send whose name or payload differs is not stored either, and logs a
            WARNING (the key names one signal: give a new signal a new key).

    Returns:
        True if the signal was stored, False if this workflow already has a signal with
        ``key``.

    Raises:
        WorkflowNotFound: no such workflow.
        WorkflowError-derived WorkflowConflict: the workflow has ended (the signal would be
            lost; nothing is written), or its row's state is malformed, or (a schema before
            0016_signalkey, one key per store) another workflow holds ``key``.
        TypeError: ``payload`` is not JSON-serialisable (nothing is written).
        WorkflowValueError: ``payload`` is over the size limit as JSON
            (:data:`~reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES`); nothing is written.
    """
    data = to_json(payload, f"signal {name!r} payload")
    limits.check_size(f"signal {name!r} payload", data)
    with _tx(target) as conn:
        if conn.dialect.name != "postgresql":
            return _signal_locking(conn, workflow_id, name, data, key)
        now = db_now(conn)
        # FOR KEY SHARE: blocks only while a transaction that ends the workflow holds the
        # row FOR UPDATE (lock_for_end), never behind an advance's FOR NO KEY UPDATE writes
        row = _refuse_unsignallable(workflow_id, name, conn.execute(
            select(workflows.c.id, workflows.c.state, workflows.c.queue)
            .where(workflows.c.workflow_id == workflow_id)
            .with_for_update(read=True, key_share=True)
        ).first())
        sid = conn.execute(insert_ignore(conn, workflow_signals).values(
            workflow_pk=row.id, name=name, payload=data, dedup_key=key, created_at=now,
        ).returning(workflow_signals.c.id)).scalar()
        if sid is None:  # only a key makes a duplicate
            return signal_keys.stored_key(conn, row.id, workflow_id, name, data, str(key))
        free = conn.execute(
            select(workflows.c.id).where(workflows.c.id == row.id)
            .with_for_update(key_share=True, skip_locked=True)
        ).first()
        if free is None:  # an advance (or another sender) holds the row: no bump, no wait
            add_wake(conn, workflow_id, row.queue, f"sig{sid}")
            return True
        seq = conn.execute(
            update(workflows).where(workflows.c.id == row.id)
            .values(wake_seq=workflows.c.wake_seq + 1).returning(workflows.c.wake_seq)
        ).scalar_one()
        add_wake(conn, workflow_id, row.queue, f"s{seq}")
    return True


def _refuse_unsignallable(workflow_id: str, name: str, row: Any) -> Any:
    """``row`` (id, state, queue, ...) if it is a workflow that may still consume a signal.

    Raises:
        WorkflowNotFound: ``row`` is None.
        WorkflowConflict: the workflow has ended, or its state is malformed.
    """
    if row is None:
        raise WorkflowNotFound(f"no workflow {workflow_id!r} (see `workflows list`)")
    if row.state in TERMINAL_STATES:
        raise WorkflowConflict(
            f"workflow {workflow_id!r} is {row.state}: signal {name!r} would never be "
            "consumed; nothing was written"
        )
    from reliable_beat.workflows.malformed import WORKFLOW_STATES, state_problem

    if row.state not in WORKFLOW_STATES:  # raising rolls everything back
        raise WorkflowConflict(
            f"signal {name!r} not stored (it would never be consumed; nothing was "
            f"written): {state_problem(workflow_id, row.state)}")
    return row


def _signal_locking(conn: Connection, workflow_id: str, name: str, data: Any,
                    key: str | None) -> bool:
    """:func:`signal` on SQLite and MySQL/MariaDB: bump ``wake_seq`` first, holding the
    workflow row (the same lock order as the advance: no deadlock). A key already stored
    for this workflow returns False before the bump (a web retry of the same signal costs
    the workflow no replay; two racing first sends of one key may still both bump:
    harmless)."""
    if key is not None:
        stored = conn.execute(
            select(workflow_signals.c.name, workflow_signals.c.payload)
            .join(workflows, workflows.c.id == workflow_signals.c.workflow_pk)
            .where(workflows.c.workflow_id == workflow_id, workflow_signals.c.dedup_key == key)
            .limit(1)
        ).first()
        if stored is not None:
            return signal_keys.repeated(workflow_id, key, stored, name, data)
    now = db_now(conn)
    row = _refuse_unsignallable(workflow_id, name, _first(update_returning(
        conn,
        update(workflows)
        .where(workflows.c.workflow_id == workflow_id)
        .values(wake_seq=workflows.c.wake_seq + 1),
        workflows,
        [workflows.c.id, workflows.c.state, workflows.c.queue, workflows.c.wake_seq],
    )))
    inserted = _insert_one_ignored(conn, insert_ignore(conn, workflow_signals).values(
        workflow_pk=row.id, name=name, payload=data, dedup_key=key, created_at=now,
    ), workflow_signals)
    if not inserted:  # a racing sender of the key committed first (or an older schema)
        return signal_keys.stored_key(conn, row.id, workflow_id, name, data, str(key))
    add_wake(conn, workflow_id, row.queue, f"s{row.wake_seq}")
    return True


def lock_for_end(conn: Connection, pk: int) -> None:
    """Take workflow ``pk``'s row ``FOR UPDATE`` (PostgreSQL; a no-op elsewhere), first in a
    transaction that ends the workflow (completed / failed / cancelled).

    It conflicts with the ``FOR KEY SHARE`` a :func:`signal` holds until it commits, and
    with nothing an advance takes (``FOR NO KEY UPDATE``): a signal commits either before
    the end (stored while the workflow ran) or after it, reading the ended state and
    refusing; never stored on an ended workflow."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(workflows.c.id).where(workflows.c.id == pk).with_for_update())


def resume(store: Store, workflow_id: str) -> dict[str, Any]:
    """Unblock a ``blocked`` workflow (after the code was fixed): ``waiting`` + a wake.

    Also kicks a ``pending`` / ``waiting`` workflow that is overdue (a timer or signal
    timeout past its ``fire_at``, a wake it has not consumed, or a ``wait_signal`` whose
    signal sits unconsumed in the inbox): one more wake, nothing
    else changes (the advance is fenced and replays; the sweep would send it within
    ``reliable_beat_redispatch_seconds`` too).

    Returns the row as :func:`get_workflow` does.

    Raises:
        WorkflowNotFound: no such workflow.
        WorkflowConflict: it is neither blocked nor overdue (the message says what it
            waits for).
    """
    if _kick_overdue(store, workflow_id):
        return get_workflow(store, workflow_id)
    with store.begin() as conn:
        now = db_now(conn)
        row = _first(update_returning(
            conn,
            update(workflows)
            .where(workflows.c.workflow_id == workflow_id, workflows.c.state == "blocked")
            .values(state="waiting", block_reason=None, wake_seq=workflows.c.wake_seq + 1,
                    advances=0, updated_at=now),
            workflows, [workflows.c.queue, workflows.c.wake_seq],
        ))
        if row is None:
            state = conn.execute(
                select(workflows.c.state).where(workflows.c.workflow_id == workflow_id)
            ).scalar()
            if state is None:
                raise WorkflowNotFound(f"no workflow {workflow_id!r}")
            if state in ("pending", "waiting"):
                raise WorkflowConflict(
                    f"workflow {workflow_id!r} is {state} and not overdue (no timer past "
                    "due, no unconsumed wake): it waits for an activity, a signal or a "
                    "timer to come; `reliable-beat workflows show` lists its events")
            raise WorkflowConflict(f"workflow {workflow_id!r} is {state}, not blocked")
        add_wake(conn, workflow_id, row.queue, f"resume{row.wake_seq}")
    return get_workflow(store, workflow_id)


def _kick_overdue(store: Store, workflow_id: str) -> bool:
    """``resume`` of a pending / waiting workflow: add a wake if it is overdue."""
    with store.begin() as conn:
        now = db_now(conn)
        row = conn.execute(
            select(workflows.c.id, workflows.c.state, workflows.c.run_no,
                   workflows.c.wake_seq, workflows.c.claimed_wake_seq)
            .where(workflows.c.workflow_id == workflow_id)
        ).first()
        if row is None or row.state not in ("pending", "waiting"):
            return False
        due = conn.execute(
            select(func.count()).select_from(workflow_events).where(
                workflow_events.c.workflow_pk == row.id,
                workflow_events.c.run_no == row.run_no,
                workflow_events.c.state == "scheduled",
                workflow_events.c.fire_at.is_not(None),
                workflow_events.c.fire_at <= now)
        ).scalar_one()
        if not due and not (row.state == "pending" or row.wake_seq > row.claimed_wake_seq):
            # a signal whose wake_seq bump was skipped (PostgreSQL) and whose wake's advance
            # failed: its wait_signal is scheduled while a signal of that name sits unread
            ev, sg = workflow_events.c, workflow_signals.c
            due = conn.execute(
                select(func.count()).select_from(workflow_events.join(
                    workflow_signals, and_(sg.workflow_pk == ev.workflow_pk,
                                           sg.name == ev.name)))
                .where(ev.workflow_pk == row.id, ev.run_no == row.run_no,
                       ev.kind == "signal", ev.state == "scheduled",
                       sg.consumed_seq.is_(None))
            ).scalar_one()
        if not due and not (row.state == "pending" or row.wake_seq > row.claimed_wake_seq):
            return False
        bumped = _first(update_returning(
            conn,
            update(workflows)
            .where(workflows.c.id == row.id, workflows.c.state.in_(("pending", "waiting")))
            .values(wake_seq=workflows.c.wake_seq + 1),
            workflows, [workflows.c.queue, workflows.c.wake_seq],
            lock_by_primary_key=True,  # MariaDB: lock the one row, not via the state index
        ))
        if bumped is None:
            return False
        log.warning("workflow %s is %s and overdue: kicked by resume (wake %s)",
                    workflow_id, row.state, bumped.wake_seq)
        add_wake(conn, workflow_id, bumped.queue, f"kick{bumped.wake_seq}")
    return True


# ------------------------------------------------------------------ completion hook ----


def on_run_finished(
    conn: Connection, key: str, state: str, result: Any = None, error: str | None = None
) -> bool:
    """Write an activity's outcome into its workflow's history, in the caller's transaction.

    Called by :func:`reliable_beat.runs.complete` (``state='succeeded'``, in the activity's
    completing transaction: effect, run, result and history commit together) and by
    :func:`reliable_beat.runs.record_failure` when the run dies (``state='dead'``). A no-op
    for keys that are not activity keys, or whose event is no longer ``scheduled``.
    Retrying activities do not wake the workflow (retries are the activity's business).

    Returns:
        True if an event was completed (and the workflow woken).
    """
    parsed = parse_activity_key(key)
    if parsed is None:
        return False
    workflow_id, run_no, seq = parsed
    # the workflow row first: the same lock order as an advance's record transaction
    wf = _first(update_returning(
        conn,
        update(workflows)
        .where(workflows.c.workflow_id == workflow_id, workflows.c.run_no == run_no)
        .values(wake_seq=workflows.c.wake_seq + 1),
        workflows, [workflows.c.id, workflows.c.queue, workflows.c.wake_seq],
    ))
    if wf is None:
        return False
    values: dict[str, Any] = {"completed_at": now_sql(conn)}
    if state == "succeeded":
        values.update(state="completed", result=result)
    else:
        values.update(state="failed", error={"type": "dead", "message": (error or "")[-2000:]})
    done = conn.execute(
        update(workflow_events)
        .where(
            workflow_events.c.workflow_pk == wf.id,
            workflow_events.c.run_no == run_no,
            workflow_events.c.seq == seq,
            workflow_events.c.run_key == key,
            workflow_events.c.state == "scheduled",
        )
        .values(**values)
    ).rowcount
    if done != 1:
        return False
    # wake_seq in the id: a requeued compensation completes the same seq a second time
    add_wake(conn, workflow_id, wf.queue, f"{run_no}#{seq}.{wf.wake_seq}")
    return True


# ------------------------------------------------------------------ the advance ----


@dataclass
class Claimed:
    """The workflow row an advance claimed (its fence token is the advance's identity)."""

    pk: int
    workflow_id: str
    name: str
    run_no: int
    args: list[Any]
    kwargs: dict[str, Any]
    queue: str | None
    random_seed: int
    fence_token: int
    seen_wake_seq: int
    history_len: int
    history_bytes: int
    owner: str
    lease: timedelta
    extra: dict[str, Any] = field(default_factory=dict)
    version: str | None = None  # recorded at start / continue-as-new
    #: The history read in the claim transaction (the first run of the code uses it).
    history: dict[int, Any] | None = None


def _claim(store: Store, workflow_id: str, owner: str, lease: timedelta,
           max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS) -> Claimed | str:
    """The claim transaction; on success it also loads the run's history (same connection,
    same transaction: one checkout instead of two per advance).

    A row or history that is malformed (changed by SQL: a JSON column that does not decode,
    a value of the wrong shape, an unknown event kind or state) parks the workflow
    ``blocked`` with a reason naming the column (:mod:`reliable_beat.workflows.malformed`)
    and returns ``"blocked"``: its code never replays garbage.

    A ``running`` workflow whose advance's lease expired after ``max_takeovers`` takeovers
    is parked ``blocked`` instead (:func:`reliable_beat.workflows.runaway.park_expired`)."""
    from reliable_beat.workflows import malformed

    try:
        return _claim_tx(store, workflow_id, owner, lease, max_takeovers)
    except ValueError:  # json.JSONDecodeError of a JSON column, raised while reading it
        with store.begin() as conn:
            found = malformed.block_undecodable(conn, workflow_id, ACTIVE_STATES)
        if found is None:
            raise
        return found[0]


def _claim_tx(store: Store, workflow_id: str, owner: str, lease: timedelta,
              max_takeovers: int) -> Claimed | str:
    from reliable_beat.workflows import malformed

    with store.begin() as conn:
        now = db_now(conn)
        stmt = (
            update(workflows)
            .where(
                workflows.c.workflow_id == workflow_id,
                workflows.c.state.in_(ACTIVE_STATES),
                or_(workflows.c.lease_expires_at.is_(None), workflows.c.lease_expires_at < now),
                runaway.may_take_over(max_takeovers),
            )
            .ordered_values(  # takeovers first: MySQL sets left to right (its CASE reads state)
                (workflows.c.takeovers, runaway.takeovers_after_claim()),
                (workflows.c.fence_token, workflows.c.fence_token + 1),
                (workflows.c.leased_by, owner), (workflows.c.lease_expires_at, now + lease),
                (workflows.c.state, "running"),
                (workflows.c.claimed_wake_seq, workflows.c.wake_seq),
                (workflows.c.advances, workflows.c.advances + 1), (workflows.c.updated_at, now),
            )
        )
        if conn.dialect.update_returning:  # PostgreSQL, SQLite: the row in the same statement
            row = conn.execute(stmt.returning(*workflows.c)).first()
            done = row is not None
        else:
            done = conn.execute(stmt).rowcount == 1
            row = None
        if row is None:
            row = conn.execute(
                select(workflows).where(workflows.c.workflow_id == workflow_id)
            ).first()
        if row is None:
            return "missing"
        if not done:
            if row.state == "running" and runaway.park_expired(conn, row, now, max_takeovers):
                return "blocked"
            return "busy" if row.state in ACTIVE_STATES else row.state  # type: ignore[no-any-return]
        history = load_history(conn, row.id, row.run_no)
        args = [] if row.args is None else row.args
        kwargs = {} if row.kwargs is None else row.kwargs
        problem = malformed.shape_problem(workflow_id, int(row.run_no), args, kwargs, history)
        if problem is not None:  # we hold the claim: block it in this transaction
            why = malformed.reason(workflow_id, problem)
            log.error("workflow %s blocked: %s", workflow_id, why)
            conn.execute(update(workflows).where(workflows.c.id == row.id).values(
                state="blocked", block_reason=why[:4000], leased_by=None,
                lease_expires_at=None, updated_at=now))
            return "blocked"
        return Claimed(
            pk=row.id, workflow_id=workflow_id, name=row.name, run_no=row.run_no,
            args=list(args), kwargs=dict(kwargs), queue=row.queue,
            random_seed=int(row.random_seed), fence_token=int(row.fence_token),
            seen_wake_seq=int(row.claimed_wake_seq), history_len=int(row.history_len),
            history_bytes=int(row.history_bytes), owner=owner, lease=lease,
            version=row.version,
            extra={"cancel_requested": row.cancel_requested},
            history=history,
        )


def load_history(conn: Connection, pk: int, run_no: int) -> dict[int, Any]:
    """The run's events by seq (only the columns replay needs)."""
    rows = conn.execute(
        select(
            workflow_events.c.seq, workflow_events.c.kind, workflow_events.c.name,
            workflow_events.c.args_digest, workflow_events.c.state, workflow_events.c.result,
            workflow_events.c.error, workflow_events.c.fire_at, workflow_events.c.run_key,
        )
        .where(workflow_events.c.workflow_pk == pk, workflow_events.c.run_no == run_no)
        .order_by(workflow_events.c.seq)
    ).all()
    return {r.seq: r for r in rows}


def fence_check(
    conn: Connection, claimed: Claimed, *, events: int = 0, size: int = 0
) -> datetime:
    """First statement of every write of an advance: ``UPDATE ... WHERE fence = mine``.

    Returns:
        The store's clock read for it (UTC-aware), for the rest of the transaction.

    Raises:
        FencedOut: a newer advance claimed the workflow (the caller's transaction must roll
            back: nothing of this advance is written).
    """
    from reliable_beat.workflows.errors import FencedOut

    now = db_now(conn)
    done = conn.execute(
        update(workflows)
        .where(workflows.c.id == claimed.pk, workflows.c.fence_token == claimed.fence_token)
        .values(
            history_len=workflows.c.history_len + events,
            history_bytes=workflows.c.history_bytes + size,
            lease_expires_at=now + claimed.lease,
            updated_at=now,
        )
    ).rowcount
    if done != 1:
        raise FencedOut(f"workflow {claimed.workflow_id!r}: fence {claimed.fence_token} is stale")
    return now


def _nudge_holder(store: Store, workflow_id: str) -> bool | None:
    """An advance found the workflow busy (another advance holds a live lease): make sure
    the holder sees the signals committed before this wake (PostgreSQL).

    :func:`signal` skips its ``wake_seq`` bump when the row is locked, so the holder's
    release (``WHERE wake_seq = :seen``) would not notice a signal that committed after it
    last read the inbox. If the workflow has an unconsumed signal, bump ``wake_seq`` here
    (this is a worker: it may wait for the holder's row lock), only while the lease is
    still live: the holder then runs its code again and reads the inbox.

    Returns:
        True: bumped; False: nothing to tell (no unconsumed signal, or not PostgreSQL,
        where every signal bumps); None: the lease is no longer live (released, ended or
        expired): claim again.
    """
    if store.dialect != "postgresql":
        return False
    with store.begin() as conn:
        now = db_now(conn)
        pk = conn.execute(select(workflows.c.id)
                          .where(workflows.c.workflow_id == workflow_id)).scalar()
        if pk is None:
            return False
        unread = conn.execute(
            select(workflow_signals.c.id).where(workflow_signals.c.workflow_pk == pk,
                                                workflow_signals.c.consumed_seq.is_(None))
            .limit(1)
        ).first()
        if unread is None:
            return False
        done = conn.execute(
            update(workflows)
            .where(workflows.c.id == pk, workflows.c.state == "running",
                   workflows.c.lease_expires_at >= now)
            .values(wake_seq=workflows.c.wake_seq + 1)
        ).rowcount
    return True if done == 1 else None


def _finish(store: Store, claimed: Claimed, **values: Any) -> str:
    """Record the end (completed / failed / blocked), fenced. Returns the state or 'fenced'."""
    with store.begin() as conn:
        if values.get("state") in TERMINAL_STATES:
            lock_for_end(conn, claimed.pk)  # first: decides the race with a signal()
        now = db_now(conn)
        if values.get("state") in TERMINAL_STATES:
            values["finished_at"] = now
        done = conn.execute(
            update(workflows)
            .where(workflows.c.id == claimed.pk, workflows.c.fence_token == claimed.fence_token)
            .values(leased_by=None, lease_expires_at=None, updated_at=now, **values)
        ).rowcount
        if done == 1 and values.get("state") in TERMINAL_STATES:
            drop_wakes(conn, claimed.workflow_id)
        if done == 1:  # a child's end tells its parent in the same transaction
            from reliable_beat.workflows.children import notify_parent

            notify_parent(conn, claimed.pk, str(values.get("state")), values.get("result"),
                          values.get("error"))
    if done != 1:
        return "fenced"
    return str(values["state"])


def block(store: Store, claimed: Claimed, reason: str) -> str:
    """Park the workflow ``blocked`` with ``reason``, fenced; writes no event."""
    log.error("workflow %s blocked: %s", claimed.workflow_id, reason)
    return _finish(store, claimed, state="blocked", block_reason=reason[:4000])


@_traced_advance
def advance(
    store: Store,
    workflow_id: str,
    *,
    owner: str,
    lease: timedelta = timedelta(seconds=60),
    max_loops: int = MAX_LOOPS,
    code_timeout: timedelta | None = timedelta(seconds=runaway.DEFAULT_CODE_TIMEOUT_SECONDS),
    max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS,
) -> str:
    """Advance one workflow as far as it can go now; the body of the advance task.

    Claims the workflow (fence + lease on the store's clock), replays its history through
    the registered function, records the frontier, and releases it (``waiting``) or ends it
    (``completed`` / ``failed`` / ``blocked``). Safe to call any number of times, from any
    number of processes: a second caller finds the lease held and returns ``"busy"`` (the
    holder sees the ``wake_seq`` bump that sent the second message).

    Args:
        store: the store.
        workflow_id: the business id.
        owner: this process's name, written to ``leased_by``.
        lease: how long the claim lasts without a write (each record renews it).
        max_loops: re-runs within this advance when wakes arrive while it runs.
        code_timeout: the longest the workflow function may run between two durable calls
            (``reliable_beat_workflow_code_timeout_seconds``); past it the advance is
            interrupted and the workflow parked ``blocked``. None: never interrupted.
        max_takeovers: a ``running`` workflow whose advance's lease expired this many
            takeovers in a row is parked ``blocked`` instead of claimed
            (``reliable_beat_workflow_max_takeovers``; :mod:`reliable_beat.workflows.runaway`).

    Returns:
        ``waiting``, ``completed``, ``failed``, ``blocked``, ``busy`` (another advance holds
        a live lease), ``fenced`` (a newer advance took over mid-way; this one wrote nothing
        after that), ``missing``, or the terminal state found.
    """
    from reliable_beat.workflows.context import WorkflowContext

    crash_point("advance.before_claim")
    claimed = _claim(store, workflow_id, owner, lease, max_takeovers)
    for _ in range(3):
        if claimed != "busy" or _nudge_holder(store, workflow_id) is not None:
            break
        claimed = _claim(store, workflow_id, owner, lease, max_takeovers)  # holder let go
    if isinstance(claimed, str):
        return claimed
    crash_point("advance.after_claim")
    definition = _registry.get(claimed.name)
    from reliable_beat.workflows import saga

    data_fn = saga.data_unwind_fn(claimed)  # `workflows compensate`: no code runs
    if data_fn is not None:
        definition = WorkflowDefinition(name=claimed.name, fn=data_fn)
    if definition is None:
        return block(
            store, claimed,
            f"unknown workflow {claimed.name!r}: no @workflow with that name is registered in "
            f"this process ({owner}); deploy the code, then `workflows resume`",
        )
    from reliable_beat.workflows.versioning import record_first_version, version_block_reason

    if claimed.version is None and definition.version is not None:
        # started by a process that does not register the workflow (start by name): the
        # first advance, before anything is recorded, records the version it runs under
        record_first_version(store, claimed, definition.version)
    too_old = version_block_reason(definition, claimed.version)
    if too_old:
        return block(store, claimed, too_old)
    for _ in range(max_loops):
        history, claimed.history = claimed.history, None
        if history is None:  # a wake arrived while the code ran: read what it brought
            with store.connect() as conn:
                history = load_history(conn, claimed.pk, claimed.run_no)
                # a `workflows cancel` is such a wake (it bumps wake_seq): read its request
                # on the same connection, so the code's cancel check needs no query of its own
                claimed.extra["cancel_requested"] = conn.execute(
                    select(workflows.c.cancel_requested).where(workflows.c.id == claimed.pk)
                ).scalar()
        ctx = WorkflowContext(store, claimed, history, definition, code_timeout=None
                              if code_timeout is None else code_timeout.total_seconds())
        outcome = ctx.run_code(definition.fn)
        if outcome != "suspended":
            return outcome
        crash_point("advance.before_release")
        with store.begin() as conn:
            released = conn.execute(
                update(workflows)
                .where(
                    workflows.c.id == claimed.pk,
                    workflows.c.fence_token == claimed.fence_token,
                    workflows.c.wake_seq == claimed.seen_wake_seq,
                )
                .values(state="waiting", leased_by=None, lease_expires_at=None,
                        updated_at=now_sql(conn))
            ).rowcount
            if released == 1:
                return "waiting"
            now = db_now(conn)
            row = _first(update_returning(
                conn,
                update(workflows)
                .where(workflows.c.id == claimed.pk,
                       workflows.c.fence_token == claimed.fence_token)
                .values(claimed_wake_seq=workflows.c.wake_seq,
                        lease_expires_at=now + lease, updated_at=now),
                workflows, [workflows.c.wake_seq],
            ))
            if row is None:
                return "fenced"
            claimed.seen_wake_seq = int(row.wake_seq)
    # woken max_loops times in a row: hand over to a fresh message rather than spin here
    with store.begin() as conn:
        now = db_now(conn)
        done = conn.execute(
            update(workflows)
            .where(workflows.c.id == claimed.pk, workflows.c.fence_token == claimed.fence_token)
            .values(state="waiting", leased_by=None, lease_expires_at=None, updated_at=now)
        ).rowcount
        if done != 1:
            return "fenced"
        add_wake(conn, workflow_id, claimed.queue, f"loop{claimed.fence_token}")
    return "waiting"


def replay_check(store: Store, workflow_id: str) -> str | None:
    """Run this process's code of a workflow against its stored history, writing nothing.

    Returns:
        None when the code matches the history up to its frontier (and, for an ended
        workflow, to the end), else the first mismatch naming the position and both sides
        (also when the workflow's name is not registered here).
    """
    from reliable_beat.workflows import malformed
    from reliable_beat.workflows.context import WorkflowContext

    with store.connect() as conn:
        rows = malformed.lenient_select(
            conn, select(workflows).where(workflows.c.workflow_id == workflow_id))
        if not rows:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        row = rows[0]
        try:
            history = load_history(conn, row.id, row.run_no)
        except ValueError:
            history = None
        problem = malformed.decode_problem(conn, int(row.id), workflow_id, int(row.run_no))
    if problem is None and history is not None:
        problem = malformed.shape_problem(workflow_id, int(row.run_no),
                                          [] if row.args is None else row.args,
                                          {} if row.kwargs is None else row.kwargs, history)
    if problem is not None or history is None:
        return malformed.reason(workflow_id, problem or "a history event does not decode")
    definition = _registry.get(row.name)
    if definition is None:
        return f"workflow name {row.name!r} is not registered in this process"
    claimed = Claimed(
        pk=row.id, workflow_id=workflow_id, name=row.name, run_no=row.run_no,
        args=list(row.args or []), kwargs=dict(row.kwargs or {}), queue=row.queue,
        random_seed=int(row.random_seed), fence_token=int(row.fence_token),
        seen_wake_seq=int(row.wake_seq), history_len=int(row.history_len),
        history_bytes=int(row.history_bytes), owner="replay", lease=timedelta(0),
        version=row.version,
    )
    from reliable_beat.workflows.versioning import version_block_reason

    too_old = version_block_reason(definition, row.version)
    if too_old:
        return too_old
    ctx = WorkflowContext(store, claimed, history, definition, dry_run=True)
    return ctx.replay_code(definition.fn)


# ------------------------------------------------------------------ re-dispatch ----


def redispatch_workflows(store: Store, *, older_than: timedelta, limit: int = 500,
                         retrying_after: timedelta | None = None,
                         queue_depths: QueueDepthFn | None = None,
                         max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS) -> int:
    """Send a wake to workflows whose advance died or whose wake was lost, and send again
    the activity and compensation messages the broker lost.

    Wakes, two cases (the sweep beside :func:`reliable_beat.redispatch.claim_stuck_runs`):
    ``running`` with a lease expired more than ``older_than`` ago (the holder died), and
    ``pending`` / ``waiting`` with ``wake_seq > claimed_wake_seq`` untouched for
    ``older_than`` (a wake the broker lost). The wake's message id carries the fence token
    and wake_seq, so each stuck state is re-sent once. A ``running`` one whose advance was
    already taken over ``max_takeovers`` times is parked ``blocked`` instead
    (:func:`reliable_beat.workflows.runaway.park_expired`): no wake, no worker.

    Timers and signal timeouts due for ``older_than`` on a workflow that has not advanced
    since: see :func:`_resend_lost_timer_wakes` (their delayed wake was lost by the broker).

    Activity and compensation messages of active workflows (events ``scheduled``): see
    :func:`_lost_activities` (a run never started, started by a worker that died,
    requeued and never claimed, or ``retrying`` with no retry message left). At least once:
    the run's idempotency key makes the effect once. Timer wakes and activity re-sends back
    off as the run sweep's re-sends do: the k-th re-send of one event waits
    ``older_than * 2**k`` (k capped at :data:`reliable_beat.redispatch.BACKOFF_CAP`,
    counted in ``workflow_events.redispatches``), so a message that only waits in a
    backlog is not re-sent once per window.

    Args:
        store: the store.
        older_than: how long a wake or an activity message may be outstanding before it is
            sent again (the relay: ``reliable_beat_redispatch_seconds``).
        limit: most workflows (and most activities) per call.
        retrying_after: how long an activity run may sit ``retrying`` untouched before its
            message is sent again; pick it above the retry backoff cap (the relay:
            ``redispatch_seconds + retry_cap_seconds``). None: ``older_than``.
        queue_depths: the adapter's broker probe
            (:data:`reliable_beat.redispatch.QueueDepthFn`; the relay passes its app's when
            ``reliable_beat_redispatch_backlog_check`` is on). With it, activity and
            compensation messages whose queue holds at least as many ready messages as
            would be re-sent there, all younger than the backoff cap, are not re-sent (a
            backlog, not a loss; :func:`reliable_beat.redispatch.hold_backlog`). None, or a
            probe that fails: re-sent as without it.
        max_takeovers: ``reliable_beat_workflow_max_takeovers`` (see above).

    Returns:
        How many wakes and activity messages were added.
    """
    with store.begin() as conn:
        now = db_now(conn)
        cutoff = now - older_than
        rows = conn.execute(
            select(workflows.c.id, workflows.c.workflow_id, workflows.c.queue,
                   workflows.c.fence_token, workflows.c.wake_seq, workflows.c.state,
                   workflows.c.takeovers, workflows.c.leased_by)
            .where(
                workflows.c.state.in_(ACTIVE_STATES),
                workflows.c.updated_at < cutoff,
                or_(
                    and_(workflows.c.state == "running", workflows.c.lease_expires_at < cutoff),
                    and_(workflows.c.state != "running",
                         workflows.c.wake_seq > workflows.c.claimed_wake_seq),
                ),
            )
            .order_by(workflows.c.updated_at)
            .limit(limit)
        ).all()
        parked = [r for r in rows
                  if r.state == "running" and runaway.park_expired(conn, r, now, max_takeovers)]
        rows = [r for r in rows if r not in parked]
        for r in rows:
            add_wake(conn, r.workflow_id, r.queue, f"sweep{r.fence_token}.{r.wake_seq}")
        swept = {r.workflow_id for r in rows + parked}
        timers = _resend_lost_timer_wakes(conn, now, cutoff, older_than, limit, swept)
        timers += _resend_lost_signal_wakes(conn, now, cutoff, older_than, limit, swept)
        retry_after = older_than if retrying_after is None else retrying_after
        lost = _lost_activities(conn, now, cutoff, older_than, limit, retry_after=retry_after)
        if queue_depths is None or not lost:
            return len(rows) + timers + _add_activity_resends(conn, lost, now, older_than)
    # ask the broker outside any transaction; the re-send's compare-and-set on the event's
    # count keeps a concurrent sweep from sending it twice meanwhile
    lost = _drop_backlogged(lost, queue_depths, now, older_than, retry_after)
    with store.begin() as conn:
        return len(rows) + timers + _add_activity_resends(conn, lost, now, older_than)


def _drop_backlogged(lost: list[tuple[Any, dict[str, Any]]], queue_depths: QueueDepthFn,
                     now: datetime, older_than: timedelta, retry_after: timedelta
                     ) -> list[tuple[Any, dict[str, Any]]]:
    """``lost`` without the messages whose queue is a backlog
    (:func:`reliable_beat.redispatch.hold_backlog`). An event is *young* while less than
    the backoff cap passed since its last re-send (or, never re-sent, since its state's
    wait began: the event's creation without a run, the lease's expiry of a ``running``
    run, the run's last update otherwise)."""
    from reliable_beat.redispatch import BACKOFF_CAP, backoff_wait, hold_backlog

    young = []
    for r, _payload in lost:
        since = r.redispatched_at or (r.created_at if r.run_state is None
                                      else r.lease_expires_at if r.run_state == "running"
                                      else r.run_updated_at)
        base = retry_after if r.run_state == "retrying" else older_than
        young.append(since is not None and now - since < backoff_wait(base, BACKOFF_CAP))
    messages = [outbox.OutboxMessage(id=0, message_id=f"act:{r.run_key}",
                                     destination=WAKE_DESTINATION, payload=payload)
                for r, payload in lost]
    held = hold_backlog(messages, young, queue_depths, every=older_than)
    return [found for i, found in enumerate(lost) if i not in held]


def _backed_off(now: datetime, after: timedelta) -> Any:
    """SQL condition on a ``workflow_events`` row: never re-sent by the sweep, or its last
    re-send (``redispatched_at``) older than ``after * 2**redispatches`` (capped): the run
    sweep's backoff rule (:func:`reliable_beat.redispatch.backoff_wait`), so a message that
    only waits in a backlog gets log2(backlog / after) + 1 copies, not one per window."""
    from reliable_beat.redispatch import waited_with_backoff

    ev = workflow_events.c
    return or_(ev.redispatched_at.is_(None),
               waited_with_backoff(ev.redispatched_at, ev.redispatches, now, after))


def _count_resend(conn: Connection, row: Any, now: datetime) -> bool:
    """Count one re-send on the event ``row`` (its ``workflow_pk``, ``run_no``, ``seq`` and
    the ``redispatches`` the sweep read): compare-and-set, so of two sweeps that read the
    same row only one re-sends it. False: another sweep counted it first (or it completed)."""
    ev = workflow_events.c
    done = conn.execute(
        update(workflow_events)
        .where(ev.workflow_pk == row.workflow_pk, ev.run_no == row.run_no, ev.seq == row.seq,
               ev.state == "scheduled", ev.redispatches == row.redispatches)
        .values(redispatches=ev.redispatches + 1, redispatched_at=now)
    )
    return bool(done.rowcount == 1)


def _resend_lost_timer_wakes(conn: Connection, now: datetime, cutoff: datetime,
                             older_than: timedelta, limit: int, skip: set[str]) -> int:
    """Wake ``pending`` / ``waiting`` workflows with a timer or signal timeout (an event
    ``scheduled`` with a ``fire_at``) due before ``cutoff`` whose row has not changed since
    ``cutoff``: the timer's wake (``wake:<id>:<run>t<seq>``, delayed to ``fire_at``) was
    lost by the broker after the relay sent it (a Redis restart without persistence), or
    arrived early (a wake row moved by SQL) and the advance went back to sleep. Once per
    workflow per ``older_than`` window (the message id carries the fence token and the
    window number); the advance it starts is fenced and replays, so a wake too many is a
    no-op. Backs off like the run sweep: the k-th wake for one timer waits
    ``older_than * 2**k`` (k capped; counted on the timer's event). ``skip``: workflows
    already woken by this sweep. Returns the wakes added."""
    j = workflow_events.join(workflows, workflows.c.id == workflow_events.c.workflow_pk)
    rows = conn.execute(
        select(workflows.c.workflow_id, workflows.c.queue, workflows.c.fence_token,
               workflow_events.c.workflow_pk, workflow_events.c.run_no,
               workflow_events.c.seq, workflow_events.c.redispatches)
        .select_from(j)
        .where(
            workflows.c.state.in_(("pending", "waiting")),
            workflows.c.updated_at < cutoff,
            workflow_events.c.run_no == workflows.c.run_no,
            workflow_events.c.state == "scheduled",
            workflow_events.c.fire_at.is_not(None),
            workflow_events.c.fire_at < cutoff,
            _backed_off(now, older_than),
        )
        .order_by(workflow_events.c.fire_at)
        .limit(limit)
    ).all()
    return _wake_swept(conn, rows, now, older_than, skip, "due",
                       "waits on a timer due before %s that no wake advanced (its wake was "
                       "lost): waking it", cutoff)


def _wake_swept(conn: Connection, rows: Sequence[Any], now: datetime, older_than: timedelta,
                skip: set[str], prefix: str, why: str, cutoff: datetime) -> int:
    """Add one wake per workflow of ``rows`` (a sweep's candidates: ``workflow_id``,
    ``queue``, ``fence_token`` and the event's resend columns) not in ``skip``, each counted
    on its event first (:func:`_count_resend`: another sweep's re-send in the same window
    wins); the wake's id is ``<prefix><fence>.r<window>`` so two sweeps of one window add
    one message. Logs ``why`` (with ``cutoff``) per wake. Returns the wakes added."""
    window = int(now.timestamp() // max(older_than.total_seconds(), 1.0))
    sent = 0
    for r in rows:
        if r.workflow_id in skip:
            continue
        skip.add(r.workflow_id)
        if not _count_resend(conn, r, now):
            continue
        log.warning("workflow sweep: workflow %s " + why, r.workflow_id, cutoff.isoformat())
        add_wake(conn, r.workflow_id, r.queue, f"{prefix}{r.fence_token}.r{window}")
        sent += 1
    return sent


def _resend_lost_signal_wakes(conn: Connection, now: datetime, cutoff: datetime,
                              older_than: timedelta, limit: int, skip: set[str]) -> int:
    """Wake ``pending`` / ``waiting`` workflows parked on a ``wait_signal(name)`` (an event
    ``signal`` ``scheduled`` in the current run) while a signal of that name, stored before
    ``cutoff``, sits unconsumed, and whose row has not changed since ``cutoff``: the
    signal's wake did not reach an advance that could read it (:func:`signal` skipped its
    ``wake_seq`` bump because an advance held the row, and the wake's advance failed, e.g.
    on the row lock of a holder frozen inside a transaction; or the broker lost the wake).
    Once per workflow per ``older_than`` window, backing off like the timer sweep (counted
    on the signal's event). ``skip``: workflows already woken by this sweep. Returns the
    wakes added."""
    ev, wf, sg = workflow_events.c, workflows.c, workflow_signals.c
    j = workflow_events.join(workflows, wf.id == ev.workflow_pk).join(
        workflow_signals, and_(sg.workflow_pk == ev.workflow_pk, sg.name == ev.name))
    rows = conn.execute(
        select(wf.workflow_id, wf.queue, wf.fence_token, ev.workflow_pk, ev.run_no, ev.seq,
               ev.redispatches)
        .select_from(j)
        .where(
            wf.state.in_(("pending", "waiting")),
            wf.updated_at < cutoff,
            ev.run_no == wf.run_no,
            ev.kind == "signal",
            ev.state == "scheduled",
            sg.consumed_seq.is_(None),
            sg.created_at < cutoff,
            _backed_off(now, older_than),
        )
        .order_by(sg.id)
        .limit(limit)
    ).all()
    return _wake_swept(conn, rows, now, older_than, skip, "sigsweep",
                       "waits for a signal stored before %s that no advance read (its wake "
                       "did not get through): waking it", cutoff)


def _lost_activities(conn: Connection, now: datetime, cutoff: datetime,
                     older_than: timedelta, limit: int, *,
                     retry_after: timedelta) -> list[tuple[Any, dict[str, Any]]]:
    """Activities and compensations (events ``scheduled`` before ``cutoff``, workflow
    active) whose message is gone, with the message to send again (same key: the run
    deduplicates; :func:`_add_activity_resends` adds it), at most once per ``older_than``
    window (the message id carries the window number), and backing off: the k-th re-send
    of one event waits ``older_than * 2**k`` after the previous one (``retry_after * 2**k``
    for a ``retrying`` run; k capped, counted in the event's ``redispatches``), the run
    sweep's rule (:func:`reliable_beat.redispatch.backoff_wait`). A message that waits in a
    backlog looks exactly like a lost one; re-sending it every window grew the backlog.
    Their run is

    * absent: the message never reached a worker (lost by the broker, or never published);
    * ``running`` with a lease expired before ``cutoff``: the worker died in the body;
    * ``scheduled`` / ``dispatched`` untouched since ``cutoff``: requeued (``workflows
      compensate``, ``dead-letters requeue``) and its message lost;
    * ``retrying`` untouched for ``retry_after``: a transient failure whose retry
      message was lost, or a lease cleared by a person (``reliable-beat lease clear``).

    The run sweep (:func:`reliable_beat.redispatch.claim_stuck_runs`) never takes these
    runs: they have no trigger row.

    Returns:
        ``(event row, celery payload)`` per activity, oldest event first; an event whose
        stored args are malformed is logged and left out."""
    j = workflow_events.join(workflows, workflows.c.id == workflow_events.c.workflow_pk
                             ).outerjoin(runs, runs.c.idempotency_key == workflow_events.c.run_key)
    rows = conn.execute(
        select(workflow_events.c.run_key, workflow_events.c.name,
               cast(workflow_events.c.args, Text).label("args"), workflows.c.queue,
               workflows.c.schedule_group, workflow_events.c.workflow_pk,
               workflow_events.c.run_no, workflow_events.c.seq,
               workflow_events.c.redispatches, workflow_events.c.redispatched_at,
               workflow_events.c.created_at, runs.c.state.label("run_state"),
               runs.c.lease_expires_at, runs.c.updated_at.label("run_updated_at"))
        .select_from(j)
        .where(
            workflow_events.c.kind.in_(("activity", "compensation")),
            workflow_events.c.state == "scheduled",
            workflow_events.c.created_at < cutoff,
            workflows.c.state.in_(ACTIVE_STATES),
            or_(and_(or_(runs.c.id.is_(None),
                         and_(runs.c.state == "running", runs.c.lease_expires_at < cutoff),
                         and_(runs.c.state.in_(("scheduled", "dispatched")),
                              runs.c.updated_at < cutoff)),
                     _backed_off(now, older_than)),
                and_(runs.c.state == "retrying", runs.c.updated_at < now - retry_after,
                     _backed_off(now, retry_after))),
        )
        .order_by(workflow_events.c.created_at)
        .limit(limit)
    ).all()
    found: list[tuple[Any, dict[str, Any]]] = []
    for r in rows:
        try:  # read as text: one corrupted event must not stop the sweep for every workflow
            stored = r.args if r.args is None or not isinstance(r.args, str) \
                else json.loads(r.args)
            call = list(stored or [[], {}, None])
            args, kwargs = list(call[0]), dict(call[1])
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            log.error("workflow sweep: activity %s is not re-sent: its event's args are "
                      "malformed (%s): %r; the workflow's next advance blocks it naming "
                      "the row (`reliable-beat workflows show`)", r.run_key, exc,
                      str(r.args)[:80])
            continue
        call = [args, kwargs, *call[2:]]
        payload: dict[str, Any] = {"task": r.name, "args": call[0], "kwargs": call[1],
                                   "headers": {"reliable_beat_key": r.run_key}}
        if len(call) > 2 and call[2]:
            payload["options"] = {"queue": call[2]}
        found.append((r, payload))
    return found


def _add_activity_resends(conn: Connection, found: list[tuple[Any, dict[str, Any]]],
                          now: datetime, older_than: timedelta) -> int:
    """Add the messages :func:`_lost_activities` found to the outbox (joins ``conn``), each
    counted on its event first (:func:`_count_resend`: of two sweeps, one sends). Returns
    how many were added."""
    window = int(now.timestamp() // max(older_than.total_seconds(), 1.0))
    sent = 0
    for r, payload in found:
        if not _count_resend(conn, r, now):
            continue  # another sweep re-sent it meanwhile
        outbox.add(conn, WAKE_DESTINATION, payload, key=f"act:{r.run_key}:r{window}",
                   schedule_group=r.schedule_group)
        sent += 1
    return sent


# ------------------------------------------------------------------ reading ----


def _row_dict(row: Any) -> dict[str, Any]:
    m = dict(row._mapping)
    return {
        "workflow_id": m["workflow_id"], "name": m["name"], "state": m["state"],
        "run_no": m["run_no"], "args": m["args"], "kwargs": m["kwargs"],
        "result": m["result"], "error": m["error"], "block_reason": m["block_reason"],
        "version": m.get("version"), "queue": m["queue"], "fence_token": m["fence_token"],
        "leased_by": m["leased_by"], "entry_name": m.get("entry_name"),
        "slot_fire_at": m.get("fire_at"), "schedule_group": m.get("schedule_group"),
        "lease_expires_at": m["lease_expires_at"], "wake_seq": m["wake_seq"],
        "claimed_wake_seq": m["claimed_wake_seq"], "history_len": m["history_len"],
        "advances": m["advances"], "takeovers": m.get("takeovers", 0),
        "created_at": m["created_at"],
        "updated_at": m["updated_at"], "finished_at": m["finished_at"],
        "cancel_requested": m.get("cancel_requested"),
    }


def get_workflow(store: Store, workflow_id: str, *, events: bool = False) -> dict[str, Any]:
    """One workflow as a dict (see :meth:`WorkflowHandle.status`); with ``events`` also
    ``"events"`` (``[{"seq", "kind", "name", "state", "result", "error", "fire_at",
    "run_key", "args_digest"}]``) and ``"signals"`` (pending and consumed).

    Raises:
        WorkflowNotFound: no such workflow.
    """
    from reliable_beat.workflows.malformed import lenient_select

    with store.connect() as conn:
        found = lenient_select(
            conn, select(workflows).where(workflows.c.workflow_id == workflow_id))
        if not found:
            raise WorkflowNotFound(f"no workflow {workflow_id!r} (see `workflows list`)")
        row = found[0]
        out = _row_dict(row)
        if events:
            evs = lenient_select(
                conn,
                select(workflow_events)
                .where(workflow_events.c.workflow_pk == row.id,
                       workflow_events.c.run_no == row.run_no)
                .order_by(workflow_events.c.seq)
            )
            out["events"] = [
                {k: e._mapping[k] for k in ("seq", "kind", "name", "args_digest", "state",
                                            "result", "error", "fire_at", "run_key",
                                            "fence_token", "created_at", "completed_at")}
                for e in evs
            ]
            sigs = lenient_select(
                conn,
                select(workflow_signals).where(workflow_signals.c.workflow_pk == row.id)
                .order_by(workflow_signals.c.id)
            )
            out["signals"] = [
                {k: s._mapping[k] for k in ("id", "name", "payload", "dedup_key",
                                            "consumed_run_no", "consumed_seq", "created_at")}
                for s in sigs
            ]
    return out


def list_workflows(
    store: Store, *, state: str | None = None, name: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Workflows newest first, optionally of one state / name."""
    q = select(workflows).order_by(workflows.c.id.desc()).limit(limit)
    if state:
        q = q.where(workflows.c.state == state)
    if name:
        q = q.where(workflows.c.name == name)
    from reliable_beat.workflows.malformed import lenient_select

    with store.connect() as conn:
        return [_row_dict(r) for r in lenient_select(conn, q)]


def workflow_counts(conn: Connection) -> dict[str, int]:
    """``{state: count}`` over all workflows (for ``status`` and metrics)."""
    rows = conn.execute(
        select(workflows.c.state, func.count()).group_by(workflows.c.state)
    ).all()
    return {str(s): int(n) for s, n in rows}


def overdue_timers(conn: Connection, *, grace: timedelta) -> int:
    """Timer / timeout events still ``scheduled`` more than ``grace`` after their fire_at
    on a workflow that is not running (a wake that did not arrive)."""
    now = db_now(conn)
    return int(conn.execute(
        select(func.count())
        .select_from(workflow_events.join(workflows,
                                          workflows.c.id == workflow_events.c.workflow_pk))
        .where(workflow_events.c.state == "scheduled",
               workflow_events.c.fire_at < now - grace,
               workflows.c.state == "waiting")
    ).scalar_one())


#: Advances of one workflow (claims since its last resume) past which it is crash-looping.
CRASH_LOOP_ADVANCES = 50


def workflow_health(
    store: Store, *, grace: timedelta,
    pending_after: timedelta = timedelta(seconds=runaway.DEFAULT_PENDING_ALARM_SECONDS),
    max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS,
) -> dict[str, Any]:
    """For ``reliable-beat status``: ``{"counts": {state: n}, "blocked": [ids],
    "overdue_timers": n, "crash_looping": [ids], "malformed_states": [ids of workflows
    whose state is none the engine writes], "advances_expiring": {"count", "workflows":
    [{"workflow_id", "takeovers", "leased_by", "lease_expires_at"}]}, "pending_late":
    {"count", "queues": {queue: n}, "workflow_ids"}, "problems": [str]}``.

    ``overdue_timers``: timers / signal timeouts of waiting workflows still scheduled more
    than ``grace`` after their fire_at (no relay publishes wakes?). ``crash_looping``: active
    workflows claimed more than :data:`CRASH_LOOP_ADVANCES` times (an advance that dies every
    time, e.g. a step that kills the worker). ``advances_expiring``: ``running`` workflows
    whose advance's lease expired twice in a row without finishing; ``pending_late``:
    ``pending`` longer than ``pending_after``
    (:mod:`reliable_beat.workflows.runaway`; ``max_takeovers`` is named in the advice).
    """
    with store.connect() as conn:
        counts = workflow_counts(conn)
        blocked_rows = conn.execute(
            select(workflows.c.workflow_id, workflows.c.block_reason)
            .where(workflows.c.state == "blocked")
            .order_by(workflows.c.updated_at).limit(20)).all()
        blocked = [r.workflow_id for r in blocked_rows]
        # a saga whose compensation was dead-lettered is unblocked by running the
        # compensations again (`workflows compensate`), not by `resume`
        by_compensation = [r.workflow_id for r in blocked_rows
                           if str(r.block_reason or "").startswith("compensation_failed")]
        overdue = overdue_timers(conn, grace=grace)
        overdue_ids = list(conn.execute(
            select(workflows.c.workflow_id).distinct()
            .select_from(workflow_events.join(
                workflows, workflows.c.id == workflow_events.c.workflow_pk))
            .where(workflow_events.c.state == "scheduled",
                   workflow_events.c.fire_at < db_now(conn) - grace,
                   workflows.c.state == "waiting")
            .limit(10)).scalars()) if overdue else []
        from reliable_beat.workflows.malformed import unknown_states

        n_unknown, unknown = unknown_states(conn)
        looping = list(conn.execute(
            select(workflows.c.workflow_id)
            .where(workflows.c.state.in_(ACTIVE_STATES),
                   workflows.c.advances > CRASH_LOOP_ADVANCES).limit(20)).scalars())
        now = db_now(conn)
        expiring = runaway.expiring_advances(conn, now)
        pending = runaway.late_pending(conn, now, after=pending_after)
    # parked by a runaway guard: the reason starts with the guard's tag
    runaways = [r.workflow_id for r in blocked_rows
                if str(r.block_reason or "").startswith(("code_timeout:", "advance_expired:"))]
    problems = []
    if blocked:
        problems.append(
            f"BLOCKED WORKFLOWS: {counts.get('blocked', 0)} workflows wait for a person "
            f"({', '.join(blocked[:10])}): `reliable-beat workflows show ID` gives the reason; "
            "fix the code, then `reliable-beat workflows resume ID`"
            + (f"; for a failed compensation ({', '.join(by_compensation[:10])}): fix it, then "
               "`reliable-beat workflows compensate ID`" if by_compensation else "")
            + (f"; runaway code parked ({', '.join(runaways[:10])}): it ran past "
               f"{runaway.CODE_TIMEOUT_SETTING} between durable calls, or its advance's lease "
               f"kept expiring ({runaway.MAX_TAKEOVERS_SETTING}): fix the loop or the hung "
               "call, restart workers still stuck in it, then resume" if runaways else "")
        )
    problems.extend(runaway.problems(expiring, pending, pending_after=pending_after,
                                     max_takeovers=max_takeovers))
    if overdue:
        problems.append(
            f"OVERDUE TIMERS: {overdue} workflow timers are more than {grace.total_seconds():g}"
            f" s past due ({', '.join(overdue_ids[:10])}): their wake was lost or no relay "
            "runs. A running relay's sweep re-sends such a wake within "
            "reliable_beat_redispatch_seconds of the timer; kick one now with "
            "`reliable-beat workflows resume ID`; if none advances, start a relay "
            "(`reliable-beat relay`) and check its log"
        )
    if looping:
        problems.append(
            f"CRASH-LOOPING WORKFLOWS: {', '.join(looping[:10])} were claimed more than "
            f"{CRASH_LOOP_ADVANCES} times: see the workers' logs"
        )
    if unknown:
        problems.append(
            f"MALFORMED WORKFLOW ROWS: {n_unknown} workflows have a state the engine never "
            f"writes ({', '.join(unknown[:10])}): nothing advances them and signals to them "
            "are refused. Set the state back by SQL (e.g. 'blocked', then `reliable-beat "
            "workflows resume ID`) or terminate them: `reliable-beat workflows cancel ID "
            "--no-compensate`"
        )
    return {"counts": counts, "blocked": blocked, "overdue_timers": overdue,
            "crash_looping": looping, "malformed_states": unknown,
            "advances_expiring": {"count": expiring[0], "workflows": expiring[1]},
            "pending_late": {"count": pending[0], "queues": pending[1],
                             "workflow_ids": pending[2]},
            "problems": problems}
