"""The Dramatiq adapter's answers to the core (:class:`reliable_beat.adapters.AppAdapter`).

Registered as the built-in adapter ``dramatiq`` (:data:`reliable_beat.adapters.BUILTIN_ADAPTERS`):
the "app" of a Dramatiq application is its broker (``dramatiq.Broker``, with the
:class:`~reliable_beat.dramatiq.ReliableBeat` middleware on it), so ``reliable-beat -A
proj.broker entries describe NAME`` (``module`` or ``module:attr``, attr default ``broker``)
asks this adapter what kind an entry's actor is (:meth:`DramatiqAdapter.task_kind`: an
:class:`~reliable_beat.dramatiq.IdempotentActor` is ``idempotent``, any other declared actor
``plain``, a name the broker does not declare ``unknown``), which settings the app uses (the
middleware's) and how its triggers are published (through the broker).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from reliable_beat.adapters import import_from_cwd
from reliable_beat.dramatiq import backlog
from reliable_beat.dramatiq.base import TRIGGER_DESTINATION
from reliable_beat.dramatiq.publisher import (
    DramatiqHandler,
    DramatiqPublisher,
    requeue_dead_letter,
)
from reliable_beat.dramatiq.worker import IdempotentActor, _middleware
from reliable_beat.errors import ConfigurationError
from reliable_beat.loop import publish_and_mark, trigger_messages

if TYPE_CHECKING:
    from reliable_beat.db.dialects import Store
    from reliable_beat.outbox import OutboxMessage
    from reliable_beat.settings import Settings
    from reliable_beat.triggers import Trigger

__all__ = ["ADAPTER", "DramatiqAdapter", "find_broker"]


def find_broker(spec: str) -> Any:
    """The Dramatiq broker ``spec`` names: ``module:attr``, or ``module`` (its ``broker``
    attribute, else its one ``dramatiq.Broker`` instance). The current directory is importable
    first (as for ``dramatiq proj.actors``).

    Raises:
        click.ClickException: the module cannot be imported, or it holds no broker (the
            message names the spec and the fix).
    """
    import click
    import dramatiq

    module_name, _, attr = spec.partition(":")
    try:
        module = import_from_cwd(module_name)
    except Exception as exc:
        raise click.ClickException(
            f"-A {spec}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); run from "
            "the directory that holds it, or put that directory on PYTHONPATH") from exc
    if attr:
        broker = getattr(module, attr, None)
    else:
        broker = getattr(module, "broker", None)
        if not isinstance(broker, dramatiq.Broker):
            found = [v for v in vars(module).values() if isinstance(v, dramatiq.Broker)]
            broker = found[0] if len(found) == 1 else None
    if not isinstance(broker, dramatiq.Broker):
        raise click.ClickException(
            f"-A {spec}: {module_name!r} has no Dramatiq broker "
            f"{('attribute ' + repr(attr)) if attr else '(attribute broker)'}: give "
            "-A module:attr naming the broker the ReliableBeat middleware is on")
    return broker


class DramatiqAdapter:
    """The core's questions about a Dramatiq broker (the "app"), answered with Dramatiq."""

    name = "dramatiq"

    def handlers(self, app: Any) -> dict[str, Callable[[OutboxMessage], None]]:
        """``dramatiq`` (triggers and application messages) through ``app``, the broker."""
        return {TRIGGER_DESTINATION: DramatiqHandler(app)}

    def publish(self, app: Any, messages: list[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        """:meth:`~reliable_beat.dramatiq.DramatiqPublisher.publish` on the broker."""
        return DramatiqPublisher(app).publish(messages, now)

    def publish_triggers(self, store: Store, app: Any, triggers: list[Trigger],
                         now: datetime) -> int:
        """Publish just-committed triggers through the broker and mark them
        (:func:`reliable_beat.loop.publish_and_mark`); rows the broker refused stay pending."""
        publisher = DramatiqPublisher(app)
        return publish_and_mark(store, publisher,
                                trigger_messages(triggers, publisher.destination), now)

    def queue_depths(self, app: Any, messages: list[OutboxMessage]
                     ) -> list[tuple[str, int | None]]:
        """The re-dispatch sweep's backlog check (optional hook,
        :data:`reliable_beat.redispatch.QueueDepthFn`): ready messages in each message's
        queue on broker ``app`` (:func:`reliable_beat.dramatiq.backlog.queue_depths`)."""
        return backlog.queue_depths(app, messages)

    def requeue_dead_run(self, app: Any, store: Store, dead_letter_id: int, *, by: str,
                         force: bool = False, queue: str | None = None) -> dict[str, Any]:
        """Run an actor's dead run again under the same key through broker ``app`` (optional
        hook, used by :func:`reliable_beat.ops.requeue.requeue`):
        :func:`reliable_beat.dramatiq.publisher.requeue_dead_letter`."""
        return requeue_dead_letter(app, store, dead_letter_id, by=by, force=force,
                                   queue=queue)

    def tracked_tasks(self, app: Any) -> list[str]:
        """Names of the broker's :class:`~reliable_beat.dramatiq.IdempotentActor` actors."""
        return list(DramatiqPublisher(app).tracked_tasks())

    def task_kind(self, app: Any, task: str) -> str:
        """``idempotent`` (an :class:`~reliable_beat.dramatiq.IdempotentActor`), ``plain``
        (any other actor declared on the broker), or ``unknown`` (the broker declares no
        actor ``task``: its module was not imported, or the name is wrong)."""
        actor = (getattr(app, "actors", None) or {}).get(task)
        if actor is None:
            return "unknown"
        return "idempotent" if isinstance(actor, IdempotentActor) else "plain"

    def task_function(self, app: Any, task: str) -> Callable[..., Any] | None:
        """The function of actor ``task`` (None: the broker declares no such actor)."""
        actor = (getattr(app, "actors", None) or {}).get(task)
        fn = getattr(actor, "fn", None)
        return fn if callable(fn) else None

    def lease_seconds(self, app: Any, task: str) -> float | None:
        """The actor option ``lease_seconds`` of ``task`` (None: not set, or no such actor)."""
        actor = (getattr(app, "actors", None) or {}).get(task)
        value = None if actor is None else actor.options.get("lease_seconds")
        return float(value) if value is not None else None

    def settings(self, app: Any, database_url: tuple[str, str] | None = None) -> Settings:
        """The :class:`~reliable_beat.dramatiq.ReliableBeat` middleware's settings, the store
        URL replaced by ``database_url`` (``(url, origin)``, the CLI's ``--database-url``).

        Raises:
            ConfigurationError: the broker has no ReliableBeat middleware.
        """
        settings = _middleware(app).settings
        if database_url is None:
            return settings
        url, origin = database_url
        changed = dataclasses.replace(settings, database_url=url)
        object.__setattr__(changed, "_database_url_origin", origin)
        return changed

    def install_workflows(self, app: Any) -> Callable[[], Store]:
        """Not available for Dramatiq (the workflow engine's advance task is Celery's).

        Raises:
            ConfigurationError: always, naming what to use instead.
        """
        raise ConfigurationError(
            "durable workflows run on the Celery adapter only: the Dramatiq adapter has no "
            "workflow advance actor yet (see docs/dramatiq.md, 'What remains')")

    def load_app(self, spec: str | None, parent_app: Any = None) -> Any:
        """The broker ``-A spec`` names (:func:`find_broker`), or ``parent_app``; its actor
        modules are whatever the broker module imports (as ``dramatiq`` loads them)."""
        if spec:
            return find_broker(spec)
        return parent_app

    def app_timezone(self, app: Any) -> str:
        """``UTC``: Dramatiq has no app time zone (entries without one are UTC, as in
        :func:`reliable_beat.dramatiq.definitions`)."""
        return "UTC"

    def importers(self) -> Any:
        """Not available: RedBeat and django-celery-beat are Celery schedulers.

        Raises:
            ConfigurationError: always.
        """
        raise ConfigurationError(
            "entries import reads Celery schedulers (RedBeat, django-celery-beat): run it "
            "without -A, or with -A naming a Celery app")


#: The instance :data:`reliable_beat.adapters.BUILTIN_ADAPTERS` names.
ADAPTER = DramatiqAdapter()
