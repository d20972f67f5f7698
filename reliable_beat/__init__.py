"""reliable_beat: effectively-once periodic tasks for Celery.

Change one setting and subclass one base class::

    app.conf.beat_scheduler = "reliable_beat.ReliableScheduler"
    app.conf.reliable_beat_database_url = "postgresql+psycopg://..."   # default: SQLite file

    @app.task(base=IdempotentTask, bind=True)
    def pay_merchants(self):
        with self.transaction() as tx:
            ...

then run ``celery beat`` (as many as you like), workers, and ``reliable-beat relay``.

Celery and kombu are the ``celery`` extra (``pip install 'reliable-beat[celery]'``):
``ReliableScheduler`` and ``IdempotentTask`` are the Celery adapter's
(:mod:`reliable_beat.celery`), resolved on first use; without Celery that raises an
``ImportError`` naming the extra. Everything else here is the framework-neutral core.
"""

from __future__ import annotations

from typing import Any

from reliable_beat._version import __version__
from reliable_beat.errors import (
    ConfigurationError,
    DeliveryError,
    EntryNotFoundError,
    EntryValidationError,
    IdempotencyKeyError,
    InvalidScheduleError,
    LeaseHeldError,
    PermanentDeliveryError,
    PermanentError,
    ReliableBeatError,
    SchemaError,
    StaleFenceToken,
    StoreUnavailableError,
    UnknownTimezoneError,
)
from reliable_beat.policies import MisfirePolicy, OverlapPolicy, RetryPolicy, backoff_delay
from reliable_beat.schedules import CronSchedule, IntervalSchedule, OneOffSchedule
from reliable_beat.settings import Settings
from reliable_beat.slots import idempotency_key

__all__ = [
    "ConfigurationError",
    "CronSchedule",
    "DeliveryError",
    "EntryNotFoundError",
    "EntryValidationError",
    "IdempotencyKeyError",
    "IdempotentTask",
    "IntervalSchedule",
    "InvalidScheduleError",
    "LeaseHeldError",
    "MisfirePolicy",
    "OneOffSchedule",
    "OverlapPolicy",
    "PermanentDeliveryError",
    "PermanentError",
    "ReliableBeatError",
    "ReliableScheduler",
    "RetryPolicy",
    "SchemaError",
    "Settings",
    "StaleFenceToken",
    "StoreUnavailableError",
    "UnknownTimezoneError",
    "__version__",
    "backoff_delay",
    "idempotency_key",
]


def __getattr__(name: str) -> Any:
    # Lazy: importing the Celery adapter pulls in celery.beat / the worker task machinery,
    # and Celery is an extra (the core never imports it: tests/unit/test_core_imports.py).
    if name == "ReliableScheduler":
        from reliable_beat.celery.scheduler import ReliableScheduler

        return ReliableScheduler
    if name == "IdempotentTask":
        from reliable_beat.celery.task import IdempotentTask

        return IdempotentTask
    raise AttributeError(f"module 'reliable_beat' has no attribute {name!r}")
