"""The runtime tripwire: I/O from workflow code (not from steps) blocks the workflow.

A ``sys.addaudithook`` hook (installed once per process, permanent, a no-op unless the
current thread is running workflow code between durable calls) raises
:class:`NondeterministicCallError` for audit events that mean the workflow code talks to the
outside world directly: ``socket.connect``, ``socket.getaddrinfo``, ``subprocess.Popen``,
``os.system``, ``os.exec``, ``os.posix_spawn``, and ``open`` for writing. The advance then
blocks the workflow naming the call and the position.

What it cannot catch, stated plainly: reading files (imports read files too, so ``open``
for reading is let through), ``time.time()``, ``datetime.now()`` (a C type that cannot be
patched), ``random.random()`` (patching it would also trip the logging module), aliases
bound at import, environment variables, mutable globals, set iteration order across
``PYTHONHASHSEED``. The positional check catches their *effects* at replay; the docs say
what to use instead (``ctx.now()``, ``ctx.random()``, ``ctx.uuid4()``, sorted iteration).
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any

from reliable_beat.workflows.errors import WorkflowControl

__all__ = ["NondeterministicCallError", "in_workflow_code", "install"]

#: True while the current thread runs workflow code outside any durable call.
in_workflow_code: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "reliable_beat_in_workflow_code", default=False
)

_BLOCKED = {"socket.connect", "socket.getaddrinfo", "subprocess.Popen", "os.system",
            "os.exec", "os.posix_spawn", "os.spawn"}
_installed = False


class NondeterministicCallError(WorkflowControl):
    """Workflow code did I/O directly (move it into ``ctx.step`` or an activity)."""


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not in_workflow_code.get():
        return
    if event in _BLOCKED or (event == "open" and _writes(args)):
        in_workflow_code.set(False)  # the error's own formatting must not trip again
        raise NondeterministicCallError(
            f"{event}{_describe(args)} called from workflow code: anything that touches the "
            "outside world goes in ctx.step(...) or an activity"
        )


def _writes(args: tuple[Any, ...]) -> bool:
    mode = args[1] if len(args) > 1 else None
    return isinstance(mode, str) and any(c in mode for c in "wax+")


def _describe(args: tuple[Any, ...]) -> str:
    try:
        return "(" + ", ".join(repr(a)[:80] for a in args[:2]) + ")"
    except Exception:
        return "(...)"


def install() -> None:
    """Install the audit hook once per process (audit hooks cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
