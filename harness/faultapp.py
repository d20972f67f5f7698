"""The Celery app the fault-injection harness runs as beats, workers and relays.

Not for applications: it exists so :mod:`harness.faults` can start real
processes (``celery -A harness.faultapp worker|beat``,
``reliable-beat -A harness.faultapp relay``). Everything is configured by the
JSON file named in ``RB_FAULTS_CONFIG`` (written by the harness)::

    {"mode": "reliable" | "stock" | "redbeat", "database_url": ..., "broker_url": ...,
     "sink_url": ..., "dir": ..., "lease_seconds": 3, "slow_seconds": 8,
     "transient_every": 7, "permanent_every": 60,
     "entries": [{"name", "kind": "cron" | "interval", "expr", "every", "timezone",
                  "anchor"}]}

What the tasks do:

* ``faultapp.effect(entry)`` (``IdempotentTask``, ``reliable`` mode): in one transaction,
  writes an effect row ``(entry, slot, run_id, fence_token, attempt, pid)`` into
  ``faults_effects`` -- a table with **no** unique constraint, so a duplicate effect would
  be visible -- and an outbox message for the HTTP sink. A deterministic subset of slots
  raises ``ConnectionError`` on attempt 1 (transient), a smaller one raises
  ``PermanentError`` (dead letter expected exactly there); when the harness drops the
  ``slow.flag`` file, the first attempt-1 run that takes it sleeps ``slow_seconds`` *inside*
  the transaction, after its writes, so the harness can SIGSTOP it past its lease.
* ``faultapp.record(entry)`` (plain task, comparison modes): records one trigger row
  ``(entry, fire_at or sent_at)`` in ``faults_triggers``.

``RB_FAULTS_CLOCK_SKEW`` (seconds) shifts ``time.time`` of the process (the skewed-clock
beat); reliable_beat decides due-ness on the database clock, so it must not matter.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.signals import before_task_publish
from sqlalchemy import insert

# The neutral part (config, ledger tables, clock skew, effect body, sink handler) is shared
# with the Dramatiq app (harness.faultapp_dramatiq); names re-exported for old importers.
from harness.faultcore import (
    CONFIG,
    MODE,
    deliver,
    effect_body,
    effects,
    is_permanent,
    is_transient,
    metadata,
    slot_hash,
    triggers,
    wf_activity_body,
)
from harness.faultcore import db as _db

__all__ = [
    "app",
    "deliver",
    "effects",
    "is_permanent",
    "is_transient",
    "metadata",
    "slot_hash",
    "triggers",
]

app = Celery("faultapp", broker=CONFIG.get("broker_url", "memory://"))
app.conf.update(
    timezone="UTC",
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    beat_max_loop_interval=5,
    broker_transport_options={
        # Redelivery of an unacked message (a killed or frozen worker) after 10 s, checked
        # every second (kombu's periodic restore).
        "visibility_timeout": float(CONFIG.get("visibility_timeout", 10)),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # The restore runs under a Redis lock; a worker SIGKILLed while holding it would
        # block every restore for kombu's default 300 s.
        "unacked_mutex_expire": 5,
        # RabbitMQ (Redis ignores it): Celery's own publishes (retries) confirmed too.
        "confirm_publish": True,
    },
    worker_hijack_root_logger=False,
)
if MODE == "reliable":
    app.conf.update(
        beat_scheduler="reliable_beat.celery:ReliableScheduler",
        reliable_beat_database_url=CONFIG.get(
            "database_url", os.environ.get("RELIABLE_BEAT_DATABASE_URL", "sqlite:///faults.sqlite3")
        ),
        reliable_beat_lease_seconds=float(CONFIG.get("lease_seconds", 3)),
        reliable_beat_retry_base_seconds=0.5,
        reliable_beat_retry_cap_seconds=3.0,
        reliable_beat_retry_max_attempts=8,
        reliable_beat_outbox_retry_base_seconds=0.5,
        reliable_beat_outbox_retry_cap_seconds=3.0,
        reliable_beat_outbox_max_attempts=1000,
        reliable_beat_relay_poll_seconds=0.5,
        # Above the 10 s visibility timeout: the broker redelivers first; what it lost
        # (a worker killed between BRPOP and recording the message unacked) is re-sent.
        reliable_beat_redispatch_seconds=float(CONFIG.get("redispatch_seconds", 15)),
        reliable_beat_outbox_handlers={"sink": "harness.faultapp.deliver"},
    )
elif MODE == "redbeat":
    app.conf.update(
        beat_scheduler="redbeat.RedBeatScheduler",
        redbeat_redis_url=CONFIG.get("broker_url"),
        redbeat_key_prefix="faults:",
    )

_compare = CONFIG.get("compare_task", False)
_schedule: dict[str, Any] = {}
for _e in CONFIG.get("entries", []):
    _item: dict[str, Any] = {
        "task": "faultapp.record" if _compare or MODE != "reliable" else "faultapp.effect",
        "args": [_e["name"]],
    }
    if MODE == "reliable":
        _item["schedule"] = (
            _e["expr"] if _e["kind"] == "cron" else timedelta(seconds=int(_e["every"]))
        )
        rb: dict[str, Any] = {
            "timezone": _e["timezone"],
            "misfire_policy": "catch_up",
            "catch_up_limit": 1000,
            "misfire_grace": 600,
            # Far above any delay the other faults cause (a few seconds), so every slot of
            # the window still fires; bounds what the long outage (next_fire_at a week back)
            # catches up: the slots of the last 2 minutes, not a week of them.
            "catch_up_window": 120,
        }
        if _e["kind"] == "interval":
            rb["anchor"] = _e["anchor"]
        _item["options"] = {"reliable_beat": rb}
    else:  # stock celery / RedBeat: Celery interval schedules of the same period
        _item["schedule"] = timedelta(seconds=int(_e["every"]))
    _schedule[_e["name"]] = _item
#: The workflow shapes' entries (``"workflows": true``): each slot starts one workflow
#: (``reliable_beat.workflow.start``, workflow id ``<entry>@<slot>``).
if MODE == "reliable" and not _compare and CONFIG.get("workflows"):
    for _w in CONFIG.get("wf_entries", []):
        _schedule[_w["name"]] = {
            "task": "reliable_beat.workflow.start",
            "schedule": timedelta(seconds=int(_w["every"])),
            "args": [_w["workflow"]],
            "options": {"reliable_beat": {
                "misfire_policy": "catch_up", "catch_up_limit": 1000, "misfire_grace": 600,
                # a long outage starts the last 30 s of slots' workflows, not 2 minutes'
                "catch_up_window": 30, "overlap_policy": "allow", "anchor": _w["anchor"]}},
        }
app.conf.beat_schedule = _schedule

def _effect_body(task: Any, entry: str) -> dict[str, Any]:
    return effect_body(task, entry)


def _record_body(task: Any, entry: str) -> None:
    headers = getattr(task.request, "headers", None) or {}
    fire_at = headers.get("reliable_beat_fire_at") or getattr(
        task.request, "reliable_beat_fire_at", None
    )
    sent_at = headers.get("faults_sent_at") or getattr(task.request, "faults_sent_at", None)
    if fire_at:
        at = datetime.fromisoformat(str(fire_at).replace("Z", "+00:00")).timestamp()
    elif sent_at is not None:
        at = float(sent_at)
    else:  # no stamp at all: the execution time is the best we have
        at = datetime.now(timezone.utc).timestamp()
    with _db().begin() as conn:
        conn.execute(
            insert(triggers).values(mode=MODE, entry=entry, at=at, task_id=task.request.id,
                                    pid=os.getpid())
        )


if MODE == "reliable" and not _compare:
    from reliable_beat.celery.task import IdempotentTask

    @app.task(base=IdempotentTask, bind=True, name="faultapp.effect")  # type: ignore[untyped-decorator]
    def effect(self: Any, entry: str) -> dict[str, Any]:
        """The effect of one slot: an effect row + an outbox message, in one transaction."""
        return _effect_body(self, entry)


if MODE == "reliable" and not _compare and CONFIG.get("workflows"):
    from reliable_beat.celery.task import IdempotentTask
    from reliable_beat.workflows import WorkflowContext, workflow

    @app.task(base=IdempotentTask, bind=True, name="faultapp.wf_act")  # type: ignore[untyped-decorator]
    def wf_act(self: Any, workflow_id: str, action: str) -> str:
        """A workflow activity or compensation: one keyed effect row (``faults_wf_effects``)."""
        return wf_activity_body(self, workflow_id, action)

    @workflow(app, name="faults.saga")
    def saga_shape(ctx: WorkflowContext) -> str:
        """Three forward activities, each with its compensation recorded before it; ``fwd3``
        fails permanently in the :func:`~harness.faultcore.wf_fails` fraction and the saga
        unwinds ``comp3``, ``comp2``, ``comp1``; the workflow ends ``failed``."""
        wid = ctx.info.workflow_id
        with ctx.saga() as saga:
            for i in (1, 2, 3):
                saga.compensate(wf_act, wid, f"comp{i}")
                ctx.activity(wf_act, wid, f"fwd{i}")
        return "completed"

    @workflow(app, name="faults.timer")
    def timer_shape(ctx: WorkflowContext) -> str:
        """An activity, a durable timer of ``wf_timer_seconds``, an activity."""
        wid = ctx.info.workflow_id
        ctx.activity(wf_act, wid, "before")
        ctx.sleep(timedelta(seconds=float(CONFIG.get("wf_timer_seconds", 3))))
        ctx.activity(wf_act, wid, "after")
        return "completed"

    @workflow(app, name="faults.signal")
    def signal_shape(ctx: WorkflowContext) -> Any:
        """Waits for signal ``go`` (the harness sends it, sometimes twice under one dedup
        key), then an activity."""
        got = ctx.wait_signal("go")
        ctx.activity(wf_act, ctx.info.workflow_id, "signalled")
        return got


@app.task(bind=True, name="faultapp.record")  # type: ignore[untyped-decorator]
def record(self: Any, entry: str) -> None:
    """Comparison mode: record one executed trigger of ``entry``."""
    _record_body(self, entry)


@before_task_publish.connect  # type: ignore[untyped-decorator]
def _stamp_publish_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp every published message with the publisher's send time (comparison modes)."""
    if headers is not None:
        headers.setdefault("faults_sent_at", time.time())
