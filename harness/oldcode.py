"""Another revision's ``reliable_beat`` beside the current one: old and new code in one run.

A rolling deploy runs old and new beats, relays and workers on one database at once. The
fault harness (``python -m harness.faults --old-code REV``) and the rolling-deploy test
(``tests/integration/test_rolling_deploy.py``) prove that mix with real processes:

* :func:`extract` writes revision ``REV``'s ``reliable_beat`` package into a directory
  (``git archive REV reliable_beat | tar -x -C <dir>``, git run in this repository);
* :meth:`OldCode.env` puts that directory FIRST on a process's ``PYTHONPATH``, so the process
  imports the old ``reliable_beat`` while its app modules (``harness/faultapp*.py``,
  ``tests/apps/*``) still come from the current tree; start it with ``cwd`` =
  :attr:`OldCode.tree` too (``python -m`` and ``dramatiq`` put the working directory first
  on ``sys.path``, ahead of ``PYTHONPATH``; the current checkout's ``reliable_beat`` would
  win there). The editable install's finder comes after ``sys.path``, so it never wins.
* :func:`probe` runs the app's imports and commands (``--help``) on the old tree before the
  run, so an old revision that lacks an API the app uses fails at start, naming what is
  missing, instead of as processes that crash and restart for the whole run.

Not for applications.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ROOT", "OldCode", "OldCodeError", "extract", "probe", "revision"]

#: The repository the harness lives in (git runs here).
ROOT = Path(__file__).resolve().parents[1]
#: Seconds a probe command may take (a Celery app's import on a loaded 2-core machine).
PROBE_TIMEOUT = 120.0


class OldCodeError(RuntimeError):
    """The old revision is unavailable, or cannot run the app (the message says why)."""


@dataclass(frozen=True)
class OldCode:
    """Revision ``rev`` (commit ``sha``) of ``reliable_beat``, extracted into ``tree``."""

    rev: str
    sha: str
    tree: Path

    @property
    def label(self) -> str:
        """``rev`` and, unless ``rev`` is the commit id, the commit's short id:
        ``HEAD~3 (9259a59c1d)``."""
        return self.rev if self.sha.startswith(self.rev) else f"{self.rev} ({self.sha[:10]})"

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with :attr:`tree` first on ``PYTHONPATH`` (start the process in
        :attr:`tree` as well: see the module docstring)."""
        path = os.pathsep.join(filter(None, [str(self.tree), env.get("PYTHONPATH")]))
        return {**env, "PYTHONPATH": path}


def _git(*args: str, root: Path) -> subprocess.CompletedProcess[bytes]:
    git = shutil.which("git")
    if git is None:
        raise OldCodeError("git is not on PATH: it is needed to extract an old revision")
    return subprocess.run([git, "-C", str(root), *args], capture_output=True, check=False)


def revision(rev: str, root: Path = ROOT) -> str:
    """The full commit id of ``rev`` in the repository at ``root``.

    Raises:
        OldCodeError: no git, ``root`` is not a git checkout, or ``rev`` names no commit there
            (a shallow clone lacks older commits: ``git fetch --unshallow``).
    """
    inside = _git("rev-parse", "--is-inside-work-tree", root=root)
    if inside.returncode != 0:
        raise OldCodeError(f"{root} is not a git checkout: cannot extract revision {rev!r}")
    found = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", root=root)
    if found.returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository", root=root).stdout.strip()
        hint = (" (this clone is shallow: `git fetch --unshallow` brings the history)"
                if shallow == b"true" else "")
        raise OldCodeError(f"revision {rev!r} is not a commit of the repository at "
                           f"{root}{hint}")
    return found.stdout.decode().strip()


def extract(rev: str, dest: Path, root: Path = ROOT) -> OldCode:
    """Write revision ``rev``'s ``reliable_beat`` package into ``dest`` (created).

    Raises:
        OldCodeError: see :func:`revision`; or ``rev`` has no ``reliable_beat`` package.
    """
    sha = revision(rev, root)
    archive = _git("archive", "--format=tar", sha, "reliable_beat", root=root)
    if archive.returncode != 0:
        raise OldCodeError(f"revision {rev!r} ({sha[:10]}) has no reliable_beat package: "
                           f"{archive.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout,
                           capture_output=True, check=False)
    if untar.returncode != 0 or not (dest / "reliable_beat" / "__init__.py").is_file():
        raise OldCodeError(f"could not extract revision {rev!r}'s reliable_beat into {dest}: "
                           f"{untar.stderr.decode(errors='replace').strip()}")
    return OldCode(rev=rev, sha=sha, tree=dest)


#: Run by :func:`probe` in the old tree: imports each ``module`` / ``module:attribute``
#: given and checks that ``reliable_beat`` came from the old tree.
_PROBE = """
import importlib, sys
tree = sys.argv[1]
for spec in sys.argv[2:]:
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    if attr:
        getattr(obj, attr)
import reliable_beat
if not reliable_beat.__file__.startswith(tree):
    sys.exit(f"reliable_beat was imported from {reliable_beat.__file__}, not from {tree}")
"""


def _tail(out: bytes, lines: int = 6) -> str:
    text = out.decode(errors="replace").strip().splitlines()
    return "\n    ".join(text[-lines:])


def probe(old: OldCode, env: dict[str, str], imports: list[str],
          commands: list[list[str]], what: str) -> None:
    """Check, on the old tree, that ``imports`` (``module`` or ``module:attribute``) import
    and that each of ``commands`` accepts its options (run with ``--help`` appended: a
    click / Celery command parses every option first and names one it does not know).
    ``reliable_beat`` must come from the old tree. All run at once, each in a subprocess
    with ``env`` (:meth:`OldCode.env` is applied here) and ``cwd`` = :attr:`OldCode.tree`.

    Raises:
        OldCodeError: naming the import or command that failed and its error's last lines.
    """
    full = old.env(env)
    checks: list[tuple[str, list[str]]] = [
        (f"import {', '.join(imports)}",
         [sys.executable, "-c", _PROBE, str(old.tree), *imports])]
    checks += [(" ".join(c[c.index("-m") + 1:] if "-m" in c else c), [*c, "--help"])
               for c in commands]
    procs = [(label, subprocess.Popen(argv, cwd=old.tree, env=full, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
             for label, argv in checks]
    problems = []
    for label, p in procs:
        try:
            out, _ = p.communicate(timeout=PROBE_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            problems.append(f"{label}: no answer within {PROBE_TIMEOUT:.0f} s")
            continue
        if p.returncode != 0:
            problems.append(f"{label}: exit {p.returncode}:\n    {_tail(out)}")
    if problems:
        raise OldCodeError(
            f"old code {old.label} cannot run {what}; what is missing or refused:\n  - "
            + "\n  - ".join(problems))
