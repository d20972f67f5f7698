"""``reliable-beat lease clear`` on a frozen worker, with real processes.

A real ``celery worker`` (A) takes a scheduled run's trigger and freezes (SIGSTOP) inside
its body, effect uncommitted, holding a long lease; its unacknowledged message stays with
it (the Redis visibility timeout is an hour here, as RabbitMQ keeps a message with a live
connection). A person runs ``lease clear KEY --yes``: the run's trigger must be re-sent at
once (through the outbox: the real relay process publishes it), a second worker (B) runs
it under the new fence, and when A wakes its commit is rejected: the effect exists once.

Fails on the old code: ``lease clear`` sent nothing, so B never got a message (the
re-dispatch sweep would re-send the ``retrying`` run only ``redispatch_seconds +
retry_cap_seconds`` later: 3 min at the defaults).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from reliable_beat import runs
from reliable_beat.beat import build_trigger_payload, trigger_outbox_row
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.db.tables import runs as runs_t
from tests.acceptance.test_idempotent_task import Env, meta

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(240)]


class FrozenEnv(Env):
    """Workers with a long lease (60 s) and a message that stays with a frozen worker."""

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "RB_LEASE_SECONDS": "60", "RB_VISIBILITY_TIMEOUT": "3600"}

    def relay(self) -> subprocess.Popen[bytes]:
        log = open(self.tmp / "worker-relay.log", "wb")  # noqa: SIM115 (named for logs())
        proc = subprocess.Popen(
            [sys.executable, "-m", "reliable_beat.cli", "-A", "rb_task_app", "relay"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
        )
        self.procs.append(proc)
        return proc

    def schedule(self, key: str, queue: str) -> None:
        """A scheduled run and its trigger row, as the beat writes them (due now)."""
        kwargs = {"sleep_first_attempt": 15.0}
        with self.store.begin() as conn:
            now = self.store.now(conn)
            run_id = conn.execute(sa.insert(runs_t).values(
                idempotency_key=key, entry_name="frozen", fire_at=now, trigger="schedule",
                task="rb.write_effect", args=["frozen"], kwargs=kwargs, state="scheduled",
                created_at=now, updated_at=now,
            ).returning(runs_t.c.id)).scalar_one()
            payload = build_trigger_payload(
                task="rb.write_effect", args=["frozen"], kwargs=kwargs,
                options={"queue": self.queue(queue)}, key=key, entry="frozen", fire_at=now,
                trigger="schedule")
            conn.execute(sa.insert(outbox).values(**trigger_outbox_row(
                key, run_id, payload, now, available_at=now, claimed_by=None)))


@pytest.fixture
def fx(server_url: str, broker_url: str, server_store: Store, tmp_path: Path
       ) -> Iterator[FrozenEnv]:
    """Workers on PostgreSQL and on MariaDB (``server_url``); every process killed after."""
    meta.create_all(server_store.engine)
    e = FrozenEnv(server_url, broker_url, server_store, tmp_path)
    try:
        yield e
    finally:
        e.kill_all()
        e.client.close()


def test_lease_clear_resends_and_the_effect_happens_once(fx: FrozenEnv) -> None:
    key = "frozen@2026-05-01T02:00:00Z"
    a = fx.worker("shared")
    fx.relay()
    fx.schedule(key, "shared")
    fx.wait("A inside its body", lambda: fx.progress(key), 60)
    assert fx.progress(key)[0]["pid"] == a.pid
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b = fx.worker("shared")  # B shares A's queue; A's message stays with A
        started = time.monotonic()
        cleared = fx.cli("lease", "clear", key, "--yes", "--json")
        assert cleared.returncode == 0, cleared.stdout + cleared.stderr
        returned = time.monotonic()
        fx.wait("B committed the re-sent run", lambda: fx.state(key) == "succeeded", 60)
        took = time.monotonic() - started
        body = json.loads(cleared.stdout)
        assert body["resend"] == "resent" and body["fence_token"] == 2, body
        assert body["previous_state"] == "running" and body["state"] == "retrying"
        eff = fx.effects(key)
        assert [(e["fence"], e["pid"]) for e in eff] == [(3, b.pid)], eff
    finally:
        os.kill(a.pid, signal.SIGCONT)
    fx.wait("A's try ended", lambda: any(
        p["what"] == "leaving_body" and p["pid"] == a.pid for p in fx.progress(key)), 90)
    time.sleep(1.0)  # let A's rejected commit and anything after it happen
    eff = fx.effects(key)
    assert len(eff) == 1 and eff[0]["fence"] == 3, eff  # A's write rolled back
    rows = fx.attempts(key)
    by_fence = {r["fence_token"]: r["outcome"] for r in rows
                if r["outcome"] in ("fenced_out", "succeeded", "running")}
    assert by_fence == {1: "fenced_out", 3: "succeeded"}, rows
    run = runs.get_run(fx.store, key)
    assert (run["state"], run["fence_token"]) == ("succeeded", 3)
    print(f"lease clear (CLI process included) -> re-sent run succeeded on B in {took:.2f} s "
          f"({took - (returned - started):.2f} s after the CLI returned)")
