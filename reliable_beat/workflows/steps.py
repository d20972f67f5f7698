"""Inline steps: ``ctx.transaction``, ``ctx.step`` and the recorded clock ``ctx.now``.

* ``ctx.transaction(fn, *a)``: ``fn(conn, *a)`` runs inline inside the transaction that
  records it, fenced: **exactly once** for what ``fn`` writes through ``conn``.
* ``ctx.step(fn, *a)``: runs inline, then checkpoints its result: **at least once** (a crash
  between the body and the checkpoint runs it again); pass ``ctx.step_key`` to the far end.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import OperationalError

from reliable_beat import joins
from reliable_beat.outbox import db_now
from reliable_beat.values import from_json_value
from reliable_beat.workflow_store import activity_key
from reliable_beat.workflows import crashes, limits
from reliable_beat.workflows._runtime import Runtime
from reliable_beat.workflows.errors import ActivityError
from reliable_beat.workflows.history import error_json, outcome, to_json

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

__all__ = ["now", "step", "transaction"]

#: What a write on a framework connection inside ``ctx.transaction(fn)`` is told to do
#: instead (:mod:`reliable_beat.joins`): ``fn`` runs on the store's own connection.
_TRANSACTION_FIX = (
    "fn runs on the store's own connection (conn), not on Django's: write the effect "
    "through conn (SQLAlchemy), or in an activity whose body writes it in "
    "self.transaction() (it joins Django's connection when the store is a Django database)"
)


def callable_name(fn: Any, name: str | None) -> str:
    """``name``, or ``module.qualname`` of ``fn``: the name a step is recorded under."""
    if name:
        return name
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def transaction(rt: Runtime, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], name: str | None) -> Any:
    """See :meth:`WorkflowContext.transaction`."""
    step_name = callable_name(fn, name)
    call = to_json([list(args), kwargs], f"transaction {step_name!r} arguments")
    digest, recorded = rt.recorded_match("transaction", step_name, call)
    if not recorded:  # a replayed call was size-checked when it was recorded
        rt.check_size("transaction", step_name, call, f"transaction {step_name!r} arguments")
    seq, digest, ev = rt.next("transaction", step_name, call, digest=digest)
    if ev is not None:
        return outcome(ev.state, ev.result, ev.error, "transaction", step_name)

    def effect(conn: Connection) -> Any:
        rt.in_step = True
        try:
            with joins.guard(joins.registered(), None, where="ctx.transaction",
                             task_name=f"workflow {rt.definition.name}",
                             store=rt.store, fix=_TRANSACTION_FIX):
                value = fn(conn, *args, **kwargs)
            value = to_json(value, f"transaction {step_name!r} result")
            limits.check_size(f"transaction {step_name!r} result", value)
            return value
        except OperationalError:
            raise  # the database, not the step (deadlock, connection): the advance retries
        except Exception as exc:
            raise _StepFailed(exc) from exc
        finally:
            rt.in_step = False

    try:
        return from_json_value(rt.record(seq, "transaction", step_name, digest, call,
                                         state="completed", effect=effect))
    except _StepFailed as failed:  # fn failed: its writes rolled back; record the failure
        exc = failed.exc
        err = error_json(exc)
        rt.record(seq, "transaction", step_name, digest, call, state="failed", error=err)
        raise ActivityError(err["type"], err["message"], kind="transaction",
                            name=step_name) from exc


def step(rt: Runtime, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
         name: str | None) -> Any:
    """See :meth:`WorkflowContext.step`."""
    step_name = callable_name(fn, name)
    call = to_json([list(args), kwargs], f"step {step_name!r} arguments")
    digest, recorded = rt.recorded_match("step", step_name, call)
    if not recorded:  # a replayed call was size-checked when it was recorded
        rt.check_size("step", step_name, call, f"step {step_name!r} arguments")
    seq, digest, ev = rt.next("step", step_name, call, digest=digest)
    if ev is not None:
        return outcome(ev.state, ev.result, ev.error, "step", step_name)
    rt.in_step = True
    rt.step_key = activity_key(rt.claimed.workflow_id, rt.claimed.run_no, seq)
    try:
        value = fn(*args, **kwargs)
        value = to_json(value, f"step {step_name!r} result")
        limits.check_size(f"step {step_name!r} result", value)
    except Exception as exc:
        rt.in_step = False
        err = error_json(exc)
        rt.record(seq, "step", step_name, digest, call, state="failed", error=err)
        raise ActivityError(err["type"], err["message"], kind="step",
                            name=step_name) from exc
    finally:
        rt.in_step = False
        rt.step_key = None
    crashes.crash_point("step.after_body")
    return from_json_value(rt.record(seq, "step", step_name, digest, call,
                                     state="completed", result=value))


def now(rt: Runtime) -> datetime:
    """See :meth:`WorkflowContext.now`."""
    seq, digest, ev = rt.next("now", None, None)
    if ev is not None:
        return datetime.fromisoformat(str(ev.result))
    holder: dict[str, str] = {}

    def read(conn: Connection) -> str:
        holder["v"] = db_now(conn).isoformat()
        return holder["v"]

    value = rt.record(seq, "now", None, digest, None, state="completed", effect=read)
    return datetime.fromisoformat(str(value))


class _StepFailed(Exception):
    """The user's function raised inside ``ctx.transaction`` (not the engine)."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(str(exc))
        self.exc = exc
