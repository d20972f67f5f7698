"""Runaway workflows: no workflow code holds a worker unboundedly without an alarm.

An advance runs user code in a worker (the workflow function, its steps and transactions).
Code that never returns would keep its worker, let its lease expire, and be handed by the
workflow sweep to the next worker, and the next, until every worker spins. Two guards, and
two alarms:

1. **The code deadline** (``reliable_beat_workflow_code_timeout_seconds``). The workflow
   function's own code between two durable calls is timed by a :class:`CodeClock`; one
   watchdog thread per process raises :class:`~reliable_beat.workflows.errors.CodeTimeout`
   *in the advancing thread* (``PyThreadState_SetAsyncExc``, as Dramatiq's ``TimeLimit``
   middleware does) when it runs past the deadline, and again every
   :data:`REFIRE_SECONDS` while it is still there (code that swallows it with a bare
   ``except:``), and the code's next durable call raises it too. The advance then parks the
   workflow ``blocked`` naming the position and the setting. Code still past its deadline
   after :data:`PARK_AFTER_FIRES` interruptions (swallowed in a loop, or waiting in a call
   that releases the GIL) is parked by the watchdog itself, fenced, while it runs
   (:func:`park_stuck`): the sweep hands it to no other worker. Python checks such an
   exception between bytecodes, so ``while True: pass`` is stopped; code blocked inside one C
   call (a regex that backtracks for ever, a lock wait, a socket read without a timeout) is
   not, until that call returns. The clock stops inside durable calls: a step's or a
   transaction's body is not counted (its guard is the lease and guard 2), and the
   exception is never raised inside engine code. Why not a signal or the framework's time
   limit: ``SIGALRM`` reaches only a process's main thread (Dramatiq actors and Celery's
   ``threads`` pool run elsewhere), Celery's soft time limit exists only in the prefork pool
   and its hard limit kills the process mid-transaction, and both bound the whole task
   (replay, steps and all), not the code between durable calls. Not armed under gevent or
   eventlet (the watchdog would be a greenlet that never runs while the code spins) nor on
   an interpreter without ``ctypes.pythonapi``: there guard 2 alone applies.

2. **The takeover count** (``reliable_beat_workflow_max_takeovers``, column ``takeovers``).
   A claim that takes over a ``running`` workflow whose lease expired counts one takeover;
   a claim of a released workflow (``pending`` / ``waiting``: the previous advance
   finished) starts again from 0. A ``running`` workflow whose lease expired after that
   many takeovers is parked ``blocked`` (fence bumped, so a stuck advance that returns at
   last writes nothing) by the claim that would have taken it over and by the sweep, which
   then re-sends nothing: whatever holds the code (stuck in C, a hung step, a worker killed
   each time), at most ``1 + max_takeovers`` workers ever run it.

Alarms (``reliable-beat status``, ``--check`` and the metrics): **WORKFLOW ADVANCES
EXPIRING**, ``running`` workflows whose advance's lease expired at least twice in a row
without the advance finishing (:func:`expiring_advances`); **WORKFLOWS NOT STARTED**,
``pending`` longer than ``reliable_beat_workflow_pending_alarm_seconds``
(:func:`late_pending`): their wake went out, no worker took it.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, or_, select, update
from sqlalchemy.engine import Connection

from reliable_beat.db.tables import workflows
from reliable_beat.redaction import get_logger
from reliable_beat.workflows.errors import CodeTimeout

__all__ = [
    "CODE_TIMEOUT_SETTING",
    "DEFAULT_CODE_TIMEOUT_SECONDS",
    "DEFAULT_MAX_TAKEOVERS",
    "DEFAULT_PENDING_ALARM_SECONDS",
    "MAX_TAKEOVERS_SETTING",
    "PARK_AFTER_FIRES",
    "PENDING_ALARM_SETTING",
    "CodeClock",
    "code_timeout_reason",
    "expiring_advances",
    "late_pending",
    "may_take_over",
    "park_expired",
    "park_stuck",
    "problems",
    "stuck_reason",
    "takeovers_after_claim",
]

log = get_logger("reliable_beat.workflows")

#: Defaults of the settings (:class:`reliable_beat.settings.Settings` holds the same).
DEFAULT_CODE_TIMEOUT_SECONDS = 30.0
DEFAULT_MAX_TAKEOVERS = 3
DEFAULT_PENDING_ALARM_SECONDS = 300.0
CODE_TIMEOUT_SETTING = "reliable_beat_workflow_code_timeout_seconds"
MAX_TAKEOVERS_SETTING = "reliable_beat_workflow_max_takeovers"
PENDING_ALARM_SETTING = "reliable_beat_workflow_pending_alarm_seconds"
#: While the code is still past its deadline (it swallowed the exception), raise it again
#: this often.
REFIRE_SECONDS = 1.0
#: The watchdog looks at paused clocks (inside a durable call) at least this often.
POLL_SECONDS = 0.25
#: Interruptions after which code still past its deadline (it swallows them, or it is stuck
#: in a C call that releases the GIL: a sleep, a lock or socket wait) is parked by the
#: watchdog itself, fenced, without waiting for its lease to expire: the sweep then re-sends
#: nothing and no other worker is taken, whatever the size of the pool.
PARK_AFTER_FIRES = 3

# ------------------------------------------------------------------ the code deadline ----


def _set_async_exc(thread_id: int, exc: Any) -> int:
    """``PyThreadState_SetAsyncExc``: make ``exc`` (a class; None clears) pending in the
    thread; raised there at its next bytecode boundary. Returns how many threads matched."""
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exc is None else ctypes.py_object(exc)))


def _unsupported() -> str | None:
    """Why the watchdog cannot interrupt code here, or None."""
    if not hasattr(ctypes, "pythonapi") or sys.implementation.name != "cpython":
        return f"{sys.implementation.name} has no PyThreadState_SetAsyncExc"
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return "gevent monkey-patched threading"
    eventlet = sys.modules.get("eventlet.patcher")
    if eventlet is not None and eventlet.is_monkey_patched("thread"):
        return "eventlet monkey-patched threading"
    return None


_warned: set[str] = set()


class CodeClock:
    """Times one advance's workflow code between durable calls (see the module docstring).

    ``start`` / ``disarm`` bracket the run of the workflow function; ``pause`` / ``resume``
    bracket each durable call (nested calls: ``resume`` with what ``pause`` returned). All
    four run in the advance's thread; the watchdog thread reads the clock under its lock,
    so it never raises once the code entered a durable call.

    Args:
        timeout: seconds the code may run between durable calls; None: never interrupted
            (offline replay, or a caller that opts out).
        label: what the watchdog's log lines name (the workflow id).
        on_stuck: called once, in the watchdog's thread, with the seconds the code has run
            when it is still past its deadline after :data:`PARK_AFTER_FIRES` interruptions
            (the advance parks its workflow there: :func:`park_stuck`); None: nothing.
    """

    def __init__(self, timeout: float | None, label: str = "",
                 on_stuck: Callable[[float], None] | None = None) -> None:
        self.timeout = timeout
        self.label = label
        self.on_stuck = on_stuck
        self._stuck_reported = False
        self._lock = threading.Lock()
        self._thread = 0  # the advance's thread while armed, else 0
        self._in_code = False
        self._since = 0.0
        self._fired_at = 0.0
        #: how many times the watchdog raised into the code (0: the deadline never passed)
        self.fired = 0
        #: seconds the code had run without a durable call when the deadline first fired
        self.ran = 0.0

    def start(self) -> None:
        """The workflow function starts (in this thread)."""
        if self.timeout is None:
            return
        why = _unsupported()
        if why is not None:
            if why not in _warned:
                _warned.add(why)
                log.warning("workflow code is not interrupted at %s here (%s): a runaway "
                            "advance is parked only after %s takeovers", CODE_TIMEOUT_SETTING,
                            why, MAX_TAKEOVERS_SETTING)
            return
        with self._lock:
            self._thread = threading.get_ident()
            self._in_code, self._since = True, time.monotonic()
        _watchdog.add(self)

    def disarm(self) -> None:
        """The workflow function returned or raised: no raise from now on, and one still
        pending is dropped (it would land in the engine's code). Idempotent; call it in a
        ``finally``: a raise that lands in this very call before it took the lock is
        absorbed and it tries again (the only place the engine meets one)."""
        while self._thread:
            try:
                with self._lock:
                    self._in_code = False
                    if self.fired:
                        _set_async_exc(self._thread, None)
                    self._thread = 0
            except CodeTimeout:
                continue
        _watchdog.remove(self)

    def pause(self) -> bool:
        """A durable call begins. Returns whether the clock was running (for
        :meth:`resume`).

        Raises:
            CodeTimeout: the deadline passed and the code swallowed the exception: it
                gets no further (the clock keeps running, so the watchdog raises again).
        """
        if not self._thread:
            return False
        with self._lock:
            if self.fired and self._in_code:
                _set_async_exc(self._thread, None)  # raised here instead, synchronously
                raise CodeTimeout()
            was, self._in_code = self._in_code, False
        return was

    def resume(self, was: bool) -> None:
        """A durable call returned: the code runs again, with a fresh deadline."""
        if was and self._thread:
            with self._lock:
                if self._thread:
                    self._in_code, self._since = True, time.monotonic()

    def check(self, now: float) -> float:
        """Watchdog side: raise into the code if it is past its deadline. Returns the
        seconds until this clock needs a look again."""
        with self._lock:
            if not self._in_code or self.timeout is None:
                return POLL_SECONDS
            due = self._fired_at + REFIRE_SECONDS if self.fired else self._since + self.timeout
            if now < due:
                return due - now
            if not self.fired:
                self.ran = now - self._since
                log.warning("workflow %s: its code ran %.1f s without a durable call, past "
                            "%s=%g: interrupting it", self.label, self.ran,
                            CODE_TIMEOUT_SETTING, self.timeout)
            elif self.fired == 1:
                log.error("workflow %s: its code swallowed the interruption (a bare `except:`"
                          " or `except BaseException:`), or is stuck in a call that does not "
                          "return, and runs on; raising it every %g s, and parking the "
                          "workflow after %d tries", self.label, REFIRE_SECONDS,
                          PARK_AFTER_FIRES)
            self.fired += 1
            self._fired_at = now
            if _set_async_exc(self._thread, CodeTimeout) != 1:  # the thread is gone
                self._in_code = False
            stuck = (self.fired >= PARK_AFTER_FIRES and self._in_code
                     and not self._stuck_reported and self.on_stuck is not None)
            if stuck:
                self._stuck_reported = True
            ran = now - self._since
        if stuck:
            assert self.on_stuck is not None
            self.on_stuck(ran)  # outside the lock: it writes to the store
        return REFIRE_SECONDS


class _Watchdog:
    """One daemon thread per process over the armed clocks; started at the first advance
    (after a fork, in the child: see ``register_at_fork`` below)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._clocks: set[CodeClock] = set()
        self._thread: threading.Thread | None = None

    def add(self, clock: CodeClock) -> None:
        with self._cond:
            self._clocks.add(clock)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="rb-workflow-watchdog")
                self._thread.start()
            self._cond.notify()

    def remove(self, clock: CodeClock) -> None:
        with self._cond:
            self._clocks.discard(clock)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._clocks:
                    self._cond.wait()
                clocks = list(self._clocks)
            now = time.monotonic()
            wait = POLL_SECONDS
            for clock in clocks:
                try:
                    wait = min(wait, clock.check(now))
                except Exception:  # never let the watchdog die: log, and look again later
                    log.exception("workflow watchdog: checking a code clock failed")
            with self._cond:
                self._cond.wait(max(wait, 0.005))

    def reset_after_fork(self) -> None:
        self._cond = threading.Condition()
        self._clocks = set()
        self._thread = None


_watchdog = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_watchdog.reset_after_fork)


def code_timeout_reason(workflow_id: str, seq: int, ran: float, timeout: float) -> str:
    """The ``block_reason`` of a workflow whose code ran past its deadline."""
    where = f"after seq {seq}" if seq else "from its start"
    return (
        f"code_timeout: the workflow code ran {ran:.1f} s {where} without reaching a durable "
        f"call (ctx.activity, ctx.step, ctx.sleep, ...), past {CODE_TIMEOUT_SETTING}="
        f"{timeout:g}: "
        "a loop that never reaches a durable call holds a worker. Fix the code (long "
        "computation goes in ctx.step or an activity, whose bodies the limit does not "
        f"count) or raise the setting, then `reliable-beat workflows resume {workflow_id}`"
    )


def stuck_reason(workflow_id: str, seq: int, ran: float, timeout: float) -> str:
    """The ``block_reason`` of a workflow whose code stayed past its deadline through
    :data:`PARK_AFTER_FIRES` interruptions (parked by the watchdog)."""
    where = f"after seq {seq}" if seq else "from its start"
    return (
        f"code_timeout: the workflow code ran {ran:.1f} s {where} without reaching a durable "
        f"call, past {CODE_TIMEOUT_SETTING}={timeout:g}, and went on through "
        f"{PARK_AFTER_FIRES} interruptions: it swallows them (a bare `except:` or `except "
        "BaseException:` in a loop) or is stuck in a call that never returns (a sleep, a "
        "lock or socket wait without a timeout). Parked so that no other worker takes it; "
        "the worker running it stays busy until the code returns or the worker is restarted "
        "(SIGTERM waits for the task: restart it with SIGKILL). Fix the code, then "
        f"`reliable-beat workflows resume {workflow_id}`"
    )


def park_stuck(conn: Connection, pk: int, workflow_id: str, fence_token: int, reason: str,
               now: datetime) -> bool:
    """Park the workflow ``pk`` ``blocked`` with ``reason`` if it is still ``running`` under
    ``fence_token`` (the stuck advance's claim), bumping the fence: the stuck advance writes
    nothing if it ever returns, and the sweep re-sends nothing. Joins the caller's
    transaction. Returns True when parked."""
    done = conn.execute(
        update(workflows)
        .where(workflows.c.id == pk, workflows.c.state == "running",
               workflows.c.fence_token == fence_token)
        .values(state="blocked", block_reason=reason[:4000], leased_by=None,
                lease_expires_at=None, fence_token=workflows.c.fence_token + 1,
                updated_at=now)
    ).rowcount
    if done == 1:
        log.error("workflow %s blocked: %s", workflow_id, reason)
    return bool(done == 1)


# ------------------------------------------------------------------ the takeover count ----


def may_take_over(max_takeovers: int | Any) -> Any:
    """SQL condition of a claim: a ``running`` row (its advance's lease expired) is taken
    over only while it has fewer than ``max_takeovers`` takeovers (a number, or a bound
    parameter of a statement built once)."""
    return or_(workflows.c.state != "running", workflows.c.takeovers < max_takeovers)


def takeovers_after_claim() -> Any:
    """SQL value of ``takeovers`` set by a claim: +1 over an expired ``running`` advance,
    0 over a released workflow (its last advance finished)."""
    return case((workflows.c.state == "running", workflows.c.takeovers + 1), else_=0)


def _takeover_reason(workflow_id: str, takeovers: int, leased_by: str | None,
                     max_takeovers: int) -> str:
    return (
        f"advance_expired: the advance's lease expired {takeovers + 1} times in a row "
        f"without the advance finishing (taken over {takeovers} times, last by "
        f"{leased_by or '?'}; {MAX_TAKEOVERS_SETTING}={max_takeovers}), so it is parked "
        "instead of handed to one more worker. Its code, a step or a transaction never "
        "returns (stuck in C code or a call without a timeout, which "
        f"{CODE_TIMEOUT_SETTING} cannot interrupt), or each advance kills its worker (out "
        "of memory?). Those advances may still hold their workers: see the workers' logs "
        "and restart them. Fix the code, then "
        f"`reliable-beat workflows resume {workflow_id}`"
    )


def park_expired(conn: Connection, row: Any, now: datetime, max_takeovers: int) -> bool:
    """Park ``row`` (a workflow row: ``id``, ``workflow_id``, ``fence_token``,
    ``takeovers``, ``leased_by``) ``blocked`` if it is still ``running`` with that fence,
    its lease expired before ``now`` and it has ``max_takeovers`` takeovers or more. Joins
    the caller's transaction. The fence token is bumped: the stuck advance writes nothing
    if it ever returns. Returns True when parked."""
    if int(row.takeovers) < max_takeovers:
        return False
    why = _takeover_reason(row.workflow_id, int(row.takeovers), row.leased_by, max_takeovers)
    done = conn.execute(
        update(workflows)
        .where(workflows.c.id == row.id, workflows.c.state == "running",
               workflows.c.fence_token == row.fence_token,
               workflows.c.lease_expires_at < now,
               workflows.c.takeovers >= max_takeovers)
        .values(state="blocked", block_reason=why[:4000], leased_by=None,
                lease_expires_at=None, fence_token=workflows.c.fence_token + 1,
                updated_at=now)
    ).rowcount
    if done == 1:
        log.error("workflow %s blocked: %s", row.workflow_id, why)
    return bool(done == 1)


# ------------------------------------------------------------------ alarms ----


def _expiring_where(now: datetime) -> Any:
    wf = workflows.c
    return and_(wf.state == "running",
                or_(wf.takeovers >= 2, and_(wf.takeovers >= 1, wf.lease_expires_at < now)))


def expiring_advances(conn: Connection, now: datetime, *, limit: int = 10
                      ) -> tuple[int, list[dict[str, Any]]]:
    """``running`` workflows whose advance's lease expired at least twice in a row without
    the advance finishing (taken over twice, or taken over and expired again). Returns
    ``(count, [{"workflow_id", "takeovers", "leased_by", "lease_expires_at"}])``, the
    list cut at ``limit``, most taken over first."""
    wf = workflows.c
    n = int(conn.execute(select(func.count()).select_from(workflows)
                         .where(_expiring_where(now))).scalar_one())
    rows = conn.execute(
        select(wf.workflow_id, wf.takeovers, wf.leased_by, wf.lease_expires_at)
        .where(_expiring_where(now)).order_by(wf.takeovers.desc(), wf.id).limit(limit)
    ).all() if n else []
    return n, [dict(r._mapping) for r in rows]


def late_pending(conn: Connection, now: datetime, *, after: timedelta, limit: int = 10
                 ) -> tuple[int, dict[str, int], list[str]]:
    """Workflows ``pending`` (no advance claimed them since their start or continue-as-new)
    for longer than ``after``. Returns ``(count, {queue: count}, [workflow ids, oldest
    first, at most limit])``; the queue of a workflow without one is ``"(default)"``."""
    wf = workflows.c
    where = and_(wf.state == "pending", wf.updated_at < now - after)
    by_queue = {("(default)" if q is None else str(q)): int(n) for q, n in conn.execute(
        select(wf.queue, func.count()).where(where).group_by(wf.queue)).all()}
    n = sum(by_queue.values())
    ids = list(conn.execute(select(wf.workflow_id).where(where).order_by(wf.updated_at)
                            .limit(limit)).scalars()) if n else []
    return n, by_queue, ids


def problems(expiring: tuple[int, list[dict[str, Any]]],
             pending: tuple[int, dict[str, int], list[str]], *, pending_after: timedelta,
             max_takeovers: int) -> list[str]:
    """The ``status`` alarms of :func:`expiring_advances` and :func:`late_pending`."""
    out = []
    n, rows = expiring
    if n:
        shown = ", ".join(f"{r['workflow_id']} (taken over {r['takeovers']} times, held by "
                          f"{r['leased_by'] or '?'})" for r in rows)
        out.append(
            f"WORKFLOW ADVANCES EXPIRING: {n} workflows' advances let their lease expire "
            f"again and again without finishing ({shown}{', ...' if n > len(rows) else ''}): "
            "the code, a step or a transaction never returns, or each advance kills its "
            f"worker. Each takeover holds one more worker; after {max_takeovers} "
            f"({MAX_TAKEOVERS_SETTING}) the workflow is parked blocked. See the workers' "
            "logs; `reliable-beat workflows show ID`"
        )
    n, by_queue, ids = pending
    if n:
        queues = ", ".join(f"{q}: {k}" for q, k in sorted(by_queue.items()))
        out.append(
            f"WORKFLOWS NOT STARTED: {n} workflows are pending more than "
            f"{pending_after.total_seconds():g} s ({PENDING_ALARM_SETTING}) by queue ({queues}"
            f"; {', '.join(ids)}{', ...' if n > len(ids) else ''}): no advance has claimed "
            "them. Their wake left the outbox but no worker took it: does a worker consume "
            "that queue (celery: `celery -A APP worker -Q QUEUE`), or are all workers busy "
            "(a backlog, runaway workflows)?"
        )
    return out
