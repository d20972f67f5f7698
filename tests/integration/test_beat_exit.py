"""How fast a beat gets out once asked to stop (docs/operations.md, "celery worker -B, and how
long a graceful stop takes").

* ``request_stop`` ends a wait on the LISTEN connection at once: the Dramatiq beat's SIGTERM
  handler used to only set an ``Event``, which a ``select`` on the database socket does not
  see, so its stop waited out up to ``max_interval`` (real PostgreSQL).
* A started beat process skips the interpreter's final garbage collection at exit (``atexit``
  ``gc.freeze``): that walk was ~90 % of a graceful stop (2-6 s on a loaded host). Checked in
  a real subprocess: an exit handler registered before the loop started (so it runs after
  the loop's) sees the heap frozen.
* ``close()`` is idempotent: Celery calls it twice on a SIGTERM.

Each fails on the loop before (no ``request_stop``; nothing frozen at exit).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from reliable_beat.db.dialects import Store
from reliable_beat.loop import BeatLoop
from reliable_beat.settings import Settings
from tests.apps.quiet_handler import QuietHandler as _Quiet

ROOT = Path(__file__).resolve().parents[2]


def test_request_stop_ends_a_listen_wait_at_once(pg_store: Store) -> None:
    loop = BeatLoop(pg_store, Settings(database_url=pg_store.url), _Quiet(), "exit-test:1")
    try:
        assert loop._wait_for_notify(0.1) is False  # connects and LISTENs
        timer = threading.Timer(0.3, loop.request_stop)
        timer.start()
        started = time.monotonic()
        assert loop._wait_for_notify(20.0) is False  # woken, not notified
        waited = time.monotonic() - started
        timer.join()
        assert waited < 5.0, f"the stop waited {waited:.1f} s on the LISTEN connection"
        assert loop.stop_event is not None and loop.stop_event.is_set()
        # once stopping, no further wait at all
        started = time.monotonic()
        assert loop._wait_for_notify(20.0) is False
        # a wait would take the full 20 s; 5 s of slack for a loaded machine still tells
        assert time.monotonic() - started < 5.0
    finally:
        loop.close()
        loop.close()  # idempotent (Celery's stop calls it twice)


SCRIPT = """
import atexit, gc, sys
from datetime import datetime
def report():
    print("frozen at exit:", gc.get_freeze_count(), flush=True)
atexit.register(report)  # registered first: runs after the loop's exit handler
from reliable_beat.loop import BeatLoop
from reliable_beat.db.dialects import Store
from reliable_beat.settings import Settings
class P:
    destination = "celery"
    def publish(self, messages, now):
        return [(m.id, None) for m in messages]
    def tracked_tasks(self):
        return []
url = sys.argv[1]
settings = Settings(database_url=url, purge_interval_seconds=0)
loop = BeatLoop(Store.from_url(url, role="beat"), settings, P(), "exit-test:2")
assert loop.start()
loop.close()
print("closed", flush=True)
"""


def test_a_beat_process_skips_the_final_gc_walk_at_exit(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'exit.sqlite3'}"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, url], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "closed" in proc.stdout
    frozen = int(proc.stdout.split("frozen at exit:")[1].split()[0])
    assert frozen > 10_000, proc.stdout  # the imported libraries' objects, not walked
