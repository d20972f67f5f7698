"""A small process manager for real ``celery beat`` subprocesses in tests.

Every process is started in its own session with its output in a log file; the fixture's
finalizer (:meth:`BeatProcs.cleanup`) SIGCONTs and kills whatever is still running, so a
failing test never leaves a beat behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Beat:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class BeatProcs:
    """Start / kill / stop / continue ``celery -A beatapp beat`` processes."""

    logdir: Path
    env: dict[str, str] = field(default_factory=dict)
    beats: list[Beat] = field(default_factory=list)

    def start(self, name: str, *, command: list[str] | None = None, app: str = "beatapp",
              code: Path | None = None, **env: str) -> Beat:
        """Start ``celery -A beatapp beat`` (or ``celery -A beatapp`` + ``command``, e.g.
        ``["worker", "-B", ...]``; ``app``: another module of tests/apps) with ``env`` on top
        of :attr:`env`. ``code``: a directory holding another revision's ``reliable_beat``
        package (:func:`harness.oldcode.extract`), put first on ``PYTHONPATH``: the process
        runs that code with the current tree's apps (it runs in :attr:`logdir`, which must
        not hold a ``reliable_beat`` of its own)."""
        full = dict(os.environ)
        full.pop("CELERY_CONFIG_MODULE", None)
        full.update(self.env)
        full.update(env)
        full["PYTHONPATH"] = os.pathsep.join([*([str(code)] if code else []), str(ROOT),
                                              str(APPS)])
        full["PYTHONUNBUFFERED"] = "1"
        log = self.logdir / f"{name}-{len(self.beats)}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, *(command or [
                    "beat", "-l", "info", "--pidfile=", "-s",
                    str(self.logdir / f"{name}-schedule")])],
                cwd=str(self.logdir), env=full, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        beat = Beat(name, proc, log)
        self.beats.append(beat)
        return beat

    def kill(self, beat: Beat) -> None:
        os.kill(beat.pid, signal.SIGKILL)
        beat.proc.wait(timeout=10)

    def stop(self, beat: Beat) -> None:
        """SIGSTOP: frozen, holding whatever it holds."""
        os.kill(beat.pid, signal.SIGSTOP)

    def cont(self, beat: Beat) -> None:
        os.kill(beat.pid, signal.SIGCONT)

    def terminate(self, beat: Beat, timeout: float = 15) -> int:
        """Graceful stop (SIGTERM), SIGKILL after ``timeout``; returns the exit code."""
        if beat.alive():
            os.kill(beat.pid, signal.SIGCONT)
            os.kill(beat.pid, signal.SIGTERM)
            try:
                beat.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                beat.proc.kill()
                beat.proc.wait(timeout=10)
        return beat.proc.returncode

    def cleanup(self) -> None:
        for beat in self.beats:
            if beat.alive():
                try:
                    os.kill(beat.pid, signal.SIGCONT)
                    beat.proc.kill()
                    beat.proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
