"""The beat's and the relay's ``LISTEN`` work where only psycopg2 is installed.

Before: the beat loop's ``_wait_for_notify`` imported psycopg 3 unconditionally, so a beat on
a psycopg2-only install (a Django project on psycopg2) died with ModuleNotFoundError on its
first idle wait.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.db.dialects import Store
from reliable_beat.entries import NOTIFY_CHANNEL

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(120)]


@pytest.fixture
def scheduler(pg_store: Store) -> Iterator[Any]:
    pytest.importorskip("psycopg2", reason="pip install psycopg2-binary")
    from reliable_beat.celery.scheduler import ReliableScheduler

    app = Celery("listen2", broker="memory://", set_as_current=False)
    app.conf.update(reliable_beat_database_url=pg_store.url, beat_schedule={},
                    timezone="UTC")
    sched = ReliableScheduler(app=app)
    yield sched
    sched.close()
    app.close()


def test_wait_for_notify_on_psycopg2_only(scheduler: Any, pg_store: Store,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # a psycopg2-only install
    loop = scheduler.loop  # reliable_beat.loop.BeatLoop: the core loop the scheduler drives
    assert loop._wait_for_notify(0.2) is False  # connects, LISTENs, times out
    assert type(loop._listen).__module__.startswith("psycopg2")

    def notify() -> None:
        time.sleep(0.5)
        with pg_store.engine.begin() as conn:
            conn.execute(sa.text(f"NOTIFY {NOTIFY_CHANNEL}"))

    t = threading.Thread(target=notify)
    t.start()
    started = time.monotonic()
    woken = loop._wait_for_notify(20.0)
    took = time.monotonic() - started
    t.join()
    assert woken is True and took < 10.0, (woken, took)
    assert loop._wait_for_notify(0.1) is False  # the notification was consumed


def test_relay_listener_on_psycopg2_only(pg_store: Store,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's LISTEN too: before, it failed to connect on every poll (a WARNING every
    30 s) and only polled."""
    pytest.importorskip("psycopg2", reason="pip install psycopg2-binary")
    from reliable_beat.outbox import NOTIFY_CHANNEL as OUTBOX_CHANNEL
    from reliable_beat.relay import _Listener

    monkeypatch.setitem(sys.modules, "psycopg", None)
    listener = _Listener(pg_store)
    try:
        assert listener.wait(0.2) is False
        assert type(listener.conn).__module__.startswith("psycopg2")

        def notify() -> None:
            time.sleep(0.5)
            with pg_store.engine.begin() as conn:
                conn.execute(sa.text(f"NOTIFY {OUTBOX_CHANNEL}"))

        t = threading.Thread(target=notify)
        t.start()
        started = time.monotonic()
        woken = listener.wait(20.0)
        took = time.monotonic() - started
        t.join()
        assert woken is True and took < 10.0, (woken, took)
        assert listener.wait(0.1) is False
    finally:
        listener.close()
