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

from reliable_beat.workflows._runtime import Event, Runtime
from reliable_beat.workflows.registry import parse_version, version_block_reason

__all__ = ["deprecate_patch", "parse_version", "patched", "version_block_reason"]

PATCH_KIND = "patch"
def _check_id(patch_id: str) -> None:
    if not isinstance(patch_id, str) or not (0 < len(patch_id) <= 255):
        raise ValueError(f"a patch id must be a string of 1..255 characters, got {patch_id!r}")


def _marker_next(rt: Runtime, patch_id: str) -> bool | None:
    """True: the next recorded event is this patch's marker; False: another event; None:
    the next position is the frontier."""
    nxt = rt.history.get(rt.seq + 1)
    if nxt is None:
        return None
    return bool(nxt.kind == PATCH_KIND and nxt.name == patch_id)


def patched(rt: Runtime, patch_id: str) -> bool:
    """See :meth:`WorkflowContext.patched` and the module's truth table."""
    _check_id(patch_id)
    rt.check_caller(f"ctx.patched({patch_id!r})")
    memo = rt.patches
    if patch_id in memo:
        return memo[patch_id]
    marker = _marker_next(rt, patch_id)
    if marker is False:
        value = False  # a run that passed this point before the change: the old path
    elif marker is True:
        rt.next(PATCH_KIND, patch_id, None)  # consume the recorded marker
        value = True
    else:  # the frontier (or a dry-run replay stops here)
        seq, digest, _ = rt.next(PATCH_KIND, patch_id, None)
        rt.record(seq, PATCH_KIND, patch_id, digest, None, state="completed")
        rt.history[seq] = Event(seq, PATCH_KIND, patch_id, digest, "completed", None, None,
                                None, None)
        value = True
    memo[patch_id] = value
    return value


def deprecate_patch(rt: Runtime, patch_id: str) -> None:
    """See :meth:`WorkflowContext.deprecate_patch`."""
    _check_id(patch_id)
    rt.check_caller(f"ctx.deprecate_patch({patch_id!r})")
    if patch_id in rt.patches:
        return
    if _marker_next(rt, patch_id):
        rt.next(PATCH_KIND, patch_id, None)
    rt.patches[patch_id] = True
