"""The orders example, run as a newcomer runs it: real beats, workers, relays, receipt sink.

Embedded (SQLite store + filesystem broker), and on PostgreSQL + Redis in "break it" mode
(workers, beats and relays SIGKILLed and SIGSTOPped at random). The example exits non-zero
when an effect happened twice or is missing, an order is left half-done, the stock does not
balance, or a receipt was lost.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.apps.demos import report_count as _count
from tests.apps.demos import run_example


def _run(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_example("examples.orders", tmp_path / "demo", *args, timeout=timeout)


def _check(out: str) -> None:
    assert "RESULT: OK" in out, out
    placed = _count(out, "orders placed")
    done = _count(out, "orders completed (authorized, reserved, captured, receipt sent)")
    undone = _count(out, "orders compensated (capture declined: inventory released, "
                         "authorization cancelled)")
    declined = _count(out, "orders declined at authorization (unwound, nothing to undo: "
                           "tombstone)")
    assert placed >= 4 and done >= 1 and done + undone + declined == placed, out
    assert _count(out, "effects applied twice") == 0
    assert _count(out, "effects missing or stray") == 0
    assert _count(out, "orders left half-done") == 0
    assert f"| receipts delivered (distinct orders) | {done} of {done} |" in out
    assert "| stock balance (on hand + shipped = initial) | ok |" in out


@pytest.mark.timeout(400)
def test_embedded_orders_demo(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--seconds", "12", timeout=360)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(proc.stdout)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_server_break_it_orders_demo(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    proc = _run(tmp_path, "--server", "--database-url", pg_url, "--broker-url", redis_url,
                "--break-it", "--seconds", "30", "--seed", "3", timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "faults injected" in out and "SIGKILL" in out
    _check(proc.stdout)
