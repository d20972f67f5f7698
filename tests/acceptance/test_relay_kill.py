"""A real relay process SIGKILLed between publish and mark-sent: its batch is delivered
again (same message id, same Celery task id) by the next relay once the claim lease expires,
nothing is lost, and every row ends ``sent``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox as outbox_t

APPS = Path(__file__).resolve().parents[1] / "apps"
WORKTREE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(APPS))

import redis_queue  # noqa: E402


def relay_process(store: Store, redis_url: str, tmp: Path, *, sleep_after: float,
                  batch_size: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=f"{WORKTREE}{os.pathsep}{APPS}",
               RB_TEST_REDIS_URL=redis_url, RELIABLE_BEAT_DATABASE_URL=store.url,
               RB_TEST_SLEEP_AFTER_DELIVER=str(sleep_after),
               RB_TEST_DELIVERED_FILE=str(tmp / "delivered.txt"))
    return subprocess.Popen(
        [sys.executable, "-m", "reliable_beat.cli", "-A", "outbox_app", "relay",
         "--batch-size", str(batch_size), "--claim-lease-seconds", "2", "--loglevel", "WARNING"],
        env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(tmp / "relay.log", "ab"),
    )


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def states(store: Store) -> Counter[str]:
    with store.begin() as conn:
        return Counter(conn.execute(sa.select(outbox_t.c.state)).scalars())


def test_sigkill_between_publish_and_mark_sent(server_store: Store, redis_url: str,
                                               tmp_path: Path) -> None:
    redis_queue.flush(redis_url)
    with server_store.begin() as conn:
        ids = [outbox.add(conn, "celery", {"task": "t", "args": [i]}, key=f"job:{i}")
               for i in range(50)]
    delivered = tmp_path / "delivered.txt"
    victim = relay_process(server_store, redis_url, tmp_path, sleep_after=120, batch_size=20)
    try:
        wait_for(lambda: delivered.exists() and len(delivered.read_text().split()) >= 20, 30,
                 "the first batch to be published")
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
    killed_batch = delivered.read_text().split()
    assert len(killed_batch) == 20
    assert states(server_store) == Counter({"pending": 50})  # published, never marked

    survivor = relay_process(server_store, redis_url, tmp_path, sleep_after=0, batch_size=20)
    try:
        wait_for(lambda: states(server_store) == Counter({"sent": 50}), 60, "all rows sent")
    finally:
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(15) == 0

    published = redis_queue.queued(redis_url)
    per_message = Counter(m["headers"]["reliable_beat_message_id"] for m in published)
    assert set(per_message) == set(ids)  # nothing lost
    assert {k for k, n in per_message.items() if n > 1} == set(killed_batch)  # only the crash
    assert max(per_message.values()) == 2
    task_ids: dict[str, set[str]] = {}
    for m in published:
        task_ids.setdefault(m["headers"]["reliable_beat_message_id"], set()).add(m["headers"]["id"])
    assert all(len(v) == 1 for v in task_ids.values())  # same task id on every delivery
    with server_store.begin() as conn:
        attempts = dict(conn.execute(sa.select(outbox_t.c.message_id, outbox_t.c.attempts)).all())
    assert {attempts[k] for k in killed_batch} == {2}
