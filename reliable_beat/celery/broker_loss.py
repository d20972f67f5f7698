"""Worker side: say why a Celery worker stops after it lost its broker connection.

When a worker's consumer loses the broker, Celery closes the broken connection
(``Consumer.on_connection_error_after_connected``) and reconnects. Anything that handler
raises escapes Celery's reconnect loop: the worker logs ``Unrecoverable error`` and exits
with code 1, and without a supervisor that restarts it nobody runs tasks any more.

Celery 5.7 / kombu 5.7 on Redis do that on a Redis restart while the worker holds
unacknowledged messages (a countdown or ETA task: every ``IdempotentTask`` retry; an
``acks_late`` task). Celery first collects the connection, which releases its kombu
transport; the Redis channel was not marked closed (its pending ``BRPOP`` read failed on the
dead socket), so the second close runs the channel's close again and kombu's restore of the
unacknowledged messages builds a Redis client from the released transport:
``AttributeError: 'NoneType' object has no attribute 'hostname'``
(``kombu/transport/redis.py``, ``_connparams``). Nothing is lost (Redis gives the messages
back after ``visibility_timeout``), but the process is gone.

:func:`install`, run at ``celeryd_after_setup`` in every worker of an app with an
``IdempotentTask``, wraps the consumer's handler: when it raises, an ERROR
(``worker_broker_loss: ...``) names the cause and the fix (a supervisor that restarts the
worker) before Celery's own ``Unrecoverable error``. Celery's behaviour is unchanged: the
exception is re-raised and the worker still exits.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from reliable_beat.redaction import get_logger

__all__ = ["explain", "guard_connection_loss", "install"]

log = get_logger("reliable_beat.broker_loss")

#: The operations guide's section on it (the log line points there).
DOCS_SECTION = "docs/operations.md, 'A broker restart can stop a Celery worker'"


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def explain(failure: BaseException, lost: BaseException | None = None) -> str:
    """The ERROR text for ``failure``, raised by Celery's handler of the lost connection
    (``lost``: the error that lost it)."""
    cause = f" after {type(lost).__name__}: {lost}" if lost is not None else ""
    return (
        f"worker_broker_loss: Celery's consumer failed while closing the lost broker "
        f"connection{cause} ({type(failure).__name__}: {failure}); Celery now stops this "
        f"worker ('Unrecoverable error', exit code 1) and it will not reconnect. Known on "
        f"Redis with celery {_version('celery')} / kombu {_version('kombu')}: a broker "
        "restart while the worker holds unacknowledged messages (countdown or ETA tasks, "
        "IdempotentTask retries, acks_late tasks). Nothing is lost: Redis redelivers them "
        "after visibility_timeout and their runs are claimed again. Fix: run the worker "
        "under a supervisor that restarts it when it exits (systemd Restart=always, "
        "Kubernetes restartPolicy: Always, supervisord autorestart=true); see "
        f"{DOCS_SECTION}")


def guard_connection_loss(consumer: Any) -> None:
    """Make ``consumer`` (a Celery worker's ``Consumer``) log :func:`explain` when its
    ``on_connection_error_after_connected`` raises, then re-raise. Idempotent."""
    handler = getattr(consumer, "on_connection_error_after_connected", None)
    if handler is None or getattr(handler, "_reliable_beat_guard", False):
        return

    def on_connection_error_after_connected(exc: BaseException) -> Any:
        try:
            return handler(exc)
        except Exception as failure:
            log.error("%s", explain(failure, exc))
            raise

    on_connection_error_after_connected._reliable_beat_guard = True  # type: ignore[attr-defined]
    consumer.on_connection_error_after_connected = on_connection_error_after_connected


def install(worker: Any) -> None:
    """``celeryd_after_setup`` (the worker's ``WorkController``, before the consumer starts):
    :func:`guard_connection_loss` on its consumer, if it has one."""
    consumer = getattr(worker, "consumer", None)
    if consumer is not None:
        guard_connection_loss(consumer)
