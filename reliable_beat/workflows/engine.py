"""The durable workflow engine's front door: its names, re-exported from the rooms that hold
them (docs/development.md draws the rooms).

Framework-neutral: messages are outbox rows (destination :data:`WAKE_DESTINATION`, payload
``{"task", "args", "kwargs", "headers"?, "options"?}``) that an adapter's relay publishes;
the Celery adapter (:mod:`reliable_beat.celery.workflows`) registers the advance task
:data:`ADVANCE_TASK` that calls :func:`advance`.

* :mod:`~reliable_beat.workflows.registry`: ``@workflow`` definitions, ``start`` and its
  handle; :mod:`~reliable_beat.workflows.lifecycle`: signals, resume, the end of a workflow;
* :mod:`~reliable_beat.workflows.advance`: the advance (claim, replay, record, release) and
  the offline replay check; :mod:`~reliable_beat.workflows.sweep`: the workflow sweep;
* :mod:`~reliable_beat.workflows.queries`: reading workflows and their health;
* :mod:`~reliable_beat.workflows.history`: positions, digests, the claimed row, the fence
  check; :mod:`~reliable_beat.workflows.crashes`: the crash points tests kill at.

``engine.crash_hook = fn`` (the in-process tests' seam) sets the hook
:func:`~reliable_beat.workflows.crashes.crash_point` calls: this module forwards the
attribute to :mod:`reliable_beat.workflows.crashes`, which the rooms below it read.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

from reliable_beat.outbox import db_now as db_now
from reliable_beat.workflow_store import (
    ADVANCE_TASK,
    WAKE_DESTINATION,
    activity_key,
    on_run_finished,
)
from reliable_beat.workflow_store import add_wake as add_wake
from reliable_beat.workflow_store import group_of as group_of
from reliable_beat.workflow_store import now_sql as now_sql
from reliable_beat.workflow_store import parse_activity_key as parse_activity_key
from reliable_beat.workflows import crashes
from reliable_beat.workflows.advance import MAX_LOOPS as MAX_LOOPS
from reliable_beat.workflows.advance import advance
from reliable_beat.workflows.advance import replay_check as replay_check
from reliable_beat.workflows.crashes import crash_point as crash_point
from reliable_beat.workflows.errors import WorkflowBlockedError as WorkflowBlockedError
from reliable_beat.workflows.errors import WorkflowConflict as WorkflowConflict
from reliable_beat.workflows.errors import WorkflowFailed as WorkflowFailed
from reliable_beat.workflows.errors import WorkflowNotFound as WorkflowNotFound
from reliable_beat.workflows.history import (
    ACTIVE_STATES,
    DEFAULT_HISTORY_LIMIT,
    TERMINAL_STATES,
    args_digest,
)
from reliable_beat.workflows.history import MAX_WORKFLOW_ID as MAX_WORKFLOW_ID
from reliable_beat.workflows.history import Claimed as Claimed
from reliable_beat.workflows.history import canonical_json as canonical_json
from reliable_beat.workflows.history import error_json as error_json
from reliable_beat.workflows.history import fence_check as fence_check
from reliable_beat.workflows.history import load_history as load_history
from reliable_beat.workflows.history import to_json as to_json
from reliable_beat.workflows.lifecycle import block as block
from reliable_beat.workflows.lifecycle import drop_wakes as drop_wakes
from reliable_beat.workflows.lifecycle import lock_for_end as lock_for_end
from reliable_beat.workflows.lifecycle import log as log
from reliable_beat.workflows.lifecycle import resume, signal
from reliable_beat.workflows.queries import CRASH_LOOP_ADVANCES as CRASH_LOOP_ADVANCES
from reliable_beat.workflows.queries import get_workflow, list_workflows
from reliable_beat.workflows.queries import overdue_timers as overdue_timers
from reliable_beat.workflows.queries import workflow_counts as workflow_counts
from reliable_beat.workflows.queries import workflow_health as workflow_health
from reliable_beat.workflows.registry import (
    WorkflowDefinition,
    WorkflowHandle,
    get_definition,
    register,
    start,
)
from reliable_beat.workflows.registry import _registry as _registry
from reliable_beat.workflows.sweep import redispatch_workflows

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

#: Test seam (forwarded to :data:`reliable_beat.workflows.crashes.crash_hook`): called with
#: the name of each crash point.
crash_hook: Callable[[str], None] | None


class _Engine(types.ModuleType):
    """This module's type: ``crash_hook`` reads and writes the hook in
    :mod:`reliable_beat.workflows.crashes` (the rooms below import that module, never this
    one)."""

    @property
    def crash_hook(self) -> Callable[[str], None] | None:
        return crashes.crash_hook

    @crash_hook.setter
    def crash_hook(self, hook: Callable[[str], None] | None) -> None:
        crashes.crash_hook = hook


sys.modules[__name__].__class__ = _Engine
