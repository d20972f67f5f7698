"""Exceptions of the workflow engine.

::

    ReliableBeatError
    └── WorkflowError
        ├── WorkflowNotFound (LookupError)        no workflow with that id
        ├── WorkflowConflict (ValueError)         start(): the id names another workflow
        ├── WorkflowValueError (ValueError)       a duration or a value past its limit
        ├── WorkflowUsageError (RuntimeError)     a durable call where none is allowed
        ├── WorkflowFailed                        handle.result(): the workflow failed
        ├── WorkflowCancelled                     raised INTO workflow code: cancelled
        └── WorkflowBlockedError                  handle.result(): the workflow is blocked

    ActivityError (Exception)                     raised INTO workflow code: an activity,
                                                  step or transaction failed (replayable)

    BaseException
    └── WorkflowControl                           engine control flow; never catch it
        ├── Suspend                               the answer is not there yet
        ├── NonDeterminismError                   code and history disagree
        ├── FencedOut                             a newer advance owns the workflow
        ├── EndWorkflow                           end (or park) the workflow as given
        └── CodeTimeout                           the code ran past its deadline between
                                                  durable calls (raised by a watchdog)

Engine control flow derives from ``BaseException`` so ``except Exception:`` in workflow code
lets it through (Inngest's ``ResponseInterrupt``, Restate's ``SdkInternalBaseException``). A
bare ``except:`` that swallows it is detected: the workflow is then ``blocked``.
"""

from __future__ import annotations

from typing import Any

from reliable_beat.errors import ReliableBeatError

__all__ = [
    "ActivityError",
    "CodeTimeout",
    "EndWorkflow",
    "FencedOut",
    "NonDeterminismError",
    "Suspend",
    "WorkflowBlockedError",
    "WorkflowCancelled",
    "WorkflowConflict",
    "WorkflowControl",
    "WorkflowError",
    "WorkflowFailed",
    "WorkflowNotFound",
    "WorkflowUsageError",
    "WorkflowValueError",
]


class WorkflowError(ReliableBeatError):
    """Base of the workflow engine's errors raised to callers."""


class WorkflowNotFound(WorkflowError, LookupError):
    """No workflow with that workflow id."""


class WorkflowConflict(WorkflowError, ValueError):
    """``start`` with a workflow id that already names a workflow of another name."""


class WorkflowValueError(WorkflowError, ValueError):
    """A workflow call refused a value, before writing anything: a duration that is not a
    ``timedelta`` from 0 to ``MAX_TIMER`` (100 years), or a value (arguments, a signal's
    payload, a step's result) over the size limit as JSON
    (:data:`reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES`). The message names the
    argument and the limit (:mod:`reliable_beat.workflows.limits`)."""


class WorkflowUsageError(WorkflowError, RuntimeError):
    """A durable call where none is allowed: outside an advance, from another thread, or
    nested inside ``ctx.step`` / ``ctx.transaction``."""


class WorkflowFailed(WorkflowError):
    """``handle.result()``: the workflow ended ``failed`` (or ``cancelled``).

    Attributes:
        error: the recorded error, ``{"type", "message", "traceback"}``.
        state: ``failed`` or ``cancelled``.
    """

    def __init__(self, workflow_id: str, error: Any, state: str = "failed") -> None:
        self.error = error
        self.state = state
        err = error or {}
        super().__init__(
            f"workflow {workflow_id!r} {state}: {err.get('type')}: {err.get('message')}"
        )


class WorkflowBlockedError(WorkflowError):
    """``handle.result()``: the workflow is ``blocked`` and waits for a person
    (``reliable-beat workflows show ID``, then ``workflows resume ID``)."""


class ActivityError(Exception):
    """An activity, step or transaction of the workflow failed; raised into workflow code.

    The error is recorded as data (JSON), so a replay raises the same ``ActivityError``
    without running anything again. Match on :attr:`type` (the original exception class
    name), not on the class: ``except ActivityError as e: if e.type == "ValueError": ...``.

    Attributes:
        type: the original exception's class name (``"timeout"`` for a timed-out wait).
        message: its message.
        kind: ``activity``, ``step`` or ``transaction``.
        name: the activity task / step / transaction name.
    """

    def __init__(self, type: str, message: str, *, kind: str = "", name: str = "") -> None:
        self.type = type
        self.message = message
        self.kind = kind
        self.name = name
        super().__init__(f"{kind} {name} failed: {type}: {message}")


class WorkflowControl(BaseException):
    """Engine control flow: passes through ``except Exception:``; never catch it."""


class Suspend(WorkflowControl):
    """The answer a durable call needs is not there yet: the advance ends and holds nothing."""


class NonDeterminismError(WorkflowControl):
    """The code did something other than what the history records at a position."""


class FencedOut(WorkflowControl):
    """A newer advance claimed the workflow: this one writes nothing more."""


class WorkflowCancelled(WorkflowError):
    """Raised into workflow code at its next durable call after ``workflows cancel ID``.

    An ``Exception``: an open saga (``with ctx.saga()``) unwinds its compensations, then the
    workflow ends ``cancelled``. Code may catch it to clean up (more durable calls are
    fine); it is raised once per run.
    """


class EndWorkflow(WorkflowControl):
    """Engine control flow: end the advance by writing these workflow row values, fenced
    (e.g. ``state='blocked'`` with a ``block_reason`` when a compensation dead-letters)."""

    def __init__(self, message: str, **values: Any) -> None:
        super().__init__(message)
        self.values = values


class CodeTimeout(WorkflowControl):
    """The workflow code ran longer than ``reliable_beat_workflow_code_timeout_seconds``
    without a durable call: raised into the advance's thread by the watchdog
    (:mod:`reliable_beat.workflows.runaway`), and again at the code's next durable call if
    the code swallowed it. The advance parks the workflow ``blocked``."""
