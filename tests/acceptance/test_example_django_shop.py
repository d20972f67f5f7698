"""The Django shop example, run as a newcomer runs it, in "break it" mode: a Django project
(``manage.py migrate`` alone creates every table), two beats, two prefork workers paying
merchants through the ORM, a relay (``manage.py reliable_beat relay``) and a webhook sink,
with beats and workers SIGKILLed and SIGSTOPped during the run. The example exits non-zero
when any merchant is paid twice or not at all for a fired slot, or a notification is lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.apps.demos import assert_each_merchant_paid_once, run_example
from tests.apps.demos import report_count as _count

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow,
              pytest.mark.timeout(420)]


@pytest.mark.full  # CI size: test_example_payouts.py's break-it; Django kills: test_django_orm.py
def test_django_shop_break_it_pays_each_merchant_once(
        tmp_path: Path, pg_url: str, redis_url: str) -> None:
    proc = run_example("examples.django_shop", tmp_path / "shop", "--database-url", pg_url,
                       "--broker-url", redis_url, "--break-it", "--seconds", "35",
                       "--seed", "3", timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT: OK" in out and "faults injected" in out
    assert_each_merchant_paid_once(out)
    assert _count(out, "ledger balance (must be 0)") == 0
