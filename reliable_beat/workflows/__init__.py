"""Durable workflows on the reliable_beat store (docs/workflows.md).

A workflow is a function ``fn(ctx, *args)`` run by an *advance* from the top on every wake-up;
each durable call (``ctx.transaction``, ``ctx.step``, ``ctx.activity``, ``ctx.sleep``,
``ctx.wait_signal``, ``ctx.now``) takes the next position in the run's history and is
answered from it when recorded. A waiting workflow is data: it holds no worker, no unacked
message and no ETA message.

Public API::

    from reliable_beat.workflows import workflow, signal, WorkflowContext

    @workflow(app, name="shop.fulfil", queue="workflows")
    def fulfil(ctx: WorkflowContext, order_id: str) -> dict: ...

    handle = fulfil.start("order:42", args=("42",))          # idempotent on the id
    with store.begin() as tx:                                  # transactional start
        fulfil.start("order:43", args=("43",), conn=tx)
    signal(store, "order:42", "approved", True, key="approval:42")
    handle.result(timeout=30)

The engine is framework-neutral; passing a Celery app to :func:`workflow` installs the Celery
adapter (:mod:`reliable_beat.celery.workflows`: the advance task), imported only then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reliable_beat.adapters import adapter_for
from reliable_beat.workflows.context import ActivityHandle, WorkflowContext, WorkflowInfo
from reliable_beat.workflows.engine import (
    ADVANCE_TASK,
    DEFAULT_HISTORY_LIMIT,
    WorkflowDefinition,
    WorkflowHandle,
    advance,
    get_workflow,
    list_workflows,
    redispatch_workflows,
    register,
    resume,
    signal,
    start,
)
from reliable_beat.workflows.errors import (
    ActivityError,
    NonDeterminismError,
    Suspend,
    WorkflowBlockedError,
    WorkflowCancelled,
    WorkflowConflict,
    WorkflowControl,
    WorkflowError,
    WorkflowFailed,
    WorkflowNotFound,
    WorkflowUsageError,
    WorkflowValueError,
)
from reliable_beat.workflows.limits import MAX_TIMER
from reliable_beat.workflows.saga import Saga, cancel, compensate

__all__ = [
    "ADVANCE_TASK",
    "DEFAULT_HISTORY_LIMIT",
    "MAX_TIMER",
    "ActivityError",
    "ActivityHandle",
    "NonDeterminismError",
    "Saga",
    "Suspend",
    "WorkflowBlockedError",
    "WorkflowCancelled",
    "WorkflowConflict",
    "WorkflowContext",
    "WorkflowControl",
    "WorkflowDefinition",
    "WorkflowError",
    "WorkflowFailed",
    "WorkflowHandle",
    "WorkflowInfo",
    "WorkflowNotFound",
    "WorkflowUsageError",
    "WorkflowValueError",
    "advance",
    "cancel",
    "compensate",
    "get_workflow",
    "list_workflows",
    "redispatch_workflows",
    "register",
    "resume",
    "signal",
    "start",
    "workflow",
]


def workflow(
    app: Any = None,
    *,
    name: str,
    queue: str | None = None,
    history_limit: int = DEFAULT_HISTORY_LIMIT,
    version: str | None = None,
    min_supported_version: str | None = None,
    continue_as_new_after: int | None = None,
) -> Callable[[Callable[..., Any]], WorkflowDefinition]:
    """Register a workflow function under the stable ``name``.

    Args:
        app: a Celery app (installs the advance task on it and takes the store from its
            ``reliable_beat_database_url``), or None (framework-neutral: pass ``store=`` /
            ``conn=`` to ``start`` and drive :func:`advance` yourself).
        name: the registered name, recorded on every workflow row: never rename it.
        queue: the queue of its advance messages (None: default routing).
        history_limit: events per run past which the workflow is blocked (default 2,000).
        version: this code's version (``"3"``, ``"2.1"``), recorded on each run it starts
            or continues (optional pinning; ``ctx.patched`` is the tool for changes).
        min_supported_version: runs recorded under a lower version (or none) are parked
            ``blocked`` with the reason instead of replayed (a guard, not routing).
        continue_as_new_after: position from which ``ctx.info.continue_as_new_suggested``
            is True (default: half of ``history_limit``).

    Raises:
        ValueError: a version that is not dot-separated integers, a minimum above the
            version, or ``continue_as_new_after`` not below ``history_limit``.

    Returns:
        A decorator giving a :class:`WorkflowDefinition` (``.start(...)``).
    """

    def decorate(fn: Callable[..., Any]) -> WorkflowDefinition:
        definition = WorkflowDefinition(name=name, fn=fn, queue=queue,
                                        history_limit=history_limit, version=version,
                                        min_supported_version=min_supported_version,
                                        continue_as_new_after=continue_as_new_after)
        if app is not None:
            adapter = adapter_for(app)
            definition.store_factory = adapter.install_workflows(app)
            # the workflows it starts are published only by its app's relays (optional hook)
            group_of_app = getattr(adapter, "workflow_schedule_group", None)
            if group_of_app is not None:
                definition.schedule_group_factory = lambda: group_of_app(app)
        return register(definition)

    return decorate
