"""The Django shop example, run as a newcomer runs it, in "break it" mode: a Django project
(``manage.py migrate`` alone creates every table), two beats, two prefork workers paying
merchants through the ORM, a relay (``manage.py reliable_beat relay``) and a webhook sink,
with beats and workers SIGKILLed and SIGSTOPped during the run. The example exits non-zero
when any merchant is paid twice or not at all for a fired slot, or a notification is lost.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow,
              pytest.mark.timeout(420)]


def _count(out: str, label: str) -> int:
    m = re.search(rf"\| {re.escape(label)} \| (\d+)", out)
    assert m, f"{label!r} missing from the report:\n{out}"
    return int(m.group(1))


@pytest.mark.full  # CI size: test_example_payouts.py's break-it; Django kills: test_django_orm.py
def test_django_shop_break_it_pays_each_merchant_once(
        tmp_path: Path, pg_url: str, redis_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "examples.django_shop", "--workdir", str(tmp_path / "shop"),
         "--database-url", pg_url, "--broker-url", redis_url, "--break-it",
         "--seconds", "35", "--seed", "3"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT: OK" in out and "faults injected" in out
    slots = _count(out, "slots fired")
    assert slots >= 2
    assert _count(out, "merchant/slot pairs paid exactly once") == 3 * slots
    assert _count(out, "paid twice") == 0
    assert _count(out, "missing (fired slot, merchant unpaid)") == 0
    assert _count(out, "ledger balance (must be 0)") == 0
