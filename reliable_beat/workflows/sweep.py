"""The workflow sweep: wakes for workflows whose advance died or whose wake was lost, and
the activity and compensation messages the broker lost, sent again with the run sweep's
backoff (the relay runs it beside :func:`reliable_beat.redispatch.claim_stuck_runs`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Text, and_, cast, or_, select, update
from sqlalchemy.engine import Connection

from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import runs, workflow_events, workflow_signals, workflows
from reliable_beat.outbox import db_now
from reliable_beat.redaction import get_logger
from reliable_beat.redispatch import (
    BACKOFF_CAP,
    QueueDepthFn,
    backoff_wait,
    hold_backlog,
    waited_with_backoff,
)
from reliable_beat.workflow_store import WAKE_DESTINATION, add_wake
from reliable_beat.workflows import runaway
from reliable_beat.workflows.history import ACTIVE_STATES

__all__ = ["redispatch_workflows"]

log = get_logger("reliable_beat.workflows")

def redispatch_workflows(store: Store, *, older_than: timedelta, limit: int = 500,
                         retrying_after: timedelta | None = None,
                         queue_depths: QueueDepthFn | None = None,
                         max_takeovers: int = runaway.DEFAULT_MAX_TAKEOVERS) -> int:
    """Send a wake to workflows whose advance died or whose wake was lost, and send again
    the activity and compensation messages the broker lost.

    Wakes, two cases (the sweep beside :func:`reliable_beat.redispatch.claim_stuck_runs`):
    ``running`` with a lease expired more than ``older_than`` ago (the holder died), and
    ``pending`` / ``waiting`` with ``wake_seq > claimed_wake_seq`` untouched for
    ``older_than`` (a wake the broker lost). The wake's message id carries the fence token
    and wake_seq, so each stuck state is re-sent once. A ``running`` one whose advance was
    already taken over ``max_takeovers`` times is parked ``blocked`` instead
    (:func:`reliable_beat.workflows.runaway.park_expired`): no wake, no worker.

    Timers and signal timeouts due for ``older_than`` on a workflow that has not advanced
    since: see :func:`_resend_lost_timer_wakes` (their delayed wake was lost by the broker).

    Activity and compensation messages of active workflows (events ``scheduled``): see
    :func:`_lost_activities` (a run never started, started by a worker that died,
    requeued and never claimed, or ``retrying`` with no retry message left). At least once:
    the run's idempotency key makes the effect once. Timer wakes and activity re-sends back
    off as the run sweep's re-sends do: the k-th re-send of one event waits
    ``older_than * 2**k`` (k capped at :data:`reliable_beat.redispatch.BACKOFF_CAP`,
    counted in ``workflow_events.redispatches``), so a message that only waits in a
    backlog is not re-sent once per window.

    Args:
        store: the store.
        older_than: how long a wake or an activity message may be outstanding before it is
            sent again (the relay: ``reliable_beat_redispatch_seconds``).
        limit: most workflows (and most activities) per call.
        retrying_after: how long an activity run may sit ``retrying`` untouched before its
            message is sent again; pick it above the retry backoff cap (the relay:
            ``redispatch_seconds + retry_cap_seconds``). None: ``older_than``.
        queue_depths: the adapter's broker probe
            (:data:`reliable_beat.redispatch.QueueDepthFn`; the relay passes its app's when
            ``reliable_beat_redispatch_backlog_check`` is on). With it, activity and
            compensation messages whose queue holds at least as many ready messages as
            would be re-sent there, all younger than the backoff cap, are not re-sent (a
            backlog, not a loss; :func:`reliable_beat.redispatch.hold_backlog`). None, or a
            probe that fails: re-sent as without it.
        max_takeovers: ``reliable_beat_workflow_max_takeovers`` (see above).

    Returns:
        How many wakes and activity messages were added.
    """
    with store.begin() as conn:
        now = db_now(conn)
        cutoff = now - older_than
        rows = conn.execute(
            select(workflows.c.id, workflows.c.workflow_id, workflows.c.queue,
                   workflows.c.fence_token, workflows.c.wake_seq, workflows.c.state,
                   workflows.c.takeovers, workflows.c.leased_by)
            .where(
                workflows.c.state.in_(ACTIVE_STATES),
                workflows.c.updated_at < cutoff,
                or_(
                    and_(workflows.c.state == "running", workflows.c.lease_expires_at < cutoff),
                    and_(workflows.c.state != "running",
                         workflows.c.wake_seq > workflows.c.claimed_wake_seq),
                ),
            )
            .order_by(workflows.c.updated_at)
            .limit(limit)
        ).all()
        parked = [r for r in rows
                  if r.state == "running" and runaway.park_expired(conn, r, now, max_takeovers)]
        rows = [r for r in rows if r not in parked]
        for r in rows:
            add_wake(conn, r.workflow_id, r.queue, f"sweep{r.fence_token}.{r.wake_seq}")
        swept = {r.workflow_id for r in rows + parked}
        timers = _resend_lost_timer_wakes(conn, now, cutoff, older_than, limit, swept)
        timers += _resend_lost_signal_wakes(conn, now, cutoff, older_than, limit, swept)
        retry_after = older_than if retrying_after is None else retrying_after
        lost = _lost_activities(conn, now, cutoff, older_than, limit, retry_after=retry_after)
        if queue_depths is None or not lost:
            return len(rows) + timers + _add_activity_resends(conn, lost, now, older_than)
    # ask the broker outside any transaction; the re-send's compare-and-set on the event's
    # count keeps a concurrent sweep from sending it twice meanwhile
    lost = _drop_backlogged(lost, queue_depths, now, older_than, retry_after)
    with store.begin() as conn:
        return len(rows) + timers + _add_activity_resends(conn, lost, now, older_than)


def _drop_backlogged(lost: list[tuple[Any, dict[str, Any]]], queue_depths: QueueDepthFn,
                     now: datetime, older_than: timedelta, retry_after: timedelta
                     ) -> list[tuple[Any, dict[str, Any]]]:
    """``lost`` without the messages whose queue is a backlog
    (:func:`reliable_beat.redispatch.hold_backlog`). An event is *young* while less than
    the backoff cap passed since its last re-send (or, never re-sent, since its state's
    wait began: the event's creation without a run, the lease's expiry of a ``running``
    run, the run's last update otherwise)."""
    young = []
    for r, _payload in lost:
        since = r.redispatched_at or (r.created_at if r.run_state is None
                                      else r.lease_expires_at if r.run_state == "running"
                                      else r.run_updated_at)
        base = retry_after if r.run_state == "retrying" else older_than
        young.append(since is not None and now - since < backoff_wait(base, BACKOFF_CAP))
    messages = [outbox.OutboxMessage(id=0, message_id=f"act:{r.run_key}",
                                     destination=WAKE_DESTINATION, payload=payload)
                for r, payload in lost]
    held = hold_backlog(messages, young, queue_depths, every=older_than)
    return [found for i, found in enumerate(lost) if i not in held]


def _backed_off(now: datetime, after: timedelta) -> Any:
    """SQL condition on a ``workflow_events`` row: never re-sent by the sweep, or its last
    re-send (``redispatched_at``) older than ``after * 2**redispatches`` (capped): the run
    sweep's backoff rule (:func:`reliable_beat.redispatch.backoff_wait`), so a message that
    only waits in a backlog gets log2(backlog / after) + 1 copies, not one per window."""
    ev = workflow_events.c
    return or_(ev.redispatched_at.is_(None),
               waited_with_backoff(ev.redispatched_at, ev.redispatches, now, after))


def _count_resend(conn: Connection, row: Any, now: datetime) -> bool:
    """Count one re-send on the event ``row`` (its ``workflow_pk``, ``run_no``, ``seq`` and
    the ``redispatches`` the sweep read): compare-and-set, so of two sweeps that read the
    same row only one re-sends it. False: another sweep counted it first (or it completed)."""
    ev = workflow_events.c
    done = conn.execute(
        update(workflow_events)
        .where(ev.workflow_pk == row.workflow_pk, ev.run_no == row.run_no, ev.seq == row.seq,
               ev.state == "scheduled", ev.redispatches == row.redispatches)
        .values(redispatches=ev.redispatches + 1, redispatched_at=now)
    )
    return bool(done.rowcount == 1)


def _resend_lost_timer_wakes(conn: Connection, now: datetime, cutoff: datetime,
                             older_than: timedelta, limit: int, skip: set[str]) -> int:
    """Wake ``pending`` / ``waiting`` workflows with a timer or signal timeout (an event
    ``scheduled`` with a ``fire_at``) due before ``cutoff`` whose row has not changed since
    ``cutoff``: the timer's wake (``wake:<id>:<run>t<seq>``, delayed to ``fire_at``) was
    lost by the broker after the relay sent it (a Redis restart without persistence), or
    arrived early (a wake row moved by SQL) and the advance went back to sleep. Once per
    workflow per ``older_than`` window (the message id carries the fence token and the
    window number); the advance it starts is fenced and replays, so a wake too many is a
    no-op. Backs off like the run sweep: the k-th wake for one timer waits
    ``older_than * 2**k`` (k capped; counted on the timer's event). ``skip``: workflows
    already woken by this sweep. Returns the wakes added."""
    j = workflow_events.join(workflows, workflows.c.id == workflow_events.c.workflow_pk)
    rows = conn.execute(
        select(workflows.c.workflow_id, workflows.c.queue, workflows.c.fence_token,
               workflow_events.c.workflow_pk, workflow_events.c.run_no,
               workflow_events.c.seq, workflow_events.c.redispatches)
        .select_from(j)
        .where(
            workflows.c.state.in_(("pending", "waiting")),
            workflows.c.updated_at < cutoff,
            workflow_events.c.run_no == workflows.c.run_no,
            workflow_events.c.state == "scheduled",
            workflow_events.c.fire_at.is_not(None),
            workflow_events.c.fire_at < cutoff,
            _backed_off(now, older_than),
        )
        .order_by(workflow_events.c.fire_at)
        .limit(limit)
    ).all()
    return _wake_swept(conn, rows, now, older_than, skip, "due",
                       "waits on a timer due before %s that no wake advanced (its wake was "
                       "lost): waking it", cutoff)


def _wake_swept(conn: Connection, rows: Sequence[Any], now: datetime, older_than: timedelta,
                skip: set[str], prefix: str, why: str, cutoff: datetime) -> int:
    """Add one wake per workflow of ``rows`` (a sweep's candidates: ``workflow_id``,
    ``queue``, ``fence_token`` and the event's resend columns) not in ``skip``, each counted
    on its event first (:func:`_count_resend`: another sweep's re-send in the same window
    wins); the wake's id is ``<prefix><fence>.r<window>`` so two sweeps of one window add
    one message. Logs ``why`` (with ``cutoff``) per wake. Returns the wakes added."""
    window = int(now.timestamp() // max(older_than.total_seconds(), 1.0))
    sent = 0
    for r in rows:
        if r.workflow_id in skip:
            continue
        skip.add(r.workflow_id)
        if not _count_resend(conn, r, now):
            continue
        log.warning("workflow sweep: workflow %s " + why, r.workflow_id, cutoff.isoformat())
        add_wake(conn, r.workflow_id, r.queue, f"{prefix}{r.fence_token}.r{window}")
        sent += 1
    return sent


def _resend_lost_signal_wakes(conn: Connection, now: datetime, cutoff: datetime,
                              older_than: timedelta, limit: int, skip: set[str]) -> int:
    """Wake ``pending`` / ``waiting`` workflows parked on a ``wait_signal(name)`` (an event
    ``signal`` ``scheduled`` in the current run) while a signal of that name, stored before
    ``cutoff``, sits unconsumed, and whose row has not changed since ``cutoff``: the
    signal's wake did not reach an advance that could read it (:func:`signal` skipped its
    ``wake_seq`` bump because an advance held the row, and the wake's advance failed, e.g.
    on the row lock of a holder frozen inside a transaction; or the broker lost the wake).
    Once per workflow per ``older_than`` window, backing off like the timer sweep (counted
    on the signal's event). ``skip``: workflows already woken by this sweep. Returns the
    wakes added."""
    ev, wf, sg = workflow_events.c, workflows.c, workflow_signals.c
    j = workflow_events.join(workflows, wf.id == ev.workflow_pk).join(
        workflow_signals, and_(sg.workflow_pk == ev.workflow_pk, sg.name == ev.name))
    rows = conn.execute(
        select(wf.workflow_id, wf.queue, wf.fence_token, ev.workflow_pk, ev.run_no, ev.seq,
               ev.redispatches)
        .select_from(j)
        .where(
            wf.state.in_(("pending", "waiting")),
            wf.updated_at < cutoff,
            ev.run_no == wf.run_no,
            ev.kind == "signal",
            ev.state == "scheduled",
            sg.consumed_seq.is_(None),
            sg.created_at < cutoff,
            _backed_off(now, older_than),
        )
        .order_by(sg.id)
        .limit(limit)
    ).all()
    return _wake_swept(conn, rows, now, older_than, skip, "sigsweep",
                       "waits for a signal stored before %s that no advance read (its wake "
                       "did not get through): waking it", cutoff)


def _lost_activities(conn: Connection, now: datetime, cutoff: datetime,
                     older_than: timedelta, limit: int, *,
                     retry_after: timedelta) -> list[tuple[Any, dict[str, Any]]]:
    """Activities and compensations (events ``scheduled`` before ``cutoff``, workflow
    active) whose message is gone, with the message to send again (same key: the run
    deduplicates; :func:`_add_activity_resends` adds it), at most once per ``older_than``
    window (the message id carries the window number), and backing off: the k-th re-send
    of one event waits ``older_than * 2**k`` after the previous one (``retry_after * 2**k``
    for a ``retrying`` run; k capped, counted in the event's ``redispatches``), the run
    sweep's rule (:func:`reliable_beat.redispatch.backoff_wait`). A message that waits in a
    backlog looks exactly like a lost one; re-sending it every window grew the backlog.
    Their run is

    * absent: the message never reached a worker (lost by the broker, or never published);
    * ``running`` with a lease expired before ``cutoff``: the worker died in the body;
    * ``scheduled`` / ``dispatched`` untouched since ``cutoff``: requeued (``workflows
      compensate``, ``dead-letters requeue``) and its message lost;
    * ``retrying`` untouched for ``retry_after``: a transient failure whose retry
      message was lost, or a lease cleared by a person (``reliable-beat lease clear``).

    The run sweep (:func:`reliable_beat.redispatch.claim_stuck_runs`) never takes these
    runs: they have no trigger row.

    Returns:
        ``(event row, celery payload)`` per activity, oldest event first; an event whose
        stored args are malformed is logged and left out."""
    j = workflow_events.join(workflows, workflows.c.id == workflow_events.c.workflow_pk
                             ).outerjoin(runs, runs.c.idempotency_key == workflow_events.c.run_key)
    rows = conn.execute(
        select(workflow_events.c.run_key, workflow_events.c.name,
               cast(workflow_events.c.args, Text).label("args"), workflows.c.queue,
               workflows.c.schedule_group, workflow_events.c.workflow_pk,
               workflow_events.c.run_no, workflow_events.c.seq,
               workflow_events.c.redispatches, workflow_events.c.redispatched_at,
               workflow_events.c.created_at, runs.c.state.label("run_state"),
               runs.c.lease_expires_at, runs.c.updated_at.label("run_updated_at"))
        .select_from(j)
        .where(
            workflow_events.c.kind.in_(("activity", "compensation")),
            workflow_events.c.state == "scheduled",
            workflow_events.c.created_at < cutoff,
            workflows.c.state.in_(ACTIVE_STATES),
            or_(and_(or_(runs.c.id.is_(None),
                         and_(runs.c.state == "running", runs.c.lease_expires_at < cutoff),
                         and_(runs.c.state.in_(("scheduled", "dispatched")),
                              runs.c.updated_at < cutoff)),
                     _backed_off(now, older_than)),
                and_(runs.c.state == "retrying", runs.c.updated_at < now - retry_after,
                     _backed_off(now, retry_after))),
        )
        .order_by(workflow_events.c.created_at)
        .limit(limit)
    ).all()
    found: list[tuple[Any, dict[str, Any]]] = []
    for r in rows:
        try:  # read as text: one corrupted event must not stop the sweep for every workflow
            stored = r.args if r.args is None or not isinstance(r.args, str) \
                else json.loads(r.args)
            call = list(stored or [[], {}, None])
            args, kwargs = list(call[0]), dict(call[1])
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            log.error("workflow sweep: activity %s is not re-sent: its event's args are "
                      "malformed (%s): %r; the workflow's next advance blocks it naming "
                      "the row (`reliable-beat workflows show`)", r.run_key, exc,
                      str(r.args)[:80])
            continue
        call = [args, kwargs, *call[2:]]
        payload: dict[str, Any] = {"task": r.name, "args": call[0], "kwargs": call[1],
                                   "headers": {"reliable_beat_key": r.run_key}}
        if len(call) > 2 and call[2]:
            payload["options"] = {"queue": call[2]}
        found.append((r, payload))
    return found


def _add_activity_resends(conn: Connection, found: list[tuple[Any, dict[str, Any]]],
                          now: datetime, older_than: timedelta) -> int:
    """Add the messages :func:`_lost_activities` found to the outbox (joins ``conn``), each
    counted on its event first (:func:`_count_resend`: of two sweeps, one sends). Returns
    how many were added."""
    window = int(now.timestamp() // max(older_than.total_seconds(), 1.0))
    sent = 0
    for r, payload in found:
        if not _count_resend(conn, r, now):
            continue  # another sweep re-sent it meanwhile
        outbox.add(conn, WAKE_DESTINATION, payload, key=f"act:{r.run_key}:r{window}",
                   schedule_group=r.schedule_group)
        sent += 1
    return sent

