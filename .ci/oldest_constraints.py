"""Pin every dependency of reliable-beat to the lowest version pyproject.toml declares.

``python .ci/oldest_constraints.py`` prints a pip constraints file: one ``name==floor`` line
for each ``name>=floor`` requirement of ``[project].dependencies`` and of the runtime extras
(celery, postgres, redis, http, metrics). ``python .ci/oldest_constraints.py --pip-install ARGS``
runs ``pip install -c <that file> ARGS`` (tox's ``install_command`` of the ``oldest`` env), so
the floors tested are always the floors declared: nothing to keep in sync by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_EXTRAS = ("celery", "postgres", "redis", "http", "metrics")
_REQ = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def floors(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{normalised name: floor}`` for every runtime requirement that declares ``>=``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in RUNTIME_EXTRAS:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    found: dict[str, str] = {}
    for req in reqs:
        m = _REQ.match(req)
        if not m or (m.group(4) and "win32" in m.group(4)):
            continue
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        for spec in filter(None, (s.strip() for s in m.group(3).split(","))):
            if spec.startswith(">="):
                floor = spec[2:].strip()
                old = found.get(name)
                if old is None or _key(floor) > _key(old):
                    found[name] = floor
    return found


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def constraints() -> str:
    return "".join(f"{name}=={floor}\n" for name, floor in sorted(floors().items()))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pip-install"]:
        with tempfile.NamedTemporaryFile("w", suffix="-oldest.txt", delete=False) as fh:
            fh.write(constraints())
        try:
            cmd = [sys.executable, "-m", "pip", "install", "-c", fh.name, *argv[1:]]
            return subprocess.call(cmd)
        finally:
            os.unlink(fh.name)
    sys.stdout.write(constraints())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
