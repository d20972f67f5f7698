"""The fault harness's ``--old-code`` machinery (:mod:`harness.oldcode`, :class:`Procs`) with
real subprocesses, in seconds: which ``reliable_beat`` a start imports, how the starts
alternate, and the refusals at start (a revision git cannot find, an old tree without an API
the app uses). The whole run on old and new code is documented in ``docs/reliability.md``;
``tests/integration/test_rolling_deploy.py`` rolls real beats across two revisions.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from harness.faults import Procs, _parse, main
from harness.oldcode import ROOT, OldCode, OldCodeError, extract, probe

PRINT_PACKAGE = [sys.executable, "-c",
                 "import reliable_beat, sys; print('package', reliable_beat.__file__)"]


def _fake_old_tree(tmp_path: Path) -> OldCode:
    """An "old revision" whose reliable_beat has an ``errors`` module without
    ``PermanentDeliveryError`` (which the harness's app imports)."""
    tree = tmp_path / "old"
    (tree / "reliable_beat").mkdir(parents=True)
    (tree / "reliable_beat" / "__init__.py").write_text("")
    (tree / "reliable_beat" / "errors.py").write_text(
        "class PermanentError(Exception):\n    pass\n")
    return OldCode(rev="old", sha="0" * 40, tree=tree)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _package_lines(log: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines()
            if line.startswith("package ")]


def test_each_start_imports_the_code_it_was_given(tmp_path: Path) -> None:
    old = _fake_old_tree(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = Procs(_env(), logs, old=old)
    procs.start("beat0", PRINT_PACKAGE)
    procs.start("beat1", PRINT_PACKAGE)
    for name in ("beat0", "beat1"):
        procs.procs[name].wait(60)
    for _ in range(8):  # restarts: drawn from the rng
        procs.start("beat0")
        procs.procs["beat0"].wait(60)
    assert _package_lines(logs / "beat1.log") == [str(ROOT / "reliable_beat" / "__init__.py")]
    # the log of beat0: one header per start naming the code, then the package it imported
    text = (logs / "beat0.log").read_text().splitlines()
    headers = [line for line in text if line.startswith("--- harness: beat0 started on ")]
    packages = _package_lines(logs / "beat0.log")
    assert len(headers) == len(packages) == 9
    assert headers[0] == "--- harness: beat0 started on old code old (0000000000) ---"
    for header, package in zip(headers, packages, strict=True):
        want = old.tree if "old code" in header else ROOT
        assert package == str(want / "reliable_beat" / "__init__.py"), (header, package)
    starts = procs.starts
    assert starts[("beat", "old")] + starts[("beat", "new")] == 10
    assert starts[("beat", "old")] >= 2 and starts[("beat", "new")] >= 2, starts


def test_probe_names_what_the_old_code_lacks(tmp_path: Path) -> None:
    old = _fake_old_tree(tmp_path)
    with pytest.raises(OldCodeError) as caught:
        probe(old, _env(), ["harness.faultcore"], [], "the harness's celery app")
    message = str(caught.value)
    assert "old code old (0000000000) cannot run the harness's celery app" in message
    assert "cannot import name 'PermanentDeliveryError' from 'reliable_beat.errors'" in message


def test_probe_passes_the_current_tree(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH")
    try:
        old = extract("HEAD", tmp_path / "old")
    except OldCodeError as exc:
        pytest.skip(str(exc))
    probe(old, _env(), ["harness.faultcore", "reliable_beat.errors:PermanentDeliveryError"],
          [], "the harness's app")


def test_a_revision_git_cannot_find_ends_the_run_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH")
    code = main(["--old-code", "no-such-revision-x9", "--workdir", str(tmp_path / "w")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--old-code no-such-revision-x9: revision 'no-such-revision-x9' is not a commit" in err


def test_old_code_with_compare_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--old-code", "HEAD~1", "--compare", "stock"])
    assert "--old-code" in capsys.readouterr().err
