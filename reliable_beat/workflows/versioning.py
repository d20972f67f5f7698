"""Changing workflow code with runs in flight: ``ctx.patched``, ``ctx.deprecate_patch`` and the
``@workflow(version=..., min_supported_version=...)`` guard (docs/workflows.md, "Versioning").

``patched(id)`` follows Temporal's truth table (sdk-core ``patch_state_machine.rs``):

=========================================  ==========================  ========================
history at the next position               ``patched(id)``             ``deprecate_patch(id)``
=========================================  ==========================  ========================
none (the frontier: new code running)      records marker, True        records nothing
the marker ``patch id``                    consumes it, True           consumes it
another event (a run recorded before the   False (takes no position)   nothing (takes no
change reached this point)                                             position)
=========================================  ==========================  ========================

The answer is memoized per id for the run, so every later ``patched(id)`` agrees with the
first. The version guard is coarser: a run records the definition's ``version`` at start (and
at each continue-as-new); an advance whose code declares ``min_supported_version`` above it
parks the run ``blocked`` with the reason, writing nothing.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from reliable_beat.workflows.errors import WorkflowUsageError
from reliable_beat.workflows.registry import parse_version, version_block_reason

if TYPE_CHECKING:
    from reliable_beat.workflows.context import WorkflowContext

__all__ = ["deprecate_patch", "parse_version", "patched", "version_block_reason"]

PATCH_KIND = "patch"
def _check_caller(ctx: WorkflowContext, what: str) -> None:
    if ctx._pending is not None:
        raise ctx._pending
    if threading.get_ident() != ctx._thread:
        raise WorkflowUsageError(f"{what} must be called from the advance's thread")
    if ctx._in_step:
        raise WorkflowUsageError(f"{what} called inside ctx.step/ctx.transaction: durable "
                                 "calls cannot be nested")


def _check_id(patch_id: str) -> None:
    if not isinstance(patch_id, str) or not (0 < len(patch_id) <= 255):
        raise ValueError(f"a patch id must be a string of 1..255 characters, got {patch_id!r}")


def _marker_next(ctx: WorkflowContext, patch_id: str) -> bool | None:
    """True: the next recorded event is this patch's marker; False: another event; None:
    the next position is the frontier."""
    nxt = ctx._history.get(ctx._seq + 1)
    if nxt is None:
        return None
    return bool(nxt.kind == PATCH_KIND and nxt.name == patch_id)


def patched(ctx: WorkflowContext, patch_id: str) -> bool:
    """See :meth:`WorkflowContext.patched` and the module's truth table."""
    _check_id(patch_id)
    _check_caller(ctx, f"ctx.patched({patch_id!r})")
    memo = ctx._patches
    if patch_id in memo:
        return memo[patch_id]
    marker = _marker_next(ctx, patch_id)
    if marker is False:
        value = False  # a run that passed this point before the change: the old path
    elif marker is True:
        ctx._next(PATCH_KIND, patch_id, None)  # consume the recorded marker
        value = True
    else:  # the frontier (or a dry-run replay stops here)
        seq, digest, _ = ctx._next(PATCH_KIND, patch_id, None)
        ctx._record(seq, PATCH_KIND, patch_id, digest, None, state="completed")
        from reliable_beat.workflows.context import _Ev

        ctx._history[seq] = _Ev(seq, PATCH_KIND, patch_id, digest, "completed", None, None,
                                None, None)
        value = True
    memo[patch_id] = value
    return value


def deprecate_patch(ctx: WorkflowContext, patch_id: str) -> None:
    """See :meth:`WorkflowContext.deprecate_patch`."""
    _check_id(patch_id)
    _check_caller(ctx, f"ctx.deprecate_patch({patch_id!r})")
    if patch_id in ctx._patches:
        return
    if _marker_next(ctx, patch_id):
        ctx._next(PATCH_KIND, patch_id, None)
    ctx._patches[patch_id] = True
