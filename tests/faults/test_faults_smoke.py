"""The CI fault-injection run: the harness as a subprocess, fixed seed, every fault kind.

It starts its own private PostgreSQL and Redis (it restarts and pauses them, so it must not
share the session's servers). About 2.5 minutes; the long run is documented in
``docs/reliability.md``.
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

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.faults]


def _row(out: str, label: str) -> str:
    m = re.search(rf"^\| {re.escape(label)} \| (.*?) \|$", out, re.MULTILINE)
    assert m, f"no table row {label!r} in:\n{out}"
    return m.group(1)


@pytest.mark.timeout(360)
def test_fault_injection_smoke(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """On the broker of ``--broker`` (Redis by default; ``--broker rabbitmq``: a private
    RabbitMQ node, with the ``rabbitmq_restart`` fault)."""
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
        [sys.executable, "-m", "harness.faults", "--minutes", "2.2",
         "--seed", "7", "--workdir", str(tmp_path / "run"), "--broker", broker],
        # RabbitMQ: the node's boot and its restarts add about a minute
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=350 if broker == "rabbitmq" else 230,
    )
    out = proc.stdout
    detail = f"stdout:\n{out}\nstderr (tail):\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, detail
    for kind in fault_kinds(broker) + APP_FAULT_KINDS:
        assert int(_row(out, kind)) >= 1, f"fault {kind} never injected\n{detail}"
    assert int(_row(out, "slots checked")) > 100, detail
    assert _row(out, "missing effects") == "0", detail
    assert _row(out, "duplicated effects") == "0", detail
    assert int(_row(out, "fence rejections (fenced_out attempts)")) >= 1, detail
    assert "RESULT: OK" in out, detail
