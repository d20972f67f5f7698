"""``describe``: the five questions an operator asks of one entry's job, answered from its
configuration, its task class (asked of the app's adapter) and its recent runs.

The verb behind ``reliable-beat entries describe`` and the Django admin's and dashboard's
entry pages: can it run twice, can it overlap itself, what if the machine dies mid-run, can
it retry safely, is it idempotent.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from reliable_beat import schedules as sch
from reliable_beat.adapters import adapter_for, app_lease_seconds, app_settings
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import runs
from reliable_beat.errors import ConfigurationError
from reliable_beat.ops.actions import require_entry
from reliable_beat.settings import Settings
from reliable_beat.triggers import ACTIVE_RUN_STATES

__all__ = ["answer_questions", "describe", "task_kind"]


def task_kind(app: Any, task: str) -> str:
    """How a task is run: ``idempotent`` (an ``IdempotentTask`` of a Celery app, an
    ``IdempotentActor`` of a Dramatiq broker), ``plain``, or ``unknown``: asked of ``app``'s
    adapter (:meth:`reliable_beat.adapters.AppAdapter.task_kind`).

    ``unknown`` when no app is given or the app does not register ``task``.
    """
    if app is None:
        return "unknown"
    return adapter_for(app).task_kind(app, task)


def _answer(answer: str, why: str) -> dict[str, str]:
    return {"answer": answer, "why": why}


def _duration_stats(conn: Connection, name: str) -> tuple[int, float | None]:
    """(finished runs looked at, longest duration in seconds) over the last 100 runs."""
    recent = (
        select(runs.c.started_at, runs.c.finished_at)
        .where(runs.c.entry_name == name, runs.c.started_at.is_not(None),
               runs.c.finished_at.is_not(None))
        .order_by(runs.c.id.desc())
        .limit(100)
    )
    rows = conn.execute(recent).all()
    durations = [(f - s).total_seconds() for s, f in rows]
    return len(durations), (max(durations) if durations else None)


#: The words of :func:`answer_questions` per framework (None: no app given).
_WORDS: dict[str | None, dict[str, str]] = {
    "celery": {
        "idem": "IdempotentTask", "plain": "a plain Celery task", "tx": "self.transaction()",
        "outbox": "self.outbox", "make": "base=IdempotentTask",
        "dies_plain": "Celery decides: with the default (ack early) the message is gone and "
        "this slot's work is lost; with acks_late the message is redelivered and the body "
        "runs again from the start (partial effects of the first attempt stay).",
        "dies_idem": "the message is redelivered (acks_late, reject_on_worker_lost)",
        "retry_plain": "A Celery retry re-runs the whole body, and anything it did before "
        "failing happens again.",
    },
    "dramatiq": {
        "idem": "IdempotentActor", "plain": "a plain Dramatiq actor",
        "tx": "current().transaction()", "outbox": "current().outbox",
        "make": "actor_class=IdempotentActor",
        "dies_plain": "Dramatiq acks a message when the actor returns, so the message of a "
        "worker that dies mid-run is redelivered (Redis: after the heartbeat timeout; "
        "RabbitMQ: when its connection drops) and the body runs again from the start (partial "
        "effects of the first attempt stay).",
        "dies_idem": "the message is redelivered (Dramatiq acks when the actor returns)",
        "retry_plain": "Dramatiq's Retries middleware re-runs the whole body (max_retries, "
        "20 by default), and anything it did before failing happens again.",
    },
}
_WORDS[None] = {**_WORDS["celery"], "idem": "IdempotentTask (Celery) or IdempotentActor "
                "(Dramatiq)", "plain": "a plain task"}


def answer_questions(
    *,
    kind: str,
    overlap_policy: str,
    period_seconds: float | None,
    longest_run_seconds: float | None = None,
    finished_runs: int = 0,
    active_runs: int = 0,
    lease_seconds: float = 60.0,
    framework: str | None = None,
) -> dict[str, dict[str, str]]:
    """The five answers of :func:`describe`, from facts already read (pure, no I/O).

    Args:
        kind: ``idempotent``, ``plain`` or ``unknown`` (see :func:`task_kind`).
        overlap_policy: the entry's overlap policy.
        period_seconds: the schedule's nominal period in seconds (None for a one-off).
        longest_run_seconds: longest ``finished_at - started_at`` of recent runs, seconds.
        finished_runs: how many finished runs that figure was taken from.
        active_runs: runs of the entry now scheduled, dispatched, running or retrying.
        lease_seconds: the task's run lease in seconds.
        framework: the adapter name of the app the task kind was asked of (``celery``,
            ``dramatiq``; the answers use its words), None when no app was given (an
            ``unknown`` kind then says to give ``-A APP``; with an app it says the app does
            not register the task).

    Returns:
        ``{"run_twice" | "overlap" | "machine_dies" | "retry" | "idempotent":
        {"answer": str, "why": str}}``.
    """
    longest = longest_run_seconds
    period_s = period_seconds
    finished = finished_runs
    active = active_runs
    lease_s = lease_seconds
    policy = overlap_policy
    idem = kind == "idempotent"
    plain = kind == "plain"
    w = _WORDS.get(framework, _WORDS["celery"])
    if framework is None:
        unknown = "Task class unknown (give -A APP)"
    else:
        unknown = ("Task kind unknown: the -A app does not register this task (check the "
                   "name, or import the module that declares it)")

    # 1. Can it run twice?
    trig = (
        "The beat writes one run per slot (UNIQUE(entry, fire_at), claimed with SKIP LOCKED), "
        "so a slot is triggered once; but delivery is at-least-once (a worker crash or a "
        "publish not yet marked sent means a redelivery). "
    )
    if idem:
        run_twice = _answer("no", trig + f"The task is an {w['idem']}: a second delivery "
                            "finds the slot's key completed and returns the stored result "
                            "without running the body (recorded as 'deduplicated').")
    elif plain:
        run_twice = _answer("yes", trig + f"The task is {w['plain']}: a redelivered "
                            "trigger runs the body again. Its effects are at-least-once.")
    else:
        run_twice = _answer("depends", trig + f"{unknown}: an {w['idem']} runs once per "
                            "slot; a plain task may run twice.")

    # 2. Can it overlap?
    data = ""
    if longest is not None and period_s:
        ratio = longest / period_s
        data = (f" Data: the longest of the last {finished} finished runs took {longest:.1f} s "
                f"against a period of {period_s:.0f} s ({ratio:.0%}).")
        if ratio >= 0.8:
            data += " That is close to or beyond the period: runs will overlap under 'allow'."
    elif period_s is None:
        data = " One-off schedule: it cannot overlap itself."
    if policy == "allow":
        overlap = _answer(
            "yes", "overlap_policy='allow': a slot fires even while the previous run is still "
            "running." + data + (f" Set overlap_policy 'skip' or 'buffer_one' ({w['idem']} "
                                 "only) to prevent it." if not plain else
                                 " A plain task cannot use another policy (no run tracking)."))
    elif plain:
        overlap = _answer(
            "yes", f"overlap_policy={policy!r} needs run tracking, which a plain task does not "
            "keep, so the beat treats it as 'allow'." + data)
    else:
        what = ("the slot is recorded as skipped" if policy == "skip" else
                "one slot is held as 'buffered' and fired when the previous run ends; further "
                "slots are recorded as skipped")
        overlap = _answer(
            "no", f"overlap_policy={policy!r}: while a run of this entry is active "
            f"(scheduled/dispatched/running/retrying; {active} now), {what}." + data)

    # 3. What if the machine dies mid-run?
    if idem:
        dies = _answer(
            "finishes", f"The run's lease ({lease_s:.0f} s, renewed while it runs) expires; "
            f"{w['dies_idem']} and another worker "
            "claims the run with a higher fence token. Nothing the dead runner did commits "
            "(its effect and key were one transaction); a stale runner that wakes up is "
            "fenced out (StaleFenceToken). If the beat dies, another beat claims its entries.")
    elif plain:
        dies = _answer(
            "depends", w["dies_plain"] + " The slot itself is still recorded. If the beat "
            "dies, another beat claims its entries.")
    else:
        dies = _answer(
            "depends", f"{unknown}. {w['idem']}: the lease expires and another worker "
            "finishes the run under a new fence token. Plain task: lost (ack early) or re-run "
            "(acks late).")

    # 4. Can it retry safely?
    if idem:
        retry = _answer(
            "yes", "Transient errors retry with full-jitter exponential backoff up to "
            "max_attempts; each attempt's effect commits with the key or not at all, so a retry "
            f"never doubles what the task wrote through {w['tx']} / {w['outbox']}. "
            "Permanent errors and exhausted retries end in dead letters (reliable-beat "
            "dead-letters).")
    elif plain:
        retry = _answer(
            "no", w["retry_plain"] + f" Make it an {w['idem']} to retry safely.")
    else:
        retry = _answer("depends", f"{unknown}. Safe for an {w['idem']}; a plain task repeats "
                        "effects.")

    # 5. Is it idempotent?
    if idem:
        idempotent = _answer(
            "yes", f"Effectively once for what it writes through {w['tx']} and for "
            "outbox messages whose far end honours the message id. Side effects done directly "
            "in the body (an HTTP call) are not covered: move them to the outbox.")
    elif plain:
        idempotent = _answer(
            "no", "Plain task: one trigger per slot, but effects are only at-least-once. Use "
            f"{w['make']} to record the slot's key with the effect.")
    else:
        idempotent = _answer("unknown", "Give -A APP so the task class can be inspected."
                             if framework is None else unknown + ".")

    return {
        "run_twice": run_twice,
        "overlap": overlap,
        "machine_dies": dies,
        "retry": retry,
        "idempotent": idempotent,
    }


def describe(store: Store, app: Any, name: str) -> dict[str, Any]:
    """Answer the five questions an operator asks of one entry, from its configuration, its
    task class and its recent runs.

    The questions (keys of ``"questions"``): ``run_twice`` (can one slot's work run twice?),
    ``overlap`` (can a run overlap the previous one?), ``machine_dies`` (what if the machine
    dies mid-run?), ``retry`` (can it retry safely?), ``idempotent`` (is its effect
    idempotent?). Each answer is ``{"answer": "no" | "yes" | "depends" | ..., "why": str}``.

    Args:
        store: the store.
        app: the framework app that registers the entry's task (a Celery app, a Dramatiq
            broker: its adapter says the kind, :func:`task_kind`), or None (task kind
            ``unknown``: the answers then cover both cases).
        name: the entry name.

    Returns:
        ``{"entry", "task", "task_kind" ("idempotent" | "plain" | "unknown"),
        "task_kind_fix" (str for ``unknown``: what to do; else None), "framework" (the app's
        adapter name, ``celery`` / ``dramatiq``, None without an app), "schedule"
        (spec dict), "timezone", "misfire_policy", "overlap_policy", "period_seconds" (float |
        None), "longest_recent_run_seconds" (float | None), "questions": {...}}``.

    Raises:
        EntryNotFoundError: no such entry.
    """
    with store.engine.connect() as conn:
        row = require_entry(conn, name)
        finished, longest = _duration_stats(conn, name)
        active = conn.execute(
            select(func.count()).select_from(runs).where(
                runs.c.entry_name == name, runs.c.state.in_(ACTIVE_RUN_STATES)
            )
        ).scalar_one()
    kind = task_kind(app, row.task)
    try:
        period = sch.schedule_from_spec(row.schedule).nominal_period
    except ConfigurationError:
        period = None
    period_s = period.total_seconds() if period is not None else None
    lease_s: float | None = None
    framework = None
    if app is not None:
        framework = adapter_for(app).name
        if kind == "idempotent":
            lease_s = app_lease_seconds(app, row.task)
        if lease_s is None:
            try:
                lease_s = app_settings(app).lease_seconds
            except ConfigurationError:
                lease_s = None
    if lease_s is None:
        lease_s = Settings().lease_seconds
    if kind != "unknown":
        note = None
    elif framework is None:
        note = "no app given: pass -A APP (the app or broker module) to inspect the task class"
    else:
        note = (f"task {row.task!r} is not registered in the -A app ({framework}): check the "
                "name, or import the module that declares it in the app's module")
    return {
        "entry": name,
        "task": row.task,
        "task_kind": kind,
        "task_kind_fix": note,
        "framework": framework,
        "schedule": row.schedule,
        "timezone": row.timezone,
        "misfire_policy": row.misfire_policy,
        "overlap_policy": row.overlap_policy,
        "period_seconds": period_s,
        "longest_recent_run_seconds": longest,
        "questions": answer_questions(
            kind=kind, overlap_policy=row.overlap_policy, period_seconds=period_s,
            longest_run_seconds=longest, finished_runs=finished, active_runs=active,
            lease_seconds=lease_s, framework=framework,
        ),
    }
