"""A database outage is reported first, then every 30 s with a count: not once per retry.

Against a real unreachable PostgreSQL address (a closed port): the beat's
``record_unmarked`` and the relay's loop retry about once a second during an outage; before,
each retry logged one ERROR / WARNING line (3600 an hour).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from reliable_beat.db.dialects import Store
from reliable_beat.logs import RepeatedLog
from reliable_beat.settings import Settings


def _dead_store() -> Store:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return Store.from_url(f"postgresql+psycopg://u:pw@127.0.0.1:{port}/x?connect_timeout=2")


def test_repeated_log_first_then_every_interval_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    rep = RepeatedLog(logging.getLogger("t.rep"), every_seconds=30, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="t.rep"):
        for _ in range(31):  # one a second for 30 s, then one more
            rep.log(logging.ERROR, "still down (%s)", "x")
            now[0] += 1.0
        rep.reset()
        rep.log(logging.ERROR, "still down (%s)", "y")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["still down (x)", "still down (x) [29 similar suppressed in 30 s]",
                     "still down (y)"]


def test_beat_still_cannot_record_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    from reliable_beat.celery import scheduler as sched

    store = _dead_store()
    unmarked: list[tuple[list[int], list[int]]] = [([1, 2], [])]
    sched._STILL_UNMARKED.reset()
    try:
        with caplog.at_level(logging.INFO, logger="reliable_beat"):
            for _ in range(5):
                assert sched.record_unmarked(store, unmarked) is False
    finally:
        sched._STILL_UNMARKED.reset()
        store.engine.dispose()
    lines = [r for r in caplog.records if "still cannot record" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.ERROR and "2 published triggers" in lines[0].getMessage()
    assert unmarked == [([1, 2], [])]  # nothing dropped: recorded when the database returns


def test_relay_store_unavailable_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    from reliable_beat.relay import Relay

    store = _dead_store()
    relay = Relay(store, handlers={"email": lambda m: None},
                  settings=Settings(relay_poll_seconds=0.05), owner="r")
    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="reliable_beat"):
        t = threading.Thread(target=relay.run_forever, args=(stop,), daemon=True)
        t.start()
        time.sleep(2.0)  # dozens of retries
        stop.set()
        t.join(30)
    store.engine.dispose()
    for text in ("store unavailable", "LISTEN connection failed"):
        lines = [r for r in caplog.records if text in r.getMessage()]
        assert len(lines) <= 1, [r.getMessage() for r in lines]
    assert any("store unavailable" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
