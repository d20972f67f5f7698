"""The CI fault-injection run of the Dramatiq adapter: ``python -m harness.faults
--framework dramatiq`` as a subprocess, fixed seed, every fault kind, the same ledger checks
as the Celery run (``test_faults_smoke.py``) with real ``dramatiq`` workers and
``reliable-beat dramatiq beat|relay`` processes.

It starts its own private PostgreSQL and Redis / RabbitMQ (it restarts and pauses them, so it
must not share the session's servers). About 3 minutes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.faults import APP_FAULT_KINDS, fault_kinds
from harness.servers import find_pg_bin, find_rabbitmq_bin

pytest.importorskip("dramatiq")

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# make test-full (CI size: the Celery fault smoke + test_adapters_celery_dramatiq.py)
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.faults, pytest.mark.full]


def _row(out: str, label: str) -> str:
    m = re.search(rf"^\| {re.escape(label)} \| (.*?) \|$", out, re.MULTILINE)
    assert m, f"no table row {label!r} in:\n{out}"
    return m.group(1)


@pytest.mark.timeout(420)
def test_dramatiq_fault_injection_smoke(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Every fault kind at least once; every checked slot has exactly one effect; the zombie
    worker's commit is fenced out; poison rows isolated. On ``--broker`` (Redis default)."""
    broker = request.config.getoption("--broker")
    if find_pg_bin() is None or shutil.which("redis-server") is None or (
            broker == "rabbitmq" and find_rabbitmq_bin() is None):
        reason = "PostgreSQL server binaries, redis-server or rabbitmq-server not found"
        if IN_CI:
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("RELIABLE_BEAT_TEST_POSTGRES_URL", None)
    env.pop("RELIABLE_BEAT_TEST_REDIS_URL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "harness.faults", "--framework", "dramatiq", "--minutes", "2.5",
         "--seed", "7", "--workdir", str(tmp_path / "run"), "--broker", broker],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=400 if broker == "rabbitmq" else 300,
    )
    out = proc.stdout
    detail = f"stdout:\n{out}\nstderr (tail):\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, detail
    assert "(dramatiq, " in out, detail
    for kind in fault_kinds(broker) + APP_FAULT_KINDS:
        assert int(_row(out, kind)) >= 1, f"fault {kind} never injected\n{detail}"
    assert int(_row(out, "slots checked")) > 100, detail
    assert _row(out, "missing effects") == "0", detail
    assert _row(out, "duplicated effects") == "0", detail
    assert int(_row(out, "fence rejections (fenced_out attempts)")) >= 1, detail
    assert "RESULT: OK" in out, detail
