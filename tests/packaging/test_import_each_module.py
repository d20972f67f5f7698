"""Every module imports first in a fresh interpreter, and every public name stays importable.

An import cycle hidden behind the order in which the package root happens to import things
shows up only when a module is the first one imported (a worker that imports
``reliable_beat.relay`` before anything else, say). ``import_probe.py`` imports each module
first in a process that has imported none of ours.

``public_names.json`` is a snapshot of each module's ``__all__``: moving a name to another
module must keep it importable from where users imported it.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    out = subprocess.run(
        [sys.executable, str(HERE / "import_probe.py")],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    results = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(results) > 60, f"the probe found only {len(results)} modules"
    broken = {r["module"]: r["error"] for r in results if r["error"]}
    assert not broken, "modules that fail when imported first:\n" + "\n".join(
        f"{m}:\n{e}" for m, e in broken.items())
    unbound = {r["module"]: r["missing"] for r in results if r["missing"]}
    assert not unbound, f"names in __all__ that the module does not bind: {unbound}"


def test_every_public_name_of_the_snapshot_still_resolves() -> None:
    snapshot = json.loads((HERE / "public_names.json").read_text())
    missing = []
    for module_name, names in snapshot.items():
        module = importlib.import_module(module_name)
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    assert not missing, f"public names that no longer resolve where they were: {missing}"
