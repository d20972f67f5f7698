"""Celery adapter of the workflow engine: the advance task.

:func:`install` registers ``reliable_beat.workflow.advance`` on an app (once). Its body is
:func:`reliable_beat.workflows.engine.advance`; everything else (history, replay, fencing,
timers, signals) is framework-neutral. Activities are ordinary ``IdempotentTask`` tasks: their
completion writes the workflow's history inside their own completing transaction
(:func:`reliable_beat.runs.complete` -> :func:`reliable_beat.workflow_store.on_run_finished`).

The advance is ``acks_late``: a worker killed mid-advance leaves its message to be redelivered
and its lease to expire; the next advance takes over with a new fence token and replays.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from reliable_beat import handoff
from reliable_beat.celery.publishing import publish_celery_batch
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.execution import _store_for
from reliable_beat.groups import schedule_group_of
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings
from reliable_beat.workflows import engine
from reliable_beat.workflows.scheduled import START_TASK, start_for_slot

__all__ = ["install"]

log = get_logger("reliable_beat.workflows")


def install(app: Any) -> Callable[[], Store]:
    """Register the advance task on ``app`` (idempotent) and return its store factory.

    The store is this process's (created lazily, per process after fork), from the app's
    ``reliable_beat_database_url``; the lease is ``reliable_beat_lease_seconds``; the code
    deadline and the takeover limit are ``reliable_beat_workflow_code_timeout_seconds`` and
    ``reliable_beat_workflow_max_takeovers`` (:mod:`reliable_beat.workflows.runaway`).
    """
    settings_box: dict[str, Settings] = {}
    group_box: dict[str, str | None] = {}

    def settings() -> Settings:
        if "s" not in settings_box:
            settings_box["s"] = Settings.from_celery(app)
        return settings_box["s"]

    def store_factory() -> Store:
        return _store_for(settings().database_url)

    def run_advance(workflow_id: str) -> str:
        s, store = settings(), store_factory()
        # the messages it publishes are marked sent by its release (reliable_beat.handoff)
        with handoff.publishing_for(app), handoff.deferred_marks(store):
            return engine.advance(
                store, workflow_id, owner=s.owner,
                lease=timedelta(seconds=s.lease_seconds),
                code_timeout=timedelta(seconds=s.workflow_code_timeout_seconds),
                max_takeovers=s.workflow_max_takeovers,
            )

    def advance_here(store: Store, wake: handoff.Wake) -> str | None:
        """The worker that completed one of a workflow's activities advances it at once
        (no wake through the broker) when it could receive that wake itself: it runs the
        workflow's code, it took the activity from the workflow's queue, same store."""
        if engine.get_definition(wake.name) is None:
            return None
        request = getattr(app.current_worker_task, "request", None)
        if request is None or request.is_eager:
            return None
        queue = wake.queue or app.conf.task_default_queue
        if (request.delivery_info or {}).get("routing_key") != queue:
            return None
        if store.engine.url != store_factory().engine.url:
            return None
        # the activity committed, its wake is pending (due to the relays after
        # handoff.HANDOFF_DELAY): a crash from here on leaves it to them
        engine.crash_point("handoff.before_advance")
        outcome = run_advance(wake.workflow_id)
        log.info("workflow %s advanced by the worker of its activity: %s",
                 wake.workflow_id, outcome)
        return outcome

    def publisher() -> tuple[handoff.Publish, str | None, handoff.Advance]:
        if "g" not in group_box:  # the group the workflows of this app record (adapter)
            group_box["g"] = schedule_group_of(app, settings().schedule_group)
        return ((lambda messages: publish_celery_batch(app, messages)), group_box["g"],
                advance_here)

    # the next message of a workflow (an activity's) is published by the process that
    # committed it, right after the commit, and a completed activity's workflow is advanced
    # by the worker that completed it; the relay stays the safety net
    handoff.register(app, publisher)

    if engine.ADVANCE_TASK not in app.tasks:

        @app.task(  # type: ignore[untyped-decorator]
            name=engine.ADVANCE_TASK, shared=False, acks_late=True,
                  reject_on_worker_lost=True, ignore_result=True)
        def advance_workflow(workflow_id: str) -> str:
            outcome = run_advance(workflow_id)
            log.info("workflow %s advanced: %s", workflow_id, outcome)
            return outcome

    if START_TASK not in app.tasks:
        @app.task(  # type: ignore[untyped-decorator]
            name=START_TASK, shared=False, base=IdempotentTask, bind=True)
        def start_workflow(self: IdempotentTask, name: str, *args: Any,
                           **kwargs: Any) -> str:
            """A beat entry's slot starts workflow ``name`` with id = the slot's key."""
            with self.transaction() as tx:
                workflow_id = start_for_slot(tx, name, self.idempotency_key, args, kwargs)
                self.returns(workflow_id)
            return workflow_id

    return store_factory
