"""The payouts example on Dramatiq (``python -m examples.payouts --framework dramatiq``), run
as a newcomer runs it: real ``reliable-beat dramatiq beat`` processes, ``dramatiq`` workers,
``reliable-beat dramatiq relay``, a webhook sink. Embedded (SQLite store + a private
``redis-server``: Dramatiq has no multi-process broker without a server) and on PostgreSQL +
Redis in "break it" mode. The example exits non-zero when any merchant is paid twice or not
at all for a fired slot, or a notification was lost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.apps.demos import assert_each_merchant_paid_once, run_example
from tests.apps.demos import report_count as _count

pytest.importorskip("dramatiq")


def _run(tmp_path: Path, *args: str, timeout: float,
         env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_example("examples.payouts", tmp_path / "demo", "--framework", "dramatiq",
                       *args, timeout=timeout, env_extra=env_extra)


@pytest.mark.timeout(300)
def test_embedded_dramatiq_demo_pays_each_merchant_once_per_slot(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH (the embedded Dramatiq demo starts one)")
    proc = _run(tmp_path, "--seconds", "25", timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "embedded mode uses a private redis-server" in out  # said, not silent
    assert "payouts demo report (dramatiq," in out
    assert "RESULT: OK" in out
    assert_each_merchant_paid_once(out)


def test_embedded_dramatiq_demo_without_redis_server_says_what_it_needs(
        tmp_path: Path) -> None:
    """No ``redis-server`` on PATH and no ``--broker-url``: exit 2 naming the fix."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    proc = _run(tmp_path, "--seconds", "5", timeout=120, env_extra={"PATH": str(bindir)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs a Redis broker" in proc.stderr
    assert "--broker-url" in proc.stderr


@pytest.mark.full  # CI size: test_example_payouts.py's break-it + test_adapters_celery_dramatiq.py
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(420)
def test_server_break_it_dramatiq_demo(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    proc = _run(tmp_path, "--server", "--database-url", pg_url, "--broker-url", redis_url,
                "--break-it", "--seconds", "35", "--seed", "3", timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "payouts demo report (dramatiq," in out
    assert "faults injected" in out
    assert _count(out, "paid twice") == 0
    assert _count(out, "missing (fired slot, merchant unpaid)") == 0
