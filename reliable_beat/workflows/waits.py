"""Durable waits: timers (``ctx.sleep``, ``ctx.sleep_until``) and signals
(``ctx.wait_signal``).

A timer is its ``timer`` event plus an outbox wake delayed to its ``fire_at`` (the store's
clock), written in one fenced transaction; nothing holds a worker meanwhile. A signal is
consumed and recorded in one fenced transaction, so each signal is consumed by exactly one
wait; a wait with a timeout is a ``signal`` event with a ``fire_at`` and its own delayed wake.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update

from reliable_beat import rows, tracing
from reliable_beat.db.tables import workflow_signals
from reliable_beat.outbox import db_now
from reliable_beat.values import from_json_value
from reliable_beat.workflow_store import add_wake
from reliable_beat.workflows import limits
from reliable_beat.workflows._runtime import Event, Runtime
from reliable_beat.workflows.errors import WorkflowValueError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

__all__ = ["sleep", "sleep_until", "wait_signal"]


def sleep(rt: Runtime, duration: timedelta) -> None:
    """See :meth:`WorkflowContext.sleep`."""
    limits.check_duration("ctx.sleep duration", duration)
    _timer(rt, ["sleep", duration.total_seconds()], lambda now: now + duration)


def sleep_until(rt: Runtime, instant: datetime) -> None:
    """See :meth:`WorkflowContext.sleep_until`."""
    if not isinstance(instant, datetime) or instant.tzinfo is None:
        raise WorkflowValueError(
            f"ctx.sleep_until instant must be a tz-aware datetime, got {instant!r}; "
            "e.g. datetime(2030, 1, 1, tzinfo=timezone.utc)")
    _timer(rt, ["until", instant.isoformat()], lambda now: max(now, instant))


def _timer(rt: Runtime, args: Any, fire: Callable[[datetime], datetime]) -> None:
    seq, digest, ev = rt.next("timer", None, args)
    if ev is None:
        holder: dict[str, datetime] = {}

        def schedule(conn: Connection) -> None:
            now = db_now(conn)
            holder["fire_at"] = fire_at = fire(now)
            add_wake(conn, rt.claimed.workflow_id, rt.claimed.queue,
                     f"{rt.claimed.run_no}t{seq}", delay=fire_at - now)

        rt.record(seq, "timer", None, digest, args, state="scheduled", effect=schedule,
                  holder=holder)
        fire_at = holder["fire_at"]
        state = "scheduled"
    else:
        fire_at, state = ev.fire_at, ev.state
    if state != "scheduled":
        return
    with rt.store.connect() as conn:
        now = db_now(conn)
    if now < fire_at:
        raise rt.suspend(f"timer at seq {seq} fires at {fire_at.isoformat()}")
    with tracing.span("timer", attributes=tracing.attributes(seq=seq, outcome="fired")):
        rt.complete(seq, "completed")
    rt.history[seq] = Event(seq, "timer", None, digest, "completed", None, None, fire_at,
                            None)


def wait_signal(rt: Runtime, name: str, timeout: timedelta | None) -> Any:
    """See :meth:`WorkflowContext.wait_signal`."""
    if timeout is not None:
        limits.check_duration("ctx.wait_signal timeout", timeout)
    args = [name, None if timeout is None else timeout.total_seconds()]
    seq, digest, ev = rt.next("signal", name, args)
    if ev is not None and ev.state != "scheduled":
        return from_json_value(ev.result)
    if ev is None:
        holder: dict[str, Any] = {}

        def first(conn: Connection) -> Any:
            consumed = _consume(rt, conn, name, seq, holder)
            if consumed is not _NOTHING:
                holder["done"] = True
                return consumed
            if timeout is not None:
                now = db_now(conn)
                holder["fire_at"] = now + timeout
                add_wake(conn, rt.claimed.workflow_id, rt.claimed.queue,
                         f"{rt.claimed.run_no}t{seq}", delay=timeout)
            return None

        with tracing.span(f"receive signal {name}", attributes=tracing.attributes(
                seq=seq)) as s:
            result = rt.record(seq, "signal", name, digest, args, state="scheduled",
                               effect=first, holder=holder)
            _outcome(s, "consumed" if holder.get("done") else "waiting")
            tracing.add_link(s, holder.get("traceparent"))
        if holder.get("done"):
            rt.history[seq] = Event(seq, "signal", name, digest, "completed", result,
                                    None, None, None)
            return from_json_value(result)
        fire_at = holder.get("fire_at")
    else:
        fire_at = ev.fire_at
    # scheduled: a signal may have come since
    outcome: dict[str, Any] = {}

    def consume(conn: Connection) -> Any:
        value = _consume(rt, conn, name, seq, outcome)
        if value is not _NOTHING:
            outcome["done"] = "consumed"
            return value
        if fire_at is not None and db_now(conn) >= fire_at:
            outcome["done"] = "timed_out"
            return None
        raise _NotYet

    with rt.store.connect() as conn:
        pending = conn.execute(
            select(workflow_signals.c.id).where(
                workflow_signals.c.workflow_pk == rt.claimed.pk,
                workflow_signals.c.name == name,
                workflow_signals.c.consumed_seq.is_(None),
            ).limit(1)
        ).first()
        now = db_now(conn)
    if pending is None and (fire_at is None or now < fire_at):
        raise rt.suspend(f"waiting for signal {name!r} at seq {seq}")
    try:
        with tracing.span(f"receive signal {name}", attributes=tracing.attributes(seq=seq),
                          expected=(_NotYet,)) as s:
            result = rt.complete(seq, "completed", effect=consume)
            _outcome(s, outcome["done"])
            tracing.add_link(s, outcome.get("traceparent"))
    except _NotYet:
        raise rt.suspend(f"waiting for signal {name!r} at seq {seq}") from None
    rt.history[seq] = Event(seq, "signal", name, digest, "completed", result, None,
                            fire_at, None)
    return from_json_value(result)


def _consume(rt: Runtime, conn: Connection, name: str, seq: int,
             found: dict[str, Any]) -> Any:
    """Consume the oldest unconsumed signal ``name``: its payload (``_NOTHING``: none).
    ``found["traceparent"]``: the span that stored it, while tracing (the receive span's
    link; 0019_signaltrace, NULL for a signal stored untraced)."""
    sg = workflow_signals.c
    columns = [sg.id, sg.payload]
    if (tracing.tracer() is not None
            and not rows.missing_optional_columns(conn, workflow_signals)):
        columns.append(sg.traceparent)
    row = conn.execute(
        select(*columns)
        .where(workflow_signals.c.workflow_pk == rt.claimed.pk,
               workflow_signals.c.name == name,
               workflow_signals.c.consumed_seq.is_(None))
        .order_by(workflow_signals.c.id)
        .limit(1)
    ).first()
    if row is None:
        return _NOTHING
    done = conn.execute(
        update(workflow_signals)
        .where(workflow_signals.c.id == row.id, workflow_signals.c.consumed_seq.is_(None))
        .values(consumed_run_no=rt.claimed.run_no, consumed_seq=seq)
    ).rowcount
    if done != 1:  # pragma: no cover - only the fenced advance consumes
        return _NOTHING
    found["traceparent"] = row._mapping.get("traceparent")
    return row.payload


def _outcome(span: Any, outcome: str) -> None:
    """``reliable_beat.outcome`` of a ``receive signal`` span (None: tracing off)."""
    if span is not None:
        span.set_attribute(tracing.OUTCOME, outcome)


class _NotYet(Exception):
    """Nothing to consume yet (rolls the completion transaction back)."""


_NOTHING = object()
