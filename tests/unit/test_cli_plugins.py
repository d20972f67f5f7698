"""Adapters' commands come in through the entry point group ``reliable_beat.cli``
(:func:`reliable_beat.cli.plugin_command`): a working one is mounted as ``reliable-beat NAME``,
a broken one gives one clear error naming it when run, and the rest of the command line
works. Real entry points: a ``*.dist-info`` directory on ``PYTHONPATH`` of a real
``python -m reliable_beat.cli`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reliable_beat.adapters import CLI_ENTRY_POINT_GROUP


@pytest.fixture
def plugins(tmp_path: Path) -> Path:
    """A fake distribution ``rbplugins`` declaring four ``reliable_beat.cli`` entry points:
    ``hello`` (a group that works), ``missing`` (a module that is not there), ``crashing``
    (a module that raises at import) and ``notacommand`` (an object that is no command)."""
    site = tmp_path / "site"
    dist = site / "rbplugins-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rbplugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{CLI_ENTRY_POINT_GROUP}]\n"
        "hello = rbplugins_ok:group\n"
        "missing = rbplugins_absent.cli:group\n"
        "crashing = rbplugins_crash:group\n"
        "notacommand = rbplugins_ok:NOT_A_COMMAND\n")
    (site / "rbplugins_ok.py").write_text(
        "import click\n"
        "NOT_A_COMMAND = 42\n"
        "@click.group('hello')\n"
        "def group():\n    'Say hello (a plugin).'\n"
        "@group.command('world')\n"
        "def world():\n    click.echo('hello from the plugin')\n")
    (site / "rbplugins_crash.py").write_text("raise RuntimeError('plugin bug at import')\n")
    return site


def _cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("RELIABLE_BEAT_APP", None)
    return subprocess.run([sys.executable, "-m", "reliable_beat.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_plugin_group_is_mounted_and_runs(plugins: Path) -> None:
    out = _cli(plugins, "hello", "world")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello from the plugin"


def test_help_lists_plugins_and_marks_broken_ones(plugins: Path) -> None:
    out = _cli(plugins, "--help")
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()
             if line.startswith("  ") and line.split()}
    assert "Say hello" in lines["hello"]
    assert "dramatiq" in lines  # the built-in adapter's entry point, as before
    for name in ("missing", "crashing", "notacommand"):
        assert "unavailable" in lines[name], out.stdout
    assert "db" in lines and "status" in lines


@pytest.mark.parametrize(("name", "target", "cause"), [
    ("missing", "rbplugins_absent.cli:group", "No module named 'rbplugins_absent'"),
    ("crashing", "rbplugins_crash:group", "RuntimeError: plugin bug at import"),
    ("notacommand", "rbplugins_ok:NOT_A_COMMAND", "int object, not a click command"),
])
def test_a_broken_plugin_is_one_clear_error_naming_it(plugins: Path, name: str, target: str,
                                                      cause: str) -> None:
    out = _cli(plugins, name, "sub", "--some-option", "x")
    assert out.returncode == 2, (out.stdout, out.stderr)
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"error: the {name!r} commands are unavailable: entry point "
                           f"{name} = {target!r} (group 'reliable_beat.cli')"), line
    assert cause in line, line
    assert "Traceback" not in out.stderr
    helped = _cli(plugins, name, "--help")  # --help of a broken plugin: the same error
    assert helped.returncode == 2 and cause in helped.stderr, helped.stderr
    as_json = _cli(plugins, name, "--json")
    assert json.loads(as_json.stderr)["error"]["kind"] == "usage"


def test_the_rest_of_the_cli_works_beside_broken_plugins(plugins: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rb.db'}"
    up = _cli(plugins, "--database-url", url, "db", "upgrade")
    assert up.returncode == 0, up.stderr
    listed = _cli(plugins, "--database-url", url, "entries", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    assert "unavailable" not in up.stderr + listed.stderr  # nothing loaded, nothing said


def test_status_imports_no_adapter(tmp_path: Path) -> None:
    """Adapters' commands load on use: ``reliable-beat`` with a core command imports no
    adapter package nor framework (``reliable-beat dramatiq`` alone imports Dramatiq)."""
    code = (
        "import sys, runpy\n"
        "sys.argv = ['reliable-beat', '--database-url', sys.argv[1], 'db', 'upgrade']\n"
        "try:\n    runpy.run_module('reliable_beat.cli', run_name='__main__')\n"
        "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('celery', 'kombu', 'dramatiq', 'django') or m.startswith(("
        "'reliable_beat.celery', 'reliable_beat.dramatiq', 'reliable_beat.contrib')))\n"
        "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code, f"sqlite:///{tmp_path / 'rb.db'}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
