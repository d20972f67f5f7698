"""The Celery adapter's answers to the core (:class:`reliable_beat.adapters.AppAdapter`).

Registered as the built-in adapter ``celery``
(:data:`reliable_beat.adapters.BUILTIN_ADAPTERS`): the relay's ``celery`` / ``kombu``
handlers, the trigger publish of manual triggers, backfills and re-dispatch, the registry of
``IdempotentTask`` tasks, the workflow advance task; for the command line, the ``-A`` app
loader, the app's time zone and the RedBeat / django-celery-beat importers.

Every process that works with a Celery app loads this module (a workflow app's workers
when the app module is imported). Two parts are imported when first used instead:
:mod:`~reliable_beat.celery.scheduler` (the beat loop) and
:mod:`~reliable_beat.celery.importers`, which bring :mod:`reliable_beat.entries` and with it
Alembic: about 0.4 s more at the start of a worker that needs neither.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from reliable_beat.celery import app_loader, backlog, publishing, workflows
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.groups import schedule_group_of
from reliable_beat.settings import Settings, celery_timezone

if TYPE_CHECKING:
    from reliable_beat.db.dialects import Store
    from reliable_beat.outbox import OutboxMessage
    from reliable_beat.triggers import Trigger

__all__ = ["ADAPTER", "CeleryAdapter"]


class CeleryAdapter:
    """The core's questions about a Celery app, answered with Celery and kombu."""

    name = "celery"

    def handlers(self, app: Any) -> dict[str, Callable[[OutboxMessage], None]]:
        """``celery`` (``send_task``) and ``kombu`` (raw publish) over ``app``'s broker.

        Bounds a publish's wait on a hung broker first
        (:func:`~reliable_beat.celery.publishing.bound_broker_wait`,
        ``reliable_beat_publish_timeout_seconds``)."""
        timeout = app.conf.get("reliable_beat_publish_timeout_seconds")
        publishing.bound_broker_wait(app, float(timeout or Settings.publish_timeout_seconds))
        return {"celery": publishing.CeleryHandler(app),
                "kombu": publishing.KombuHandler(app)}

    def publish(self, app: Any, messages: list[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        """:func:`~reliable_beat.celery.publishing.publish_celery_batch`."""
        return publishing.publish_celery_batch(app, messages, now=now)

    def publish_triggers(self, store: Store, app: Any, triggers: list[Trigger],
                         now: datetime) -> int:
        """:func:`reliable_beat.celery.scheduler.publish_triggers`."""
        from reliable_beat.celery import scheduler  # lazily: see the module docstring

        return scheduler.publish_triggers(store, app, triggers, now)

    def tracked_tasks(self, app: Any) -> list[str]:
        """Names of the ``IdempotentTask`` tasks registered in ``app``."""
        return [name for name, task in list(app.tasks.items())
                if isinstance(task, IdempotentTask)]

    def task_kind(self, app: Any, task: str) -> str:
        """``idempotent`` (an ``IdempotentTask``), ``plain``, or ``unknown`` (``app``
        registers no ``task``)."""
        registry = getattr(app, "tasks", None)
        if registry is None or task not in registry:
            return "unknown"
        return "idempotent" if isinstance(registry[task], IdempotentTask) else "plain"

    def task_function(self, app: Any, task: str) -> Callable[..., Any] | None:
        """``task``'s ``run`` (bound to the task for ``bind=True``, so ``self`` is not an
        argument), None when ``app`` registers no ``task`` or the task sets ``typing=False``
        (Celery then does not check arguments either)."""
        registry = getattr(app, "tasks", None)
        if registry is None or task not in registry:
            return None
        found = registry[task]
        if getattr(found, "typing", True) is False:
            return None
        run = getattr(found, "run", None)
        return run if callable(run) else None

    def lease_seconds(self, app: Any, task: str) -> float | None:
        """The ``lease_seconds`` attribute of the ``IdempotentTask`` ``task`` (None: unset,
        or no such task)."""
        registry = getattr(app, "tasks", None)
        if registry is None or task not in registry:
            return None
        value = getattr(registry[task], "lease_seconds", None)
        return float(value) if value is not None else None

    def settings(self, app: Any, database_url: tuple[str, str] | None = None) -> Settings:
        """:meth:`Settings.from_celery(app) <reliable_beat.settings.Settings.from_celery>`."""
        return Settings.from_celery(app, database_url=database_url)

    def install_workflows(self, app: Any) -> Callable[[], Store]:
        """:func:`reliable_beat.celery.workflows.install`."""
        return workflows.install(app)

    def load_app(self, spec: str | None, parent_app: Any = None) -> Any:
        """``-A spec`` found as ``celery -A spec`` finds it (or ``parent_app``), its task
        modules imported: :func:`~reliable_beat.celery.app_loader.load_celery_app`,
        :func:`~reliable_beat.celery.app_loader.prepare_app`."""
        if not spec and parent_app is None:
            return None
        return app_loader.prepare_app(
            app_loader.load_celery_app(spec) if spec else parent_app)

    def app_timezone(self, app: Any) -> str:
        """Celery's ``app.timezone``: :func:`reliable_beat.settings.celery_timezone`."""
        return celery_timezone(app)

    def importers(self) -> Any:
        """:mod:`reliable_beat.celery.importers` (RedBeat, django-celery-beat)."""
        from reliable_beat.celery import importers  # lazily: see the module docstring

        return importers

    def queue_depths(self, app: Any, messages: list[OutboxMessage]
                     ) -> list[tuple[str, int | None]]:
        """The re-dispatch sweep's backlog check (optional hook,
        :data:`reliable_beat.redispatch.QueueDepthFn`):
        :func:`reliable_beat.celery.backlog.queue_depths`."""
        return backlog.queue_depths(app, messages)

    def workflow_schedule_group(self, app: Any) -> str:
        """The schedule group the workflows ``app`` starts record
        (:func:`reliable_beat.groups.schedule_group_of`): only its relays publish their
        messages, into its broker."""
        return schedule_group_of(app, Settings.from_celery(app).schedule_group)


#: The instance :data:`reliable_beat.adapters.BUILTIN_ADAPTERS` names.
ADAPTER = CeleryAdapter()
