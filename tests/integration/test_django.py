"""Runs ``tests/django`` (the admin, ``manage.py migrate`` and ``manage.py reliable_beat``)
in a child pytest configured as a Django project on a fresh real PostgreSQL database, on
psycopg 3 and on psycopg2. The child's output is shown when it fails. The admin's browser
screenshots go to ``$RB_SCREENSHOTS/<driver>/`` (CI: the artefacts folder), else a temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]
PROJ = ROOT / "tests" / "apps" / "djproj"
pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_django_suite(driver: str, pg_url: str, tmp_path: Path) -> None:
    if driver == "psycopg2":
        pytest.importorskip("psycopg2", reason="pip install psycopg2-binary")
    store_url = sa.engine.make_url(pg_url).set(
        drivername=f"postgresql+{driver}").render_as_string(hide_password=False)
    env = {**os.environ, "RB_DJANGO_INNER": "1", "DJANGO_SETTINGS_MODULE": "djsettings",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(PROJ), str(ROOT / "tests" / "apps")]),
           "RB_DATABASE_URL": pg_url, "RB_STORE_URL": store_url, "RB_DJANGO_DRIVER": driver,
           "RB_SCREENSHOTS": str(Path(os.environ.get("RB_SCREENSHOTS") or tmp_path / "shots")
                                 / driver)}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:hypothesispytest", "-p", "no:randomly",
         str(ROOT / "tests" / "django")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert res.returncode == 0, f"{res.stdout[-12000:]}\n{res.stderr[-4000:]}"
    print(res.stdout.strip().splitlines()[-1])
    assert " passed" in res.stdout and " failed" not in res.stdout
