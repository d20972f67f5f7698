"""Celery app of the dashboard's real-run test (tests/acceptance/test_dashboard_real_run.py).

wf_app (its workflows, the saga among them, and its settings: 2 s leases, a 5 s Redis
visibility timeout) plus a beat schedule: ``dash-pay``, every second, misfire policy
``skip`` with a 1.5 s grace (a beat frozen across slots records them missed), overlap
``allow``. Environment: wf_app's, and ``RB_DASH_FREEZE_FLAG``: a file path; when it exists
the next ``dash.pay`` removes it, prints ``dash: FROZEN <key>`` and SIGSTOPs its own worker
inside the body (claimed, effect not committed), until someone sends SIGCONT.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

from wf_app import app

from reliable_beat.celery.task import IdempotentTask

app.conf.beat_scheduler = "reliable_beat.celery:ReliableScheduler"
app.conf.beat_max_loop_interval = 1.0
app.conf.timezone = "UTC"
app.conf.beat_schedule = {
    "dash-pay": {"task": "dash.pay", "schedule": timedelta(seconds=1), "args": ["pay"],
                 "options": {"reliable_beat": {"misfire_policy": "skip",
                                               "misfire_grace": 1.5,
                                               "overlap_policy": "allow"}}},
}


@app.task(base=IdempotentTask, bind=True, name="dash.pay")
def pay(self: IdempotentTask, label: str) -> str:
    flag = os.environ.get("RB_DASH_FREEZE_FLAG")
    if flag and os.path.exists(flag):
        os.unlink(flag)
        print(f"dash: FROZEN {self.idempotency_key}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        print("dash: THAWED", file=sys.stderr, flush=True)
    return label
