"""The payouts example on Dramatiq (``python -m examples.payouts --framework dramatiq``), run
as a newcomer runs it: real ``reliable-beat dramatiq beat`` processes, ``dramatiq`` workers,
``reliable-beat dramatiq relay``, a webhook sink. Embedded (SQLite store + a private
``redis-server``: Dramatiq has no multi-process broker without a server) and on PostgreSQL +
Redis in "break it" mode. The example exits non-zero when any merchant is paid twice or not
at all for a fired slot, or a notification was lost.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dramatiq")

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *args: str, timeout: float,
         env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "examples.payouts", "--framework", "dramatiq", "--workdir",
         str(tmp_path / "demo"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def _count(out: str, label: str) -> int:
    m = re.search(rf"\| {re.escape(label)} \| (\d+)", out)
    assert m, f"{label!r} missing from the report:\n{out}"
    return int(m.group(1))


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
    slots = _count(out, "slots fired")
    assert slots >= 2
    assert _count(out, "merchant/slot pairs paid exactly once") == 3 * slots
    assert _count(out, "paid twice") == 0
    assert _count(out, "missing (fired slot, merchant unpaid)") == 0


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
