"""Periodic entries of a Dramatiq app and the beat that fires them: the entry definitions of
the broker's actors declared with ``periodic=`` plus a ``BEAT_SCHEDULE`` mapping
(:func:`definitions`), their sync into the store (:func:`sync_entries`) and the core
:class:`~reliable_beat.loop.BeatLoop` of a Dramatiq beat (:func:`beat_loop`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from reliable_beat.db.dialects import Store
from reliable_beat.dramatiq.publisher import DramatiqPublisher
from reliable_beat.dramatiq.worker import IdempotentActor, _middleware
from reliable_beat.entries import definition_from_celery, sync_config_entries
from reliable_beat.errors import ConfigurationError
from reliable_beat.groups import DEFAULT_GROUP
from reliable_beat.loop import BeatLoop
from reliable_beat.outbox import db_now
from reliable_beat.settings import Settings

__all__ = ["beat_loop", "definitions", "sync_entries"]

#: Entry publish options of Celery's message that a Dramatiq trigger has no field for
#: (:func:`definitions` refuses them, naming the entry).
CELERY_ONLY_OPTIONS = frozenset({"routing_key", "exchange", "serializer", "priority", "headers"})


def definitions(broker: Any, schedule: Mapping[str, Any] | None = None, *,
                now: datetime, settings: Settings) -> list[Any]:
    """The entry definitions of ``broker``'s actors declared with ``periodic=`` plus a
    ``BEAT_SCHEDULE`` mapping (``"actor"`` for Celery's ``"task"``), validated like Celery's
    ``beat_schedule`` (:func:`reliable_beat.entries.definition_from_celery`).

    Raises:
        ConfigurationError: every bad entry, each named, in one error.
    """
    def is_idempotent(name: str) -> bool | None:
        actor = broker.actors.get(name)
        return None if actor is None else isinstance(actor, IdempotentActor)

    def task_function(name: str) -> Any:
        fn = getattr(broker.actors.get(name), "fn", None)
        return fn if callable(fn) else None

    raw: dict[str, dict[str, Any]] = {}
    for name, actor in sorted(broker.actors.items()):
        periodic = actor.options.get("periodic")
        if periodic is None:
            continue
        item: dict[str, Any] = {"task": name, "schedule": periodic}
        if actor.options.get("reliable_beat"):
            item["reliable_beat"] = actor.options["reliable_beat"]
        raw[str(actor.options.get("periodic_name") or name)] = item
    for name, spec in (schedule or {}).items():
        item = dict(spec)
        if "actor" in item:
            item["task"] = item.pop("actor")
        raw[name] = item
    out: list[Any] = []
    problems: list[str] = []
    for name, item in raw.items():
        opts = item.get("options")
        celery_only = sorted(set(opts if isinstance(opts, Mapping) else ()) & CELERY_ONLY_OPTIONS)
        if celery_only:
            # a Dramatiq message has no such field: refused, never silently dropped
            problems.append(
                f"{name}: publish option(s) {', '.join(map(repr, celery_only))} are Celery "
                "message fields a Dramatiq trigger cannot carry; remove them (a Dramatiq "
                "entry's options: queue, expires)")
            continue
        try:
            out.append(definition_from_celery(
                name, item, default_timezone="UTC", settings=settings, now=now,
                is_idempotent=is_idempotent, task_function=task_function))
        except (ConfigurationError, ValueError, TypeError) as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        raise ConfigurationError("bad Dramatiq periodic entries: " + "; ".join(problems))
    return out


def sync_entries(broker: Any, store: Any, settings: Settings,
                 schedule: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Validate and sync the broker's periodic entries into the store (config entries)."""
    with store.begin() as conn:
        now = db_now(conn)

    # the group its BeatLoop fires (reliable_beat.loop.BeatLoop.schedule_group)
    return sync_config_entries(store, definitions(broker, schedule, now=now, settings=settings),
                               group=settings.schedule_group or DEFAULT_GROUP)


def beat_loop(broker: Any, store: Any = None) -> Any:
    """The core :class:`~reliable_beat.loop.BeatLoop` of a Dramatiq beat for ``broker``:
    its :class:`DramatiqPublisher`, its periodic entries (:func:`definitions`, synced by
    :meth:`~reliable_beat.loop.BeatLoop.start` into ``reliable_beat_schedule_group``, default
    ``default``), its idempotent actors tracked, logging as ``reliable_beat.loop``.

    Raises:
        ConfigurationError: the broker has no :class:`ReliableBeat` middleware.
    """
    rb = _middleware(broker)
    settings = rb.settings
    if store is None:
        store = Store.from_url(settings.database_url, role="beat")

    def entries(now: datetime) -> list[Any]:
        return definitions(broker, rb.schedule, now=now, settings=settings)

    return BeatLoop(store, settings, DramatiqPublisher(broker), settings.owner,
                    definitions=entries, is_registered=lambda name: name in broker.actors)
