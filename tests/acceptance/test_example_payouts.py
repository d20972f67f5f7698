"""The payouts example, run as a newcomer runs it: real beats, worker, relay, webhook sink.

Embedded (SQLite store + filesystem broker) as in ``make demo``, and on PostgreSQL + Redis in
"break it" mode (beats and workers SIGKILLed and SIGSTOPped during the run). The example
exits non-zero when any merchant is paid twice or not at all for a fired slot.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.apps.demos import assert_each_merchant_paid_once, run_example
from tests.apps.demos import report_count as _count


def _run(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_example("examples.payouts", tmp_path / "demo", *args, timeout=timeout)


def test_embedded_demo_pays_each_merchant_once_per_slot(tmp_path: Path) -> None:
    # A slot every 5 s; the beats' start-up eats into the run on a loaded machine (16 s gave
    # 2 slots, the minimum below, under 3 busy loops on 2 cores): 25 s leaves room.
    proc = _run(tmp_path, "--seconds", "25", timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT: OK" in out
    assert_each_merchant_paid_once(out)


def test_server_break_it_demo(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    proc = _run(tmp_path, "--server", "--database-url", pg_url, "--broker-url", redis_url,
                "--break-it", "--seconds", "35", "--seed", "3", timeout=360)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "faults injected" in out
    assert _count(out, "paid twice") == 0
    assert _count(out, "missing (fired slot, merchant unpaid)") == 0
