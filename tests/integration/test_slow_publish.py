"""A beat whose publish is slow (the broker answers, late) gives its batch up before another
beat's sweep may take the same slots, on real PostgreSQL + Redis: every slot reaches the
broker once, whatever ``reliable_beat_publish_timeout_seconds`` says.

The slow broker is a TCP proxy in front of the real Redis that holds each request for a few
seconds before passing it on: the beat's publish opens its connection while the broker is
slow, gives up before the request that would carry its batch is written and hands the batch
back; the other beat's sweep then publishes each slot once.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery

from reliable_beat import beat as beat_mod
from reliable_beat import loop as loop_mod
from reliable_beat import schedules as sch
from reliable_beat.celery import scheduler as scheduler_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries
from reliable_beat.entries import EntryDefinition

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

SWEEP_DELAY = timedelta(seconds=2)
#: how long the slow broker holds each request (more than the sweep delay)
HOLD_SECONDS = 3.5
SLOTS = 30


class SlowProxy:
    """TCP proxy to ``target``; while :attr:`slow`, each request is passed on (in order)
    after :data:`HOLD_SECONDS`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.slow = False
        self.in_flight = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                if self.slow:
                    with self._lock:
                        self.in_flight += 1
                    try:
                        time.sleep(HOLD_SECONDS)
                        server.sendall(data)  # late, but it arrives
                    finally:
                        with self._lock:
                            self.in_flight -= 1
                else:
                    server.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, server):
                s.close()

    @staticmethod
    def _down(server: socket.socket, client: socket.socket) -> None:
        try:
            while data := server.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        finally:
            client.close()

    def close(self) -> None:
        for s in self._sockets:
            s.close()


@pytest.fixture
def proxy(redis_url: str) -> Iterator[SlowProxy]:
    parts = urlsplit(redis_url)
    p = SlowProxy((parts.hostname or "127.0.0.1", parts.port or 6379))
    yield p
    p.close()


def _beat(pg_store: Store, broker: str, owner: str, **conf: Any) -> Any:
    app = Celery("slowpub", broker=broker)
    app.conf.update(reliable_beat_database_url=pg_store.url, beat_schedule={},
                    reliable_beat_claim_ahead_seconds=0, timezone="UTC",
                    reliable_beat_owner_id=owner, **conf)
    sched = scheduler_mod.ReliableScheduler(app=app)
    sched.loop.redispatch = lambda: 0
    return sched


def _seed_due(store: Store, count: int) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        slot = now.replace(microsecond=0)
        for i in range(count):
            d = EntryDefinition(name=f"e{i:02d}", task="slowpub.t", args=[i],
                                schedule=sch.IntervalSchedule(timedelta(hours=1), slot))
            values = d.row_values()
            values.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                          paused=False)
            conn.execute(entries.insert().values(**values))


def _queued(redis_url: str) -> list[str]:
    r = redis.Redis.from_url(redis_url)
    try:
        return sorted(h["reliable_beat_entry"] for h in
                      (json.loads(m)["headers"] for m in r.lrange("celery", 0, -1))
                      if "reliable_beat_entry" in h)
    finally:
        r.close()


def test_slow_publish_gives_its_slots_up_before_another_beats_sweep(
    pg_store: Store, redis_url: str, proxy: SlowProxy, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(loop_mod, "Beat", functools.partial(beat_mod.Beat,
                                                            sweep_delay=SWEEP_DELAY))
    caplog.set_level(logging.INFO)
    slow_url = urlunsplit(urlsplit(redis_url)._replace(netloc=f"127.0.0.1:{proxy.port}"))
    # a user's publish timeout far over the sweep delay (the bound is SWEEP_DELAY / 2)
    a = _beat(pg_store, slow_url, "beat-a", reliable_beat_publish_timeout_seconds=30.0)
    b = _beat(pg_store, redis_url, "beat-b")
    try:
        started = list(caplog.records)
        _seed_due(pg_store, SLOTS)
        proxy.slow = True
        claimed = time.monotonic()

        def sweep_of_b() -> None:  # beat B's sweep, once A's slots look unsent to it
            time.sleep(SWEEP_DELAY.total_seconds() + 0.5)
            b.loop.sweep()

        other = threading.Thread(target=sweep_of_b)
        other.start()
        caplog.clear()
        a.loop._claim()  # claims the 30 slots and publishes them to the slow broker
        other.join()
        proxy.slow = False
        deadline = claimed + HOLD_SECONDS + 5
        while proxy.in_flight and time.monotonic() < deadline:  # every held request decided
            time.sleep(0.05)
        assert proxy.in_flight == 0
        queued = _queued(redis_url)
        assert len(queued) == SLOTS and len(set(queued)) == SLOTS, queued  # each slot once
        published = [r.getMessage() for r in caplog.records
                     if r.name.startswith("reliable_beat") and "slots.published" in r.getMessage()]
        assert published == []  # A published none: no success event counts its slots
        assert any("reliable_beat_publish_timeout_seconds=30" in r.getMessage()
                   and r.levelno == logging.WARNING for r in started)  # the bound is named
    finally:
        a.close()
        b.close()
        a.app.close()
        b.app.close()
