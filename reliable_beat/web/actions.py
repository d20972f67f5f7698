"""The dashboard's actions, each recorded in ``reliable_beat_operator_actions``.

The actions are the operator verbs the command line has, through the same core operations:
:func:`reliable_beat.entries.pause` / :func:`~reliable_beat.entries.resume`,
:func:`reliable_beat.ops.actions.trigger` / :func:`~reliable_beat.ops.actions.backfill`,
:func:`reliable_beat.ops.requeue.requeue` (a dead run sent again under the same key, a
dropped message sent again, a dead outbox row delivered again, as ``dead-letters requeue``)
and :func:`reliable_beat.runs.release_lease`. Every attempt is recorded, whether it was done,
refused (a viewer, a CSRF failure, a missing confirmation) or failed, with who, what, when
and from where (:func:`record`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from reliable_beat import entries as rb_entries
from reliable_beat import runs as rb_runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import operator_actions
from reliable_beat.errors import ReliableBeatError
from reliable_beat.ops import actions as ops_actions
from reliable_beat.ops import requeue as ops_requeue
from reliable_beat.redaction import get_logger, redact_text, redact_value
from reliable_beat.web.auth import Principal

__all__ = ["ACTIONS", "ActionError", "Outcome", "perform", "record"]

log = get_logger(__name__)

#: The header a requeued task carries its idempotency key in (as ``dead-letters requeue``).
KEY_HEADER = ops_actions.KEY_HEADER


class ActionError(Exception):
    """An action that could not be done; the message names why and the fix."""


@dataclass(frozen=True)
class Outcome:
    """How an action ended: ``ok`` | ``refused`` | ``failed``, and what to tell the person."""

    outcome: str
    message: str


def record(store: Store, who: Principal | None, action: str, target: str,
           detail: dict[str, Any], outcome: str, error: str | None,
           remote: str | None) -> None:
    """Write one audit row (its own short transaction)."""
    with store.begin() as conn:
        conn.execute(operator_actions.insert().values(
            at=store.now(conn), actor=(who.name if who else "anonymous")[:200],
            role=who.role if who else "-", action=action[:32], target=str(target)[:400],
            detail=redact_value(detail), outcome=outcome,
            error=redact_text(error)[:4000] if error else None,
            remote=(remote or "")[:64] or None))


def _parse_instant(value: str, what: str) -> datetime:
    try:
        at = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise ActionError(f"{what} {value!r}: expected ISO 8601, e.g. "
                          "2026-01-10T12:00:00Z") from exc
    if at.tzinfo is None:
        raise ActionError(f"{what} {value!r} has no time zone: add Z or +HH:MM")
    return at.astimezone(timezone.utc)


def _pause(store: Store, app: Any, form: dict[str, str], backfill_limit: int) -> str:
    rb_entries.pause(store, form["target"])
    return f"entry {form['target']!r} paused"


def _resume(store: Store, app: Any, form: dict[str, str], backfill_limit: int) -> str:
    rb_entries.resume(store, form["target"])
    return f"entry {form['target']!r} resumed"


def _trigger(store: Store, app: Any, form: dict[str, str], backfill_limit: int) -> str:
    key = ops_actions.trigger(store, form["target"], app=app)
    return f"entry {form['target']!r} triggered: run {key}"


def _backfill(store: Store, app: Any, form: dict[str, str], backfill_limit: int) -> str:
    start = _parse_instant(form.get("start", ""), "start")
    end = _parse_instant(form.get("end", ""), "end")
    done = ops_actions.backfill(store, form["target"], start, end, limit=backfill_limit, app=app)
    return (f"entry {form['target']!r} backfilled: {done.created} runs created, "
            f"{done.existing} slots already had one, {done.buffered} buffered")


def _requeue(store: Store, app: Any, form: dict[str, str], backfill_limit: int) -> str:
    try:
        dl_id = int(form["target"])
    except ValueError as exc:
        raise ActionError(f"dead letter id {form['target']!r} is not a number") from exc
    plan = ops_requeue.plan_requeue(store, dl_id)  # RequeueRefused: a ValueError
    problem = ops_requeue.app_problem(plan, app)
    if problem is not None:
        raise ActionError(f"{problem}; or start the dashboard with the app: "
                          "`reliable-beat -A APP dashboard`" if app is None else problem)
    try:
        return ops_requeue.requeue(store, plan, app=app, by=form["_who"],
                                   force=form.get("force") == "yes")
    except ops_actions.RequeueSendError as exc:
        raise ActionError(str(exc)) from exc


def _lease_clear(store: Store, app: Any, form: dict[str, str], backfill_limit: int) -> str:
    done = rb_runs.release_lease(store, form["target"], resend=form.get("resend") != "no")
    return (f"lease on {form['target']!r} cleared; fence token is now {done.fence_token} "
            f"({done.note})")


#: Action name -> (function, needs a confirmation field ``confirm=yes``).
ACTIONS: dict[str, tuple[Callable[[Store, Any, dict[str, str], int], str], bool]] = {
    "pause": (_pause, False),
    "resume": (_resume, False),
    "trigger": (_trigger, False),
    "backfill": (_backfill, False),
    "requeue": (_requeue, True),
    "lease_clear": (_lease_clear, True),
}


def perform(store: Store, app: Any, who: Principal, action: str, form: dict[str, str], *,
            backfill_limit: int, remote: str | None) -> Outcome:
    """Do ``action`` for ``who`` (already authenticated, CSRF checked) and record it.

    A viewer, an unknown action, a missing target or a missing confirmation is refused; a
    failure of the operation (no such entry, a dead letter whose effect committed, ...) is
    ``failed`` with its message. Both are recorded like a success.
    """
    target = (form.get("target") or "").strip()
    detail = {k: v for k, v in form.items() if k not in ("csrf", "target", "_who")}
    spec = ACTIONS.get(action)
    refused = (f"unknown action {action!r}" if spec is None
               else f"{who.name} is a {who.role}: only operators may act" if not who.can_act
               else "no target given" if not target
               else "not confirmed: tick the confirmation and submit again"
               if spec[1] and form.get("confirm") != "yes" else None)
    if refused is not None:
        record(store, who, action, target or "-", detail, "refused", refused, remote)
        return Outcome("refused", refused)
    assert spec is not None
    try:
        message = spec[0](store, app, {**form, "target": target, "_who": who.name},
                          backfill_limit)
    except (ActionError, ReliableBeatError, LookupError, ValueError) as exc:
        error = redact_text(str(exc))
        record(store, who, action, target, detail, "failed", error, remote)
        return Outcome("failed", error)
    record(store, who, action, target, detail, "ok", None, remote)
    log.info("dashboard: %s (%s) %s %s: %s", who.name, who.role, action, target, message)
    return Outcome("ok", redact_text(message))
