"""Crash points: named places in the engine where tests kill the process.

The workflow tests crash an advance at each boundary of its protocol (docs/workflows.md lists
the points) and check that the next advance ends the run exactly as a crash-free one. In
process, ``crash_hook`` is called with each point's name (tests set it as
``reliable_beat.workflows.engine.crash_hook``, which forwards here); in a worker process,
``RB_WF_KILL_AT`` / ``RB_WF_KILL_FILE`` make it SIGKILL itself once at the named point.
"""

from __future__ import annotations

import os
import signal as _signal
from collections.abc import Callable

__all__ = ["crash_hook", "crash_point"]

#: Test seam: called with the name of each crash point (see :func:`crash_point`).
crash_hook: Callable[[str], None] | None = None
_kill_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """A named point where tests crash the process (docs/workflows.md lists them).

    ``crash_hook`` (in-process tests) is called with the name. With ``RB_WF_KILL_AT=name``
    (optionally ``name:n``, the n-th hit in this process) and ``RB_WF_KILL_FILE=path`` in the
    environment, the process SIGKILLs itself at that point once: the file records that the
    kill happened so the restarted process goes on.
    """
    if crash_hook is not None:
        crash_hook(name)
    spec = os.environ.get("RB_WF_KILL_AT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _kill_counts[name] = _kill_counts.get(name, 0) + 1
    if _kill_counts[name] != int(nth or 1):
        return
    marker = os.environ.get("RB_WF_KILL_FILE")
    if marker:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, name.encode())
        os.close(fd)
    os.kill(os.getpid(), _signal.SIGKILL)

