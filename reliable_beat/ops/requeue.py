"""Requeue a dead letter: the one decision behind ``reliable-beat dead-letters requeue``,
``reliable-beat dramatiq dead-letters requeue``, the dashboard's and the Django admin's
requeue.

:func:`plan_requeue` reads a dead letter and says what a requeue would do and the question
to confirm (what the CLI asks before it acts), or refuses it with the reason and the fix
(:class:`RequeueRefused`); it needs no app. :func:`requeue` does it:

* ``outbox`` dead letter: its row goes back to ``pending`` (same message id); a relay
  delivers it. No app needed.
* ``message`` dead letter (a worker dropped the message): reason ``unregistered`` is sent
  again through the Celery app (same task id, arguments and headers); ``no_key`` and
  ``rejected`` are refused: the message itself was wrong, its caller must send the work again.
* ``run`` or ``message`` dead letter of a workflow activity (key ``wf:<id>/<run>#<seq>``):
  refused once the workflow's history has recorded the activity's outcome or the workflow
  ended (a re-run's effect would land outside its history, e.g. after its saga compensated
  or it was cancelled); allowed while the history still waits for that activity.
* ``run`` dead letter of a Celery task: the run again under the same idempotency key, through
  the Celery app (:func:`reliable_beat.ops.actions.requeue_dead_run`).
* ``run`` dead letter of a Dramatiq actor (its payload names the ``actor``): the same, through
  the Dramatiq broker (the Dramatiq adapter's ``requeue_dead_run``).

Nothing is ever requeued automatically; every requeue records who decided (``by``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reliable_beat import runs as rb_runs
from reliable_beat.adapters import adapter_for
from reliable_beat.db.dialects import Store
from reliable_beat.errors import ReliableBeatError
from reliable_beat.ops import actions as ops_actions
from reliable_beat.workflow_store import parse_activity_key
from reliable_beat.workflows.errors import WorkflowNotFound
from reliable_beat.workflows.history import TERMINAL_STATES
from reliable_beat.workflows.queries import get_workflow

__all__ = ["RequeuePlan", "RequeueRefused", "app_problem", "plan_requeue", "requeue"]

#: What a requeue sends through: nothing (an outbox row), a Celery app, a Dramatiq broker.
CELERY = "celery"
DRAMATIQ = "dramatiq"


class RequeueRefused(ReliableBeatError, ValueError):
    """This dead letter cannot be requeued (here, or at all); the message says why and what
    to do instead. Nothing changed."""


@dataclass(frozen=True)
class RequeuePlan:
    """What requeueing one dead letter would do.

    Attributes:
        dead_letter: the dead letter (:func:`reliable_beat.runs.get_dead_letter`).
        what: ``outbox`` | ``message`` | ``run`` | ``actor_run``.
        needs: None, ``celery`` (a Celery app sends it) or ``dramatiq`` (a Dramatiq broker).
        question: the confirmation to ask (the CLI's prompt), ending in ``?``.
        payload: what is sent (a run's: checked, or rebuilt from a repaired run row).
    """

    dead_letter: dict[str, Any]
    what: str
    needs: str | None
    question: str
    payload: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> int:
        return int(self.dead_letter["id"])


def _article(kind: str) -> str:
    return ("an " if kind[:1] in "aeiou" else "a ") + kind


def plan_requeue(store: Store, dead_letter: int | Mapping[str, Any]) -> RequeuePlan:
    """What requeueing ``dead_letter`` (an id, or the dict
    :func:`~reliable_beat.runs.get_dead_letter` returns) would do, and the question to ask.

    Raises:
        DeadLetterNotFound: no such dead letter (a ``LookupError``).
        RequeueRefused: it cannot be requeued (the message names why and the fix).
    """
    dl = (rb_runs.get_dead_letter(store, dead_letter) if isinstance(dead_letter, int)
          else dict(dead_letter))
    dl_id, kind, payload = dl["id"], dl.get("kind"), dl.get("payload")
    died = f"died: {dl.get('reason')}, {dl.get('attempts')} attempts"
    if kind == "outbox":
        return RequeuePlan(dl, "outbox", None,
                           f"Deliver outbox message {dl.get('key')!r} to "
                           f"{dl.get('destination')} again ({died})?")
    if kind in ("message", "run"):
        # a workflow activity's message or run: only while its history still waits for it
        _refuse_a_settled_activity(store, dl_id, str(dl.get("key") or ""))
    if kind == "message":
        if dl.get("reason") not in rb_runs.REQUEUEABLE_MESSAGE_REASONS:
            raise RequeueRefused(
                f"dead letter {dl_id} ({dl.get('reason')}) is not requeueable: the message "
                "itself was refused; fix the caller and send the work again")
        body = dict(payload) if isinstance(payload, Mapping) else {}
        return RequeuePlan(dl, "message", CELERY,
                           f"Send {body.get('task')}[{body.get('task_id')}] again "
                           f"(dropped: {dl.get('reason')})?", body)
    if kind != "run":
        raise RequeueRefused(f"dead letter {dl_id} is {_article(str(kind))} dead letter; only "
                             "run, outbox and dropped-message dead letters can be requeued")
    if isinstance(payload, Mapping) and "actor" in payload:
        return RequeuePlan(dl, "actor_run", DRAMATIQ,
                           f"Requeue {payload['actor']} under key {payload.get('key')!r} "
                           f"({died})?", dict(payload))
    try:
        sendable = ops_actions.requeue_payload(store, dl)
    except ValueError as exc:
        raise RequeueRefused(str(exc)) from exc
    return RequeuePlan(dl, "run", CELERY,
                       f"Requeue {sendable['task']} under key {sendable['key']!r} ({died})?",
                       sendable)


def _refuse_a_settled_activity(store: Store, dl_id: int, key: str) -> None:
    """Refuse a workflow activity's dead letter whose failure the workflow has recorded."""
    parsed = parse_activity_key(key)
    if parsed is None:
        return
    workflow_id, run_no, seq = parsed
    try:
        wf = get_workflow(store, workflow_id, events=True)
    except WorkflowNotFound:
        raise RequeueRefused(
            f"dead letter {dl_id} is the activity #{seq} of workflow {workflow_id!r}, which no "
            "longer exists: a re-run's effect would belong to no workflow; dismiss it "
            f"(`reliable-beat dead-letters dismiss {dl_id}`)") from None
    event = next((e for e in wf.get("events", ()) if e["seq"] == seq), None)
    waiting = (wf["run_no"] == run_no and event is not None and event["state"] == "scheduled"
               and wf["state"] not in TERMINAL_STATES)
    if waiting:
        return
    if event is not None and event["kind"] == "compensation" and wf["state"] == "blocked":
        raise RequeueRefused(
            f"dead letter {dl_id} is a compensation of workflow {workflow_id!r}, which is "
            "blocked on it: once its cause is fixed, run `reliable-beat workflows compensate "
            f"{workflow_id}` (it requeues this compensation and runs the remaining ones in "
            "order)")
    recorded = (f"its history recorded the activity as {event['state']}"
                if wf["run_no"] == run_no and event is not None
                else f"the workflow is at run {wf['run_no']}")
    raise RequeueRefused(
        f"dead letter {dl_id} is the activity #{seq} of workflow {workflow_id!r} (run "
        f"{run_no}), now {wf['state']}; {recorded}, and the workflow went on from there (a "
        "saga may have compensated): a re-run's effect would land outside its history. Run "
        "the work again as a new workflow, or dismiss the dead letter "
        f"(`reliable-beat dead-letters dismiss {dl_id}`)")


def _framework(app: Any) -> str | None:
    if app is None:
        return None
    if getattr(adapter_for(app), "requeue_dead_run", None) is not None:
        return DRAMATIQ
    return CELERY if hasattr(app, "send_task") else None


def app_problem(plan: RequeuePlan, app: Any) -> str | None:
    """Why ``app`` cannot send ``plan``'s requeue (None: it can). The message names the
    command that can."""
    have = _framework(app)
    if plan.needs is None or plan.needs == have:
        return None
    dl_id = plan.id
    if plan.needs == DRAMATIQ:
        return (f"dead letter {dl_id} is a Dramatiq actor's ({plan.payload.get('actor')}): "
                "requeue it through its broker: `reliable-beat dramatiq dead-letters requeue "
                f"{dl_id} --broker mod:broker` (or `reliable-beat -A mod:broker ...`)")
    if have == DRAMATIQ:
        return (f"dead letter {dl_id} is a Celery task's ({plan.payload.get('task')}): requeue "
                f"it through the Celery app: `reliable-beat -A APP dead-letters requeue {dl_id}`")
    return (f"dead letter {dl_id}: requeue sends {plan.payload.get('task')} through the Celery "
            f"app: give the app (`reliable-beat -A APP dead-letters requeue {dl_id}`)")


def requeue(store: Store, plan: RequeuePlan, *, app: Any, by: str, force: bool = False,
            queue: str | None = None) -> str:
    """Requeue ``plan``'s dead letter (see the module docstring); returns what was done, as
    one sentence.

    Args:
        store: the store.
        plan: from :func:`plan_requeue` (confirmed by a person).
        app: the Celery app or Dramatiq broker that sends it (None for an outbox row).
        by: who decided (recorded on the dead letter).
        force: requeue even if it was requeued before.
        queue: send to this queue (default: the one it died on / came from).

    Raises:
        RequeueRefused: ``app`` cannot send it (:func:`app_problem`).
        ValueError: refused by the store (requeued before without ``force``, the run's
            effect committed, not dead any more, ...); nothing changed.
        DeadLetterNotFound: it is gone (a ``LookupError``).
        RequeueSendError: the broker refused the message; the requeue was undone.
    """
    problem = app_problem(plan, app)
    if problem is not None:
        raise RequeueRefused(problem)
    dl, dl_id, payload = plan.dead_letter, plan.id, plan.payload
    if plan.what == "outbox":
        rb_runs.requeue_outbox_dead_letter(store, dl_id, by=by, force=force)
        return (f"requeued dead letter {dl_id}: outbox message {dl.get('key')!r} to "
                f"{dl.get('destination')} is pending again (a relay delivers it)")
    if plan.what == "message":
        ops_actions.requeue_dead_message(store, app, dl_id, payload, by=by, force=force,
                                         queue=queue)
        return (f"requeued dead letter {dl_id}: {payload.get('task')} "
                f"[{payload.get('task_id')}] sent again")
    if plan.what == "actor_run":
        try:
            out = adapter_for(app).requeue_dead_run(  # type: ignore[attr-defined]
                app, store, dl_id, by=by, force=force, queue=queue)
        except (ValueError, LookupError):
            raise
        except Exception as exc:
            raise ops_actions.RequeueSendError(
                f"could not send the message ({exc!r}); the run stays dead") from exc
        return (f"requeued dead letter {dl_id}: {out['actor']} under key {out['key']!r} "
                f"(message {out['message_id']} on {out['queue']})")
    ops_actions.requeue_dead_run(store, app, dl_id, payload, by=by, force=force, queue=queue)
    return f"requeued dead letter {dl_id}: {payload['task']} under key {payload['key']!r}"
