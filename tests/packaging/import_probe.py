"""Import each module of reliable_beat first, in a process that has imported none of them.

Run as a script: forks once per module from a parent that has imported only the standard
library and the third-party packages (so a child's import order is the module's own), and
prints one JSON line per module: ``{"module", "error", "missing"}`` where ``missing`` lists
names of the module's ``__all__`` it does not bind.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pkgutil
import sys
import traceback

# Third-party packages first: the child's import of our module then costs only our code.
for name in ("sqlalchemy", "click", "croniter", "celery", "kombu", "dramatiq", "django"):
    with contextlib.suppress(ImportError):
        importlib.import_module(name)

#: Modules that need a configured Django project (they are imported by the Django tests).
NEEDS_DJANGO_SETUP = ("reliable_beat.contrib.django.",)


def modules() -> list[str]:
    spec = importlib.util.find_spec("reliable_beat")
    assert spec is not None and spec.submodule_search_locations
    names = ["reliable_beat"]
    for info in pkgutil.walk_packages(list(spec.submodule_search_locations), "reliable_beat."):
        if ".migrations." in info.name or info.name.endswith(".migrations"):
            continue
        names.append(info.name)
    return sorted(names)


def probe(name: str) -> dict[str, object]:
    try:
        module = importlib.import_module(name)
    except Exception:  # reported to the test
        return {"module": name, "error": traceback.format_exc(limit=3), "missing": []}
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    return {"module": name, "error": None, "missing": missing}


def main() -> None:
    assert not any(m == "reliable_beat" or m.startswith("reliable_beat.") for m in sys.modules)
    for name in modules():
        if name.startswith(NEEDS_DJANGO_SETUP):
            continue
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            line = json.dumps(probe(name)) + "\n"
            os.write(write, line.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            out = f.read()
        os.waitpid(pid, 0)
        died = json.dumps({"module": name, "error": "child died", "missing": []}) + "\n"
        sys.stdout.write(out or died)


if __name__ == "__main__":
    main()
