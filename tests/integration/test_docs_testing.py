"""``docs/testing.md`` is executed: every fenced block whose first line is ``# file: NAME`` is
written to NAME (blocks with the same NAME are joined in order) and the result is run with
pytest in a subprocess, as a user would run it, with the plugin enabled the way the page
says (``addopts = -p reliable_beat.testing.pytest``). Once on SQLite (the default) and once
with ``--rb-database-url`` on PostgreSQL.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "testing.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall(PAGE.read_text())]


def write_files(directory: Path) -> dict[str, str]:
    files: dict[str, str] = {}
    for _, body in blocks():
        first, _, rest = body.partition("\n")
        m = re.fullmatch(r"# file: (\S+)", first.strip())
        if m:
            files[m.group(1)] = files.get(m.group(1), "") + rest + "\n"
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def run_page(tmp_path: Path, *args: str, write: bool = True) -> subprocess.CompletedProcess[str]:
    if write:
        files = write_files(tmp_path)
        assert {"pytest.ini", "shop_tasks.py", "test_shop.py"} <= set(files)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RELIABLE_BEAT_TEST_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_page_snippets_run_on_sqlite(tmp_path: Path) -> None:
    proc = run_page(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b11 passed\b", out), out


@pytest.mark.postgres
def test_page_snippets_run_on_postgresql(tmp_path: Path, postgres_server: str) -> None:
    proc = run_page(tmp_path, "--rb-database-url", postgres_server)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b11 passed\b", out), out


def test_page_snippet_fails_naming_the_question_on_a_broken_task(tmp_path: Path) -> None:
    """The page's own tests catch a bug put into its task: the effect written outside
    ``self.transaction()``."""
    write_files(tmp_path)
    tasks = tmp_path / "shop_tasks.py"
    text = tasks.read_text()
    broken = text.replace(
        "    with self.transaction() as tx:                      # effect + key commit together\n"
        "        tx.execute(insert(invoices).values(customer=customer, month=month))\n",
        "    with self.store.engine.begin() as conn:\n"
        "        conn.execute(insert(invoices).values(customer=customer, month=month))\n"
        "    with self.transaction() as tx:\n",
    )
    assert broken != text
    tasks.write_text(broken)
    proc = run_page(tmp_path, "-k", "dies_mid_run or retry_safely or stale_runner",
                    write=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert re.search(r"\b3 failed, 1 passed\b", out), out  # after_commit cannot see it
    assert "[what if the machine dies mid-run?]" in out
    assert "[can it retry safely?]" in out
    assert "[is a stale runner fenced out?]" in out


def test_tox_matrix_snippet_is_valid() -> None:
    ini = [body for lang, body in blocks() if lang == "ini" and body.startswith("[tox]")]
    assert len(ini) == 1
    parser = configparser.ConfigParser()
    parser.read_string(ini[0])
    assert parser["tox"]["envlist"].startswith("py{310")
    assert "celery53: celery>=5.3,<5.4" in parser["testenv"]["deps"]
