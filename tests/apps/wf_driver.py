"""An in-process driver for workflow tests: delivers due outbox rows one at a time.

Advance messages call :func:`reliable_beat.workflows.engine.advance`; activity messages run
the real ``IdempotentTask`` through Celery's ``apply`` (eager, same process). A crash is a
``Crash`` (BaseException) raised at a named crash point: the open transaction rolls back, the
message stays pending (redelivered, as acks_late does) and the leases are expired (as time
would), exactly what a SIGKILL leaves behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, runs, workflow_events, workflows
from reliable_beat.outbox import db_now
from reliable_beat.workflows import engine

#: ``max_takeovers`` of the driver's advances and of the sweep in crash-schedule tests.
NO_TAKEOVER_LIMIT = 1_000_000


class Crash(BaseException):
    """A simulated SIGKILL."""


class CrashPlan:
    """Crash at the ``hits``-th time any crash point is reached (counting all points), once
    per entry of ``at``: a schedule of global hit numbers."""

    def __init__(self, at: list[int]) -> None:
        self.at = sorted(set(at))
        self.hits = 0
        self.crashed: list[str] = []

    def __call__(self, name: str) -> None:
        self.hits += 1
        if self.at and self.hits == self.at[0]:
            self.at.pop(0)
            self.crashed.append(name)
            raise Crash(name)


class Driver:
    def __init__(self, store: Store, app: Any, *, duplicate: Callable[[int], bool] | None = None):
        self.store = store
        self.app = app
        self.delivered = 0
        self.duplicate = duplicate or (lambda n: False)
        self.crashes = 0
        self.failures: list[Exception] = []

    def _due(self) -> tuple[Any, Any]:
        with self.store.connect() as conn:
            now = db_now(conn)
            row = conn.execute(
                sa.select(outbox).where(outbox.c.state == "pending",
                                        outbox.c.available_at <= now)
                .order_by(outbox.c.id).limit(1)
            ).first()
            nxt = conn.execute(
                sa.select(sa.func.min(outbox.c.available_at))
                .where(outbox.c.state == "pending")
            ).scalar()
        return row, (None if nxt is None else (nxt - now).total_seconds())

    def deliver(self, row: Any) -> None:
        payload = row.payload
        if payload["task"] == engine.ADVANCE_TASK:
            # the crash plans kill one advance several times in a row on purpose: not the
            # runaway guard's business (tests/unit/test_workflow_runaway.py is)
            engine.advance(self.store, payload["args"][0], owner="driver",
                           lease=timedelta(seconds=30), max_takeovers=NO_TAKEOVER_LIMIT)
        else:
            task = self.app.tasks[payload["task"]]
            # the broker hop: Celery's json serializer (kombu) encodes and decodes the
            # message, so kombu's typed objects reach the task as Python values
            from kombu.utils.json import dumps, loads

            payload = loads(dumps(payload))
            for _ in range(2 if self.duplicate(self.delivered) else 1):
                task.apply(tuple(payload["args"]), dict(payload["kwargs"]),
                           headers=payload.get("headers") or {})

    def expire_leases(self) -> None:
        with self.store.begin() as conn:
            past = datetime(2000, 1, 1, tzinfo=timezone.utc)  # expired long ago
            conn.execute(sa.update(workflows).where(workflows.c.lease_expires_at.is_not(None))
                         .values(lease_expires_at=past))
            conn.execute(sa.update(runs).where(runs.c.state == "running")
                         .values(lease_expires_at=past))

    def step(self) -> bool:
        row, wait = self._due()
        if row is None:
            if wait is None:
                return False
            time.sleep(max(wait, 0) + 0.005)
            return True
        self.delivered += 1
        try:
            self.deliver(row)
        except Crash:
            self.crashes += 1
            self.expire_leases()
            return True  # not acked: delivered again
        except Exception as exc:  # the task failed: Celery acks it; the sweep recovers
            self.failures.append(exc)
            self.expire_leases()
        with self.store.begin() as conn:
            conn.execute(sa.update(outbox).where(outbox.c.id == row.id)
                         .values(state="sent", sent_at=db_now(conn)))
        return True

    def run(self, limit: int = 2000, between: Callable[[int], None] | None = None) -> None:
        for i in range(limit):
            if between is not None:
                between(i)
            if not self.step():
                return
        raise AssertionError(f"driver did not settle in {limit} deliveries")


def events(store: Store, workflow_id: str) -> list[tuple[Any, ...]]:
    with store.connect() as conn:
        pk = conn.execute(sa.select(workflows.c.id)
                          .where(workflows.c.workflow_id == workflow_id)).scalar_one()
        return [tuple(r) for r in conn.execute(
            sa.select(workflow_events.c.seq, workflow_events.c.kind, workflow_events.c.name,
                      workflow_events.c.state, workflow_events.c.result)
            .where(workflow_events.c.workflow_pk == pk).order_by(workflow_events.c.seq)
        ).all()]
