"""Scheduled workflows: a beat entry whose task is :data:`START_TASK` starts a workflow per
slot (docs/workflows.md, "Scheduled workflows").

::

    app.conf.beat_schedule = {
        "nightly-report": {"task": "reliable_beat.workflow.start",
                           "schedule": crontab(hour=2, minute=0),
                           "args": ["shop.report", "eu"],      # workflow name, then its args
                           "options": {"reliable_beat": {"overlap_policy": "skip"}}},
    }

The start task is an ``IdempotentTask`` keyed like every slot (``<entry>@<slot ISO Z>``), and
that key is the **workflow id**: the run's completion and the workflow's row (and its first
wake) commit in one transaction, and ``start`` is idempotent on the id, so a slot starts its
workflow once whatever the beats, relays and brokers duplicate. The workflow row records the
entry and the slot (``entry_name``, ``fire_at``); the beat's overlap policy (``skip``,
``buffer_one``) treats an entry whose previous slot's workflow is still ``pending``,
``running``, ``waiting`` or ``blocked`` as running.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from reliable_beat.db.tables import entries, runs, workflows
from reliable_beat.workflow_store import OVERLAP_STATES, active_entries
from reliable_beat.workflows import registry
from reliable_beat.workflows.errors import WorkflowNotFound

__all__ = ["OVERLAP_STATES", "START_TASK", "active_entries", "start_for_slot"]

#: The task a beat entry names to start a workflow (args: workflow name, then its args).
START_TASK = "reliable_beat.workflow.start"


def start_for_slot(conn: Connection, name: str, key: str, args: Sequence[Any],
                   kwargs: dict[str, Any]) -> str:
    """Start workflow ``name`` with id ``key`` (the slot's idempotency key) in ``conn``'s
    transaction, recording the slot's entry and fire time from its run row.

    Returns:
        The workflow id (``key``).

    Raises:
        WorkflowNotFound: no workflow ``name`` is registered in this process (the run
            retries, then dead-letters naming it).
    """
    definition = registry.get_definition(name)
    if definition is None:
        raise WorkflowNotFound(
            f"{START_TASK}: no workflow {name!r} is registered in this process: the entry's "
            "first argument must be a @workflow name (deploy the code that registers it)"
        )
    slot = conn.execute(
        select(runs.c.entry_name, runs.c.fire_at).where(runs.c.idempotency_key == key)
    ).first()
    # the workflow's messages go where its entry's triggers go: the entry's schedule group
    group = None if slot is None or slot.entry_name is None else conn.execute(
        select(entries.c.schedule_group).where(entries.c.name == slot.entry_name)
    ).scalar()
    registry.start(conn, name, key, args, kwargs, queue=definition.queue,
                   version=definition.version, schedule_group=group)
    if slot is not None and slot.entry_name is not None:
        conn.execute(
            update(workflows)
            .where(workflows.c.workflow_id == key, workflows.c.entry_name.is_(None))
            .values(entry_name=slot.entry_name, fire_at=slot.fire_at)
        )
    return key


def slot_of(workflow: dict[str, Any]) -> tuple[str | None, datetime | None]:
    """``(entry, fire_at)`` of a workflow started by a beat entry (from its row)."""
    return workflow.get("entry_name"), workflow.get("fire_at")
