"""Workflow definitions: the registry of ``@workflow`` functions, their version rules, and
``start`` (it takes the registered definition's version and schedule group; a definition's
``start`` is it), with the :class:`WorkflowHandle` it returns."""

from __future__ import annotations

import functools
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from reliable_beat import tracing
from reliable_beat import values as rb_values
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflows
from reliable_beat.outbox import db_now, insert_ignore
from reliable_beat.redaction import get_logger, redact_value
from reliable_beat.workflow_store import add_wake
from reliable_beat.workflows import limits
from reliable_beat.workflows.errors import (
    WorkflowBlockedError,
    WorkflowConflict,
    WorkflowFailed,
    WorkflowNotFound,
)
from reliable_beat.workflows.history import (
    DEFAULT_HISTORY_LIMIT,
    MAX_WORKFLOW_ID,
    insert_one_ignored,
    to_json,
    transaction,
)
from reliable_beat.workflows.queries import get_workflow

__all__ = [
    "WorkflowDefinition",
    "WorkflowHandle",
    "get_definition",
    "parse_version",
    "register",
    "start",
    "version_block_reason",
]

log = get_logger("reliable_beat.workflows")

_VERSION = re.compile(r"^\d+(\.\d+)*$")


def parse_version(value: str, what: str = "version") -> tuple[int, ...]:
    """``"2"`` -> ``(2,)``, ``"1.10"`` -> ``(1, 10)`` (compared numerically).

    Raises:
        ValueError: not dot-separated non-negative integers (names ``what`` and the value).
    """
    if not isinstance(value, str) or not _VERSION.match(value) or len(value) > 64:
        raise ValueError(
            f"{what} must be a string of dot-separated integers of at most 64 characters "
            f"(e.g. \"3\" or \"2.1\"), got {value!r}"
        )
    return tuple(int(p) for p in value.split("."))


def version_block_reason(definition: WorkflowDefinition, recorded: str | None) -> str | None:
    """Why this process's code refuses a run started under version ``recorded``, or None.

    A run without a recorded version (started by code that declared none) counts as below
    any minimum.
    """
    minimum = definition.min_supported_version
    if minimum is None:
        return None
    if recorded is not None:
        try:
            if parse_version(recorded) >= parse_version(minimum):
                return None
        except ValueError:
            pass  # an unreadable recorded version cannot be shown to be supported
    return (
        f"version: the run started under version {recorded or '(none)'} of workflow "
        f"{definition.name!r}; this code (version {definition.version}) supports "
        f"min_supported_version {minimum}: deploy code that still replays it (use "
        "ctx.patched for the change, keep the old branch), then `workflows resume`; or "
        "cancel it"
    )


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


def _traceparent_column() -> dict[str, str]:
    """``{"traceparent": ...}`` while tracing records a span, else nothing: a store not yet
    upgraded to the column (new code during a rolling deploy) starts workflows as before."""
    tp = tracing.current_traceparent()
    return {"traceparent": tp} if tp else {}


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
    with transaction(target) as conn:
        now = db_now(conn)
        inserted = insert_one_ignored(conn, insert_ignore(conn, workflows).values(
            workflow_id=workflow_id, name=name, version=version, run_no=1, state="pending",
            args=call_args, kwargs=call_kwargs, queue=queue, schedule_group=schedule_group,
            random_seed=secrets.randbits(62), fence_token=0, wake_seq=1,
            claimed_wake_seq=0, history_len=0, history_bytes=0, advances=0,
            created_at=now, updated_at=now, **_traceparent_column(),
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

