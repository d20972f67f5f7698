"""``python -m benchmarks --size smoke`` keeps working: it exits 0 and prints every table.

No timing thresholds: the numbers of a smoke run on a shared CI machine mean nothing; the
run only proves the benchmark code still drives the library end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKTREE = Path(__file__).resolve().parents[2]

HEADERS = (
    "### 1. Dispatch throughput",
    "### 2. Scale",
    "### 3. Fire lateness",
    "### 4. Task overhead",
    "### 5. Relay throughput",
)


def test_benchmarks_smoke(pg_url: str, redis_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(WORKTREE)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--size", "smoke", "--postgres-url", pg_url,
         "--redis-url", redis_url],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for header in HEADERS:
        assert header in proc.stdout, f"{header!r} missing from:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout


@pytest.mark.mariadb
def test_benchmarks_stacks_smoke(pg_url: str, redis_url: str, mariadb_server: str,
                                 amqp_url: str) -> None:
    """Part 6 (``--only stacks``): PostgreSQL / MariaDB x Redis / RabbitMQ, every stack a row."""
    env = {**os.environ, "PYTHONPATH": str(WORKTREE)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--size", "smoke", "--only", "stacks",
         "--postgres-url", pg_url, "--redis-url", redis_url, "--mariadb-url", mariadb_server,
         "--amqp-url", amqp_url],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "### 6. Stacks" in proc.stdout, proc.stdout
    for stack in ("PostgreSQL + Redis", "PostgreSQL + RabbitMQ", "MariaDB + Redis",
                  "MariaDB + RabbitMQ"):
        assert f"| {stack} |" in proc.stdout, f"{stack} missing from:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout


# CI size: part 1's smoke above (the same loop on Redis); the AMQP messages' proof is
# tests/integration/test_publish_builder_amqp.py
@pytest.mark.full
@pytest.mark.timeout(900)
def test_benchmarks_dispatch_amqp_smoke(pg_url: str, redis_url: str, amqp_url: str) -> None:
    """Part 1b (``--only dispatch_amqp``): dispatch on RabbitMQ, a row per k, every column
    (ten measurements of spawned processes: minutes on a loaded 2-core machine)."""
    env = {**os.environ, "PYTHONPATH": str(WORKTREE)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--size", "smoke", "--only", "dispatch_amqp",
         "--postgres-url", pg_url, "--redis-url", redis_url, "--amqp-url", amqp_url],
        cwd=WORKTREE, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "### 1b. Dispatch throughput on RabbitMQ" in proc.stdout, proc.stdout
    for k in (1, 2):
        assert f"\n| {k} | " in proc.stdout, f"k={k} missing from:\n{proc.stdout}"
    assert "FAILED" not in proc.stdout
