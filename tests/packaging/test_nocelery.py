"""Celery and kombu are an extra (``reliable-beat[celery]``): the core works without them.

A venv (``.venv-nocelery`` at the project root, built once and reused while
``pyproject.toml``'s core dependencies do not change) gets the package installed from this
checkout with ``pip install --no-deps -e .`` plus only ``[project].dependencies`` (no extra),
so neither Celery nor kombu is there. In it, :mod:`tests.packaging.nocelery_probe` imports
every core module, runs a core beat tick and a relay cycle on SQLite with an in-memory
handler, and reports ``sys.modules``: no ``celery``/``kombu`` (nor any adapter) may be loaded.
The ``reliable-beat`` command line runs there too, and ``-A`` names the missing extra (as
``reliable-beat dramatiq ...`` names the Dramatiq one: Dramatiq is not there either).

The first run builds the venv (about a minute with a warm pip cache). Runs in ``make test``;
``tox -e nocelery`` runs the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("RB_NOCELERY_VENV", ROOT / ".venv-nocelery"))
PROBE = Path(__file__).with_name("nocelery_probe.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _core_dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def _entry_points() -> dict[str, object]:
    """The console scripts and entry points: an editable install writes them at install time."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"scripts": project.get("scripts", {}),
            "entry-points": project.get("entry-points", {})}


def _python() -> Path:
    """The venv's python, (re)built when missing or when the core dependencies or the entry
    points changed."""
    deps = _core_dependencies()
    stamp = hashlib.sha256(json.dumps([sys.version, deps, _entry_points()], sort_keys=True)
                           .encode()).hexdigest()[:16]
    marker = VENV / f".nocelery-{stamp}"
    py = VENV / "bin" / "python"
    if marker.exists() and py.exists():
        return py
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # the core dependencies only (no extra), then the project itself without dependencies;
    # the build backend (setuptools) comes from the same pip cache
    subprocess.run([*pip, *deps, "setuptools>=77", "wheel"], check=True, timeout=600)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], check=True,
                   timeout=600)
    marker.touch()
    return py


@pytest.fixture(scope="module")
def nocelery_python() -> Path:
    py = _python()
    for top in ("celery", "kombu"):
        found = subprocess.run([str(py), "-c", f"import {top}"], capture_output=True)
        assert found.returncode != 0, f"{top} is installed in {VENV}: the proof needs it absent"
    return py


def test_core_imports_and_runs_without_celery(nocelery_python: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(nocelery_python), str(PROBE)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["framework_modules"] == [], report["framework_modules"]
    imported = set(report["imported"])
    # the whole core was walked: beat, loop, execution, relay, re-dispatch, CLI, store
    assert {"reliable_beat.beat", "reliable_beat.loop", "reliable_beat.execution",
            "reliable_beat.relay", "reliable_beat.redispatch", "reliable_beat.runtime",
            "reliable_beat.handlers", "reliable_beat.adapters", "reliable_beat.cli",
            "reliable_beat.cli.entries", "reliable_beat.db.dialects",
            "reliable_beat.workflows"} <= imported
    assert report["tick"] == 1  # the due slot was claimed and its trigger committed
    assert report["delivered"] == ["dramatiq", "memory"]  # trigger row + plain outbox row
    assert report["run_state"] == "dispatched"  # the relay's mark_sent moved the run


def test_cli_runs_without_celery_and_names_the_extra(nocelery_python: Path,
                                                     tmp_path: Path) -> None:
    cli = nocelery_python.parent / "reliable-beat"
    env = {**os.environ, "RELIABLE_BEAT_DATABASE_URL": f"sqlite:///{tmp_path / 'rb.sqlite3'}"}
    env.pop("RELIABLE_BEAT_APP", None)
    up = subprocess.run([str(cli), "db", "upgrade"], capture_output=True, text=True,
                        cwd=tmp_path, env=env, timeout=120)
    assert up.returncode == 0, up.stderr
    listed = subprocess.run([str(cli), "entries", "list", "--json"], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    with_app = subprocess.run([str(cli), "-A", "proj", "status"], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)
    assert with_app.returncode == 1
    assert "reliable-beat[celery]" in with_app.stderr, with_app.stderr
    assert "Traceback" not in with_app.stderr
    # the Dramatiq adapter's commands (entry point group reliable_beat.cli) without Dramatiq:
    # listed as unavailable, and running them is one error naming the extra
    helped = subprocess.run([str(cli), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert any(line.split()[:1] == ["dramatiq"] and "unavailable" in line
               for line in helped.stdout.splitlines()), helped.stdout
    dq = subprocess.run([str(cli), "dramatiq", "beat", "--broker", "proj.broker"],
                        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert dq.returncode == 2, dq.stdout + dq.stderr
    assert "entry point dramatiq = 'reliable_beat.dramatiq.cli:group'" in dq.stderr, dq.stderr
    assert "pip install 'reliable-beat[dramatiq]'" in dq.stderr, dq.stderr
    assert "Traceback" not in dq.stderr
