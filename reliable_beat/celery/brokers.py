"""Broker timeouts our guarantees depend on, checked when a beat or a worker starts.

A Celery retry with a countdown (:class:`~reliable_beat.celery.task.IdempotentTask` retries
through ``self.retry(countdown=...)``, at most ``retry_cap_seconds`` late) is a message the
worker receives at once and holds **unacknowledged** until its ETA. Both brokers put a
limit on that:

* RabbitMQ's ``consumer_timeout`` (default 30 min; ``reliable_beat_broker_consumer_timeout_
  seconds`` states the broker's value, which AMQP clients cannot read): a delivery held
  longer makes the broker close the worker's channel with ``PRECONDITION_FAILED`` and
  redeliver every unacknowledged message of it. Nothing is lost (the redelivered trigger is
  deduplicated by the run's fence and idempotency key), but a worker whose retries outlive
  the timeout churns its channel for ever, and an ``acks_late`` task running longer than the
  timeout is redelivered and run again while it is still running (the stale runner's commit
  is then fenced out).
* Redis's ``visibility_timeout`` (kombu's ``broker_transport_options``, default 1 h): an
  unacknowledged message older than that is restored to the queue and delivered again, so
  a countdown longer than it is delivered twice (again deduplicated, but work done twice).

:func:`broker_timeout_problems` lists what is wrong (with the fix);
:func:`warn_broker_timeouts` logs each as a WARNING at start. Neither talks to the broker.
Also warned: a RabbitMQ broker without ``confirm_publish`` in ``broker_transport_options``
(Celery's own publishes, e.g. ``self.retry``, then count as sent without the broker's
confirm; the beat's and relay's batches are confirmed either way).
"""

from __future__ import annotations

from typing import Any

from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings

__all__ = ["REDIS_VISIBILITY_TIMEOUT_SECONDS", "broker_timeout_problems",
           "warn_broker_timeouts"]

log = get_logger("reliable_beat.brokers")

#: kombu's default Redis ``visibility_timeout`` (seconds).
REDIS_VISIBILITY_TIMEOUT_SECONDS = 3600.0


def _driver_type(app: Any) -> str:
    try:
        conn = app.connection_for_write()
    except Exception:  # an unknown transport: Celery reports it on its own
        return ""
    try:
        return str(conn.transport.driver_type)
    except Exception:
        return ""
    finally:
        conn.release()


def _longest_retry_cap(app: Any, settings: Settings) -> tuple[float, str]:
    """The longest retry delay of the app's tasks and where it comes from."""
    cap, where = settings.retry_cap_seconds, "reliable_beat_retry_cap_seconds"
    tasks = getattr(app, "tasks", {})
    for name in sorted(getattr(tasks, "keys", lambda: [])()):
        task = tasks[name]
        if not hasattr(task, "_rb_retry"):
            continue  # not an IdempotentTask
        own = getattr(task, "retry_cap_seconds", None)
        plan = getattr(task, "_rb_retry", None)
        fixed = getattr(plan, "fixed_delay", None)
        plan_cap = getattr(plan, "cap_seconds", None)
        for value, source in ((own, f"{name}.retry_cap_seconds"),
                              (plan_cap, f"{name} retry_backoff_max"),
                              (fixed, f"{name} retry countdown")):
            if isinstance(value, (int, float)) and value > cap:
                cap, where = float(value), source
    return cap, where


def broker_timeout_problems(app: Any, settings: Settings | None = None) -> list[str]:
    """What about the broker's timeouts can make triggers redeliver or churn, with the fix.

    Args:
        app: the Celery app (its broker URL, ``broker_transport_options``, tasks).
        settings: default ``Settings.from_celery(app)``.

    Returns:
        One sentence per problem; empty when none. Never raises for a broker it does not
        know (no check then).
    """
    settings = settings or Settings.from_celery(app)
    driver = _driver_type(app)
    options = dict(app.conf.broker_transport_options or {})
    problems: list[str] = []
    cap, where = _longest_retry_cap(app, settings)
    if driver == "amqp":
        timeout = float(settings.broker_consumer_timeout_seconds)
        if cap >= timeout:
            problems.append(
                f"{where}={cap:g} s reaches RabbitMQ's consumer_timeout "
                f"(reliable_beat_broker_consumer_timeout_seconds={timeout:g} s): a retry held "
                "that long by a worker makes the broker close its channel and redeliver; keep "
                "the retry cap below the timeout, or raise consumer_timeout on the broker and "
                "state it in reliable_beat_broker_consumer_timeout_seconds")
        limit = app.conf.task_time_limit
        if app.conf.task_acks_late and limit and float(limit) >= timeout:
            problems.append(
                f"task_time_limit={limit} s with task_acks_late reaches RabbitMQ's "
                f"consumer_timeout ({timeout:g} s): a task running that long is redelivered "
                "while it runs; raise consumer_timeout on the broker (and state it in "
                "reliable_beat_broker_consumer_timeout_seconds) or shorten the task")
        if not options.get("confirm_publish"):
            problems.append(
                "RabbitMQ without broker_transport_options={'confirm_publish': True}: "
                "Celery's own publishes (self.retry, apply_async) count as sent before the "
                "broker confirms them; set it (reliable_beat's trigger and relay batches are "
                "confirmed either way)")
    elif driver == "redis":
        visibility = float(options.get("visibility_timeout", REDIS_VISIBILITY_TIMEOUT_SECONDS))
        if cap >= visibility:
            problems.append(
                f"{where}={cap:g} s reaches the Redis visibility_timeout ({visibility:g} s): a "
                "retry held that long is delivered a second time; keep the retry cap below "
                "it or raise broker_transport_options['visibility_timeout']")
    return problems


def warn_broker_timeouts(app: Any, settings: Settings | None = None) -> list[str]:
    """Log :func:`broker_timeout_problems` as WARNINGs (event ``broker_timeouts``); returns
    them. Never raises: a start-up check must not stop a beat or a worker."""
    try:
        problems = broker_timeout_problems(app, settings)
    except Exception:
        log.warning("could not check the broker's timeouts", exc_info=True)
        return []
    for problem in problems:
        log.warning("broker_timeouts: %s", problem)
    return problems


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        warn_broker_timeouts(app)


def connect_worker_check() -> None:
    """Check at every worker's start (``worker_ready``); idempotent."""
    from celery.signals import worker_ready

    worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="reliable_beat.brokers")
