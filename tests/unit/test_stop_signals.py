"""``deferred_stop_signals`` holds a graceful stop back from a claim / a held slot's publish.

The beat process has other threads (retention, Celery's beat pidbox, the metrics server).
The kernel hands a process-directed SIGTERM to a thread that does not block it, and CPython
runs the Python handler in the main thread at its next bytecode: a per-thread
``pthread_sigmask`` therefore held nothing back, and Celery's handler (``scheduler.close()``
then ``SystemExit``) ran in the middle of a claim, losing the held triggers to the sweep.
The signal here is sent by another process (``kill``), as a supervisor sends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest

from reliable_beat.loop import deferred_stop_signals


@pytest.fixture
def other_thread() -> Iterator[None]:
    """A live thread that does not block SIGTERM, like a beat's retention thread."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


@pytest.fixture
def handled() -> Iterator[list[tuple[int, float]]]:
    """A SIGTERM handler recording (signum, monotonic) for the test, restored after."""
    got: list[tuple[int, float]] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        got.append((signum, time.monotonic()))

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kill_from_outside(sig: signal.Signals = signal.SIGTERM) -> None:
    subprocess.run(["kill", f"-{sig.name[3:]}", str(os.getpid())], check=True)


def _busy(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def test_sigterm_from_outside_waits_for_the_block_with_another_thread_alive(
        other_thread: None, handled: list[tuple[int, float]]) -> None:
    with deferred_stop_signals():
        _kill_from_outside()
        _busy(0.3)  # bytecode runs: an undeferred handler would run here
        assert handled == [], "the stop handler ran inside the deferred block"
        left = time.monotonic()
    assert [s for s, _ in handled] == [signal.SIGTERM]
    assert handled[0][1] >= left  # delivered once, right after the block


def test_handler_exception_surfaces_after_the_block(other_thread: None) -> None:
    def celery_like(signum: int, frame: FrameType | None) -> None:
        raise SystemExit  # Celery's beat handler: scheduler.close(), then SystemExit

    previous = signal.signal(signal.SIGTERM, celery_like)
    steps: list[str] = []
    try:
        with pytest.raises(SystemExit), deferred_stop_signals():
            _kill_from_outside()
            _busy(0.2)
            steps.append("claim committed")
            _busy(0.1)
            steps.append("triggers held")
        assert steps == ["claim committed", "triggers held"]
        assert signal.getsignal(signal.SIGTERM) is celery_like  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_nested_blocks_deliver_once_after_the_outer(
        other_thread: None, handled: list[tuple[int, float]]) -> None:
    with deferred_stop_signals():
        with deferred_stop_signals():
            _kill_from_outside()
            _busy(0.2)
        _busy(0.1)
        assert handled == []
    assert [s for s, _ in handled] == [signal.SIGTERM]


def test_no_signal_no_call(handled: list[tuple[int, float]]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with deferred_stop_signals():
        pass
    assert handled == [] and signal.getsignal(signal.SIGTERM) is before
