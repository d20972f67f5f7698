"""Tasks of the ``djshop`` app, found by ``app.autodiscover_tasks()`` (not imported by
anything else): the admin must load them to name a task's kind."""

from __future__ import annotations

from celery import shared_task

from reliable_beat.celery.task import IdempotentTask


@shared_task(base=IdempotentTask, bind=True, name="djshop.refund")
def refund(self: IdempotentTask, order: str) -> str:
    return order
