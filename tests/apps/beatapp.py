"""A test Celery app for real `celery beat` processes (acceptance tests).

Configured from the environment so each test can point it at its own servers:

* RB_BROKER_URL, RELIABLE_BEAT_DATABASE_URL, RB_MAX_LOOP (beat_max_loop_interval);
* RB_SCHEDULE: JSON name -> {"cron": str | "every": seconds, "task", "args" (default:
  [name]), "reliable_beat": {...}};
* RB_QUEUE: the default queue (each test its own, so messages can be counted in Redis);
* RB_PUBLISH_TIMEOUT: ``reliable_beat_publish_timeout_seconds``;
* RB_CLAIM_AHEAD: ``reliable_beat_claim_ahead_seconds`` (default: the setting's default);
* RB_PURGE_INTERVAL: ``reliable_beat_purge_interval_seconds`` (0: the beat starts no
  retention thread);
* RB_REDISPATCH: ``reliable_beat_redispatch_seconds``; RB_ACKS: import
  ``reliable_beat.celery.acks`` (workers record the starts of plain tasks' triggers);
* RB_CLOCK_OFFSET: seconds added to this process's ``time.time`` (fallback when libfaketime
  is not installed): a beat with a wrong clock. Decisions use the database clock,
  so it must not matter;
* RB_FREEZE_FLAG: a file path; when it exists, the next claim query (``... FOR UPDATE SKIP
  LOCKED``) removes it and the process SIGSTOPs itself right after the claim, i.e. frozen
  inside its claim transaction, holding the row locks, until someone sends SIGCONT.
* RB_FREEZE_BEFORE_PUBLISH / RB_FREEZE_AFTER_PUBLISH: a file path; when it exists, the next
  claim that committed due triggers (the fast path) removes it and the process SIGSTOPs
  itself right after the commit, before publishing (BEFORE), or right after the broker
  accepted the messages, before they are marked sent (AFTER).
* RB_PAUSE_AFTER_CLAIM_AHEAD / RB_PAUSE_SECONDS: pause right after a claim that took slots
  ahead (see tests/apps/pause_hook.py).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import sys
import time as _time
from datetime import timedelta

from celery import Celery

_offset = float(os.environ.get("RB_CLOCK_OFFSET", "0") or 0)
if _offset:
    # Without libfaketime (which the tests prefer, see test_beats.py) only ``time.time`` can
    # be skewed in-process: ``datetime`` is a C type whose ``now`` cannot be patched safely.
    _real_time = _time.time

    def _skewed_time() -> float:
        return _real_time() + _offset

    _time.time = _skewed_time  # type: ignore[assignment]
    print(f"beatapp: local clock skewed by {_offset:+.0f} s", file=sys.stderr, flush=True)
if os.environ.get("FAKETIME"):
    print(f"beatapp: libfaketime FAKETIME={os.environ['FAKETIME']} "
          f"local now {_dt.datetime.now(_dt.timezone.utc).isoformat()}",
          file=sys.stderr, flush=True)

_freeze_flag = os.environ.get("RB_FREEZE_FLAG")
if _freeze_flag:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "after_cursor_execute")
    def _freeze_inside_claim(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if "SKIP LOCKED" in statement and "reliable_beat_entries" in statement and (
            cursor.rowcount and os.path.exists(_freeze_flag)
        ):
            os.unlink(_freeze_flag)
            print("beatapp: FROZEN inside the claim transaction", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            print("beatapp: THAWED", file=sys.stderr, flush=True)


app = Celery("beatapp", broker=os.environ.get("RB_BROKER_URL", "memory://"))
app.conf.beat_scheduler = "reliable_beat.celery:ReliableScheduler"
app.conf.reliable_beat_database_url = os.environ["RELIABLE_BEAT_DATABASE_URL"]
app.conf.beat_max_loop_interval = float(os.environ.get("RB_MAX_LOOP", "5"))
app.conf.timezone = "UTC"
app.conf.broker_connection_retry_on_startup = True
app.conf.broker_transport_options = {"confirm_publish": True}  # RabbitMQ; Redis ignores it
if os.environ.get("RB_QUEUE"):
    app.conf.task_default_queue = os.environ["RB_QUEUE"]
if os.environ.get("RB_REDISPATCH"):
    app.conf.reliable_beat_redispatch_seconds = float(os.environ["RB_REDISPATCH"])
if os.environ.get("RB_ACKS"):  # workers record the starts of plain tasks' triggers
    app.conf.imports = ["reliable_beat.celery.acks"]
if os.environ.get("RB_PUBLISH_TIMEOUT"):
    app.conf.reliable_beat_publish_timeout_seconds = float(os.environ["RB_PUBLISH_TIMEOUT"])
if os.environ.get("RB_CLAIM_AHEAD"):
    app.conf.reliable_beat_claim_ahead_seconds = float(os.environ["RB_CLAIM_AHEAD"])
if os.environ.get("RB_PURGE_INTERVAL"):  # 0: no retention thread in the beat
    app.conf.reliable_beat_purge_interval_seconds = float(os.environ["RB_PURGE_INTERVAL"])


@app.task(name="beatapp.tick")
def tick(label: str = "") -> str:
    return label


schedule: dict[str, dict[str, object]] = {}
for name, spec in json.loads(os.environ.get("RB_SCHEDULE", "{}")).items():
    sched: object = spec["cron"] if "cron" in spec else timedelta(seconds=spec["every"])
    item: dict[str, object] = {"task": spec.get("task", "beatapp.tick"), "schedule": sched,
                               "args": spec.get("args", [name])}
    if "reliable_beat" in spec:
        item["options"] = {"reliable_beat": spec["reliable_beat"]}
    schedule[name] = item
app.conf.beat_schedule = schedule


def _freeze_here(flag: str, where: str) -> None:
    if os.path.exists(flag):
        os.unlink(flag)
        print(f"beatapp: FROZEN {where}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        print("beatapp: THAWED", file=sys.stderr, flush=True)


_before_publish = os.environ.get("RB_FREEZE_BEFORE_PUBLISH")
if _before_publish:
    from reliable_beat.beat import Beat as _Beat

    _tick = _Beat.tick

    def _tick_then_freeze(self: _Beat) -> object:
        result = _tick(self)
        if result.triggers and [t for t in result.triggers if t.fire_at <= result.now]:
            _freeze_here(_before_publish, "after the claim's commit, before publishing")
        return result

    _Beat.tick = _tick_then_freeze  # type: ignore[method-assign,assignment]

_after_publish = os.environ.get("RB_FREEZE_AFTER_PUBLISH")
if _after_publish:
    from reliable_beat.celery import scheduler as _scheduler

    _publish_batch = _scheduler.publish_celery_batch

    def _publish_then_freeze(*args: object, **kwargs: object) -> object:
        outcomes = _publish_batch(*args, **kwargs)
        _freeze_here(_after_publish, "after the broker accepted, before marking sent")
        return outcomes

    _scheduler.publish_celery_batch = _publish_then_freeze  # type: ignore[assignment]

if os.environ.get("RB_PAUSE_AFTER_CLAIM_AHEAD"):
    import pause_hook  # noqa: F401  (tests/apps: patches the claim; see its docstring)
