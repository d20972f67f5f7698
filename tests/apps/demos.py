"""Running the ``examples/`` demos as a newcomer runs them (``python -m examples.NAME``) and
reading their Markdown report (``| label | count |`` rows), for the acceptance tests
``test_example_*.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_example(module: str, workdir: Path, *args: str, timeout: float,
                env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE --workdir WORKDIR ARGS`` from the checkout (on ``PYTHONPATH``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", module, "--workdir", str(workdir), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def report_count(out: str, label: str) -> int:
    """The count of report row ``label`` (fails naming the label when the row is missing)."""
    m = re.search(rf"\| {re.escape(label)} \| (\d+)", out)
    assert m, f"{label!r} missing from the report:\n{out}"
    return int(m.group(1))


def assert_each_merchant_paid_once(out: str, *, min_slots: int = 2) -> int:
    """A payouts report (plain, Dramatiq or Django shop): at least ``min_slots`` slots fired,
    each of the 3 merchants paid exactly once per slot, nobody twice, nobody missing.
    Returns the slot count."""
    slots = report_count(out, "slots fired")
    assert slots >= min_slots, out
    assert report_count(out, "merchant/slot pairs paid exactly once") == 3 * slots, out
    assert report_count(out, "paid twice") == 0, out
    assert report_count(out, "missing (fired slot, merchant unpaid)") == 0, out
    return slots
