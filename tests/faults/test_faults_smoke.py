"""The CI fault-injection run: the harness as a subprocess, fixed seed, every fault kind.

It starts its own private PostgreSQL (or MariaDB) and Redis (or RabbitMQ): it restarts and
pauses them, so it must not share the session's servers. About 2 minutes (3-4 on RabbitMQ
or MariaDB: node boot and restarts); the long run is documented in ``docs/reliability.md``.
The workflow shapes (saga, timer, signal) run beside the periodic entries and their table is
checked too; they did not lengthen the run measurably (load average 20-25 on 2 cores,
2026-12-01: 164 s with them, 195 s with ``--no-workflows``; the run's length is its fixed
minutes plus a drain that the machine's load dominates).

CI size: :data:`MINUTES` (1.6 on PostgreSQL + Redis). The timeline injects every fault kind
once first, in a random order, then random kinds until 25 s before the end: at load average
11 on 2 cores that first pass took 35 s of the 59 s fault window 1.6 minutes leave (12 s
warm-up, 20 s quiet end); the harness fails the run if a kind was never injected. The
RabbitMQ / MariaDB runs keep 2.2 minutes: their restarts take tens of seconds and come at
most once a minute. Longer runs: ``python -m harness.faults --minutes 30 --seed 20260101``
(``docs/reliability.md``).

* ``test_fault_injection_smoke``: PostgreSQL + the broker of ``--broker``
  (``make test-rabbitmq`` runs it with ``--broker rabbitmq``);
* ``test_fault_injection_smoke_mariadb``: MariaDB as the store (``--store mariadb``, the
  ``mariadb_restart`` fault) + the broker of ``--broker`` (in ``make test``'s MariaDB
  subset).
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
from harness.servers import find_mariadbd, find_pg_bin, find_rabbitmq_bin

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = [pytest.mark.faults]

#: The run's length (minutes): PostgreSQL + Redis, and the slow-restart stacks (RabbitMQ or
#: MariaDB: a node's boot, InnoDB recovery, one slow restart a minute at most).
MINUTES = {False: "1.6", True: "2.2"}


def _row(out: str, label: str) -> str:
    m = re.search(rf"^\| {re.escape(label)} \| (.*?) \|$", out, re.MULTILINE)
    assert m, f"no table row {label!r} in:\n{out}"
    return m.group(1)


def _smoke(tmp_path: Path, broker: str, store: str) -> None:
    """Run the harness for :data:`MINUTES` on ``store`` + ``broker`` and check its table."""
    missing = []
    if store == "postgresql" and find_pg_bin() is None:
        missing.append("PostgreSQL server binaries")
    if store == "mariadb" and find_mariadbd() is None:
        missing.append("mariadbd")
    if broker == "redis" and shutil.which("redis-server") is None:
        missing.append("redis-server")
    if broker == "rabbitmq" and find_rabbitmq_bin() is None:
        missing.append("rabbitmq-server")
    if missing:
        reason = f"{', '.join(missing)} not found"
        if IN_CI:
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("RELIABLE_BEAT_TEST_POSTGRES_URL", None)
    env.pop("RELIABLE_BEAT_TEST_REDIS_URL", None)
    slow = broker == "rabbitmq" or store == "mariadb"
    proc = subprocess.run(
        [sys.executable, "-m", "harness.faults", "--minutes", MINUTES[slow],
         "--seed", "7", "--workdir", str(tmp_path / "run"), "--broker", broker,
         "--store", store],
        # RabbitMQ / MariaDB: the node's boot and its restarts add about a minute
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=350 if slow else 230,
    )
    out = proc.stdout
    detail = f"stdout:\n{out}\nstderr (tail):\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, detail
    for kind in fault_kinds(broker, store) + APP_FAULT_KINDS:
        assert int(_row(out, kind)) >= 1, f"fault {kind} never injected\n{detail}"
    assert int(_row(out, "slots checked")) > 100, detail
    assert _row(out, "missing effects") == "0", detail
    assert _row(out, "duplicated effects") == "0", detail
    assert int(_row(out, "fence rejections (fenced_out attempts)")) >= 1, detail
    _workflow_rows(out, detail)
    assert "RESULT: OK" in out, detail


def _workflow_rows(out: str, detail: str) -> None:
    """The workflow shapes' table (saga, timer, signal beside the periodic entries): every
    shape started, sagas both completed and unwound as the fraction says, each effect exactly
    once, nothing left waiting, ``blocked`` exactly where a poison workflow was injected."""
    started = _row(out, "workflows started (saga / timer / signal; by beat entries / by the "
                        "harness)")
    m = re.fullmatch(r"(\d+) \((\d+) / (\d+) / (\d+); (\d+) / (\d+)\)", started)
    assert m, f"workflows started: {started!r}\n{detail}"
    _total, saga, timer, sig, by_beat, by_harness = map(int, m.groups())
    assert saga >= 5 and timer >= 3 and sig >= 3, detail
    assert by_beat >= 1 and by_harness >= 1, detail
    assert int(_row(out, "workflows completed")) >= 5, detail
    compensated, expected = _row(
        out, "workflows compensated (saga unwound) / expected by the fraction").split(" / ")
    assert int(compensated) >= 1 and compensated == expected, detail
    blocked = _row(out, "workflows blocked (injected)")
    m = re.fullmatch(r"(\d+) \((\d+)\)", blocked)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) >= 1, detail
    assert _row(out, "workflows left pending/running/waiting") == "0", detail
    assert int(_row(out, "workflow effects (forward + compensation rows)")) >= 3 * saga, detail
    assert _row(out, "effects duplicated") == "0", detail
    assert _row(out, "effects missing") == "0", detail
    assert _row(out, "effects unexpected / compensations out of order / timers early") == \
        "0 / 0 / 0", detail


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(360)
def test_fault_injection_smoke(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """PostgreSQL + the broker of ``--broker`` (Redis by default; ``--broker rabbitmq``: a
    private RabbitMQ node, with the ``rabbitmq_restart`` fault)."""
    _smoke(tmp_path, request.config.getoption("--broker"), "postgresql")


@pytest.mark.mariadb
@pytest.mark.timeout(360)
def test_fault_injection_smoke_mariadb(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """MariaDB as the store (a private server, the ``mariadb_restart`` fault: a clean
    shutdown or a SIGKILL of ``mariadbd``) + the broker of ``--broker``."""
    _smoke(tmp_path, request.config.getoption("--broker"), "mariadb")
