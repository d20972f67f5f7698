"""Re-send the trigger of a run whose message was lost after it left the outbox.

A broker can lose a delivered message: kombu's Redis transport pops a message (``BRPOP``)
before it records it as unacknowledged, so a worker SIGKILLed in between loses it for good,
and ``acks_late`` cannot bring it back. The run then sits in ``dispatched`` with no attempt,
and its slot would never fire (design.md invariant 8). The fault-injection run found exactly
this.

The beat therefore looks, every few seconds, for runs of *tracked* tasks
(``IdempotentTask``, which record every attempt) that are

* ``dispatched`` for longer than ``redispatch_after`` with no worker having claimed them, or
* ``running`` with a lease that expired more than ``redispatch_after`` ago (the worker died
  and its message did not come back),
* ``retrying`` for ``redispatch_after`` past the time its retry was due (``runs.retry_at``:
  a retry message lost by the broker or dropped by the framework's own retry options, a
  retry that could not be published, or a lease cleared by a person with ``reliable-beat
  lease clear``),

and publishes their trigger again, with the same task id and idempotency key. A run with no
trigger row (a slot the beat published without one, an ad-hoc call, a requeued dead letter)
is re-sent as built from its run row (task, arguments, key, slot; a periodic run with its
entry's options, so to the queue its trigger went to; an ad-hoc call's to the task's default
queue); a workflow activity's run is left to the
workflow sweep. A duplicate is harmless: the task deduplicates it (a second claim of a live
or finished run does not run the body). Plain Celery tasks are never re-sent: they keep no
run state, so "stuck" cannot be told from "done".

Pick ``reliable_beat_redispatch_seconds`` above the longest time a trigger may legitimately
wait in a queue (worker backlog), and above the broker's own redelivery delay if you would
rather let the broker redeliver first (Redis ``visibility_timeout``).

Re-sends back off: a run's k-th re-send waits ``redispatch_seconds * 2**k`` (k counted in
``runs.redispatches``, capped at :data:`BACKOFF_CAP`). A trigger that waits in a backlog
looks exactly like a lost one, and re-sending every stuck run every period would add one
duplicate message per stuck run per period to the backlog that made them look stuck: the
queue grows faster than workers drain it and never recovers (a congestion collapse the fault
run on RabbitMQ hit under load). With the backoff a run is re-sent at most
``log2(backlog / redispatch_seconds) + 1`` times while it waits, and a lost message is still
re-sent (after at most ``redispatch_seconds * 2**BACKOFF_CAP`` once it was re-sent that often).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, literal, or_, select, true, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from reliable_beat import unsent
from reliable_beat.adapters import adapter_for
from reliable_beat.db.dialects import Store, update_returning
from reliable_beat.db.tables import outbox, runs
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.groups import entry_outside_group, schedule_group_of
from reliable_beat.handlers import MessageExpiredError
from reliable_beat.identity import store_id_in
from reliable_beat.outbox import OutboxMessage
from reliable_beat.policies import BACKOFF_CAP, backoff_wait
from reliable_beat.redaction import get_logger
from reliable_beat.settings import Settings
from reliable_beat.triggers import (
    TRIGGER_DESTINATION,
    TRIGGER_DESTINATIONS,
    trigger_message_id,
)

__all__ = ["BACKOFF_CAP", "Backlog", "QueueDepthFn", "backlogged", "backoff_wait",
           "claim_stuck_runs", "hold_backlog", "redispatch_stuck_runs", "redispatch_with",
           "tracked_tasks", "waited_with_backoff"]

log = get_logger("reliable_beat.redispatch")

#: What a run's trigger message id starts with (``trigger:<idempotency key>``).
_TRIGGER_PREFIX = trigger_message_id("")
#: What a workflow activity's run key starts with (its runs are the workflow sweep's).
WORKFLOW_KEY_PREFIX = "wf:"


def waited_with_backoff(col: Any, resends: Any, now: datetime, after: timedelta) -> Any:
    """SQL condition: instant column ``col`` is older than :func:`backoff_wait` of
    ``after`` and the integer column ``resends`` (how many times the row's message was
    re-sent). One portable condition per k, the cutoffs computed here from ``now`` (the
    store's clock; no interval arithmetic in SQL, so it runs on every dialect)."""
    return or_(*[
        and_(resends == k if k < BACKOFF_CAP else resends >= k,
             col < now - backoff_wait(after, k))
        for k in range(BACKOFF_CAP + 1)
    ])


def _waited(col: Any, now: datetime, after: timedelta) -> Any:
    """``col`` older than ``after * 2**k`` for a run re-sent k times (k capped)."""
    return waited_with_backoff(col, runs.c.redispatches, now, after)


def _stuck_runs_select(*, now: datetime, after: timedelta, tasks: Collection[str],
                       limit: int, retrying_after: timedelta | None,
                       schedule_group: str | None,
                       only_ids: Collection[int] | None = None) -> Any:
    """The SELECT of the stuck runs :func:`claim_stuck_runs` claims (no lock): id, key,
    state and the instant each state's wait counts from (``since``)."""
    stuck_states = [
        and_(runs.c.state == "dispatched", _waited(runs.c.dispatched_at, now, after)),
        and_(runs.c.state == "running", _waited(runs.c.lease_expires_at, now, after)),
    ]
    if retrying_after is not None:
        # ``retry_at``: when the retry is due (its countdown's end, or the last re-send);
        # rows written before it existed (0015_retrysweep) count from updated_at + the cap
        stuck_states.append(and_(runs.c.state == "retrying", or_(
            and_(runs.c.retry_at.is_not(None), _waited(runs.c.retry_at, now, after)),
            and_(runs.c.retry_at.is_(None), _waited(runs.c.updated_at, now, retrying_after)),
        )))
    # Only runs this sweep can re-send: those with a trigger row (``trigger:<key>``) of a
    # trigger destination, and any other run but a workflow activity's (a slot published
    # without a row, an ad-hoc call, a requeued dead letter: re-sent as built from the run
    # row, :func:`reliable_beat.unsent.run_messages`). A
    # workflow activity's run (key ``wf:<id>/<run>#<seq>``, message ``act:<key>``) is the
    # workflow sweep's (:func:`~reliable_beat.workflows.engine.redispatch_workflows`):
    # claiming it here would push its clock to ``now`` and hide it from that sweep.
    has_trigger = (
        select(outbox.c.id)
        .where(outbox.c.message_id == literal(_TRIGGER_PREFIX) + runs.c.idempotency_key,
               outbox.c.destination.in_(sorted(TRIGGER_DESTINATIONS)))
        .exists()
    )
    resendable = or_(has_trigger, ~runs.c.idempotency_key.startswith(WORKFLOW_KEY_PREFIX))
    since = case((runs.c.state == "dispatched", runs.c.dispatched_at),
                 (runs.c.state == "running", runs.c.lease_expires_at),
                 (runs.c.retry_at.is_not(None), runs.c.retry_at),
                 else_=runs.c.updated_at).label("since")
    return (
        select(runs.c.id, runs.c.idempotency_key, runs.c.state, runs.c.retry_at, since)
        .where(runs.c.task.in_(sorted(tasks)), or_(*stuck_states), resendable,
               true() if schedule_group is None
               else ~entry_outside_group(runs.c.entry_name, schedule_group),
               true() if only_ids is None else runs.c.id.in_(sorted(only_ids)))
        .order_by(runs.c.id)
        .limit(limit)
    )


def _trigger_rows(conn: Connection, keys: Collection[str]) -> list[Any]:
    """The trigger outbox rows of the runs with these idempotency keys, in run id order."""
    return list(conn.execute(
        select(outbox).where(
            outbox.c.message_id.in_([trigger_message_id(k) for k in keys]),
            outbox.c.destination.in_(sorted(TRIGGER_DESTINATIONS)),
        ).order_by(outbox.c.run_id)
    ).all())


def claim_stuck_runs(
    store: Store,
    conn: Connection,
    *,
    now: datetime,
    after: timedelta,
    tasks: Collection[str],
    limit: int = 100,
    retrying_after: timedelta | None = None,
    schedule_group: str | None = None,
    only_ids: Collection[int] | None = None,
    destination: str = TRIGGER_DESTINATION,
) -> list[OutboxMessage]:
    """Claim stuck runs of ``tasks`` and return their trigger rows, ready to publish again.

    Joins the caller's transaction (``FOR UPDATE SKIP LOCKED`` on the runs, so concurrent
    beats never pick the same run). Each claimed run's clock is pushed to ``now``
    (``dispatched_at``, ``lease_expires_at`` for an expired ``running`` run, ``retry_at``
    for a ``retrying`` one), so it is not picked again for another ``after``. A run re-sent
    k times before must have waited ``after * 2**k`` (k capped at :data:`BACKOFF_CAP`; a
    ``retrying`` run counts from ``retry_at``, when its retry was due): re-sends back off, so
    a backlog is not flooded with duplicates (see the module's docstring); each claim adds
    one to ``runs.redispatches``.

    Args:
        store: the store.
        conn: a connection inside a transaction.
        now: the store's clock, UTC.
        after: how long a run may sit dispatched (or with an expired lease) before its
            trigger is sent again.
        tasks: names of tracked tasks (``IdempotentTask``); other runs are never touched.
        limit: most runs per call.
        retrying_after: also re-send ``retrying`` runs ``after`` past their ``retry_at``
            (a retry message lost or dropped, or a lease cleared by a person); a row with no
            ``retry_at`` (written before 0015_retrysweep) when not updated for this long
            (pick it above the retry backoff cap); None: leave them.
        schedule_group: only runs whose entry is of this schedule group, has no group, or
            is gone (the caller publishes into its own app's broker); None: every run.
        only_ids: only runs with these ids (those a backlog check let through; see
            :func:`redispatch_with`); None: any.
        destination: the trigger destination whose payload shape the caller's publisher
            reads (``celery``, ``dramatiq``), for the messages of runs without a trigger row.

    Returns:
        The runs' trigger outbox rows as :class:`~reliable_beat.outbox.OutboxMessage`
        (in run id order), then, for runs without one (a slot published without a row, an
        ad-hoc call, a requeued dead letter; never a workflow activity's, the workflow
        sweep's), a message built from the run row and its entry's options
        (:func:`reliable_beat.unsent.run_messages`: not stored, ``id`` the run's id negated).
    """
    if not tasks or (only_ids is not None and not only_ids):
        return []
    stmt = _stuck_runs_select(now=now, after=after, tasks=tasks, limit=limit,
                              retrying_after=retrying_after, schedule_group=schedule_group,
                              only_ids=only_ids)
    stuck = conn.execute(store.for_update_skip_locked(stmt)).all()
    if not stuck:
        return []
    dispatched = [r.id for r in stuck if r.state == "dispatched"]
    running = [r.id for r in stuck if r.state == "running"]
    if dispatched:
        conn.execute(
            update(runs).where(runs.c.id.in_(dispatched)).values(
                dispatched_at=now, updated_at=now, redispatches=runs.c.redispatches + 1)
        )
    if running:
        conn.execute(
            update(runs).where(runs.c.id.in_(running)).values(
                lease_expires_at=now, updated_at=now, redispatches=runs.c.redispatches + 1)
        )
    retrying = [r.id for r in stuck if r.state == "retrying"]
    if retrying:  # its next try is due one re-send window from now
        conn.execute(update(runs).where(runs.c.id.in_(retrying)).values(
            updated_at=now, retry_at=now, redispatches=runs.c.redispatches + 1))
    messages = [OutboxMessage.from_row(r)
                for r in _trigger_rows(conn, [r.idempotency_key for r in stuck])]
    found = {m.message_id for m in messages}
    bare = [r.id for r in stuck if trigger_message_id(r.idempotency_key) not in found]
    if bare:  # a due slot's run (its trigger had no row), an ad-hoc call's run, a requeued
        # dead letter: its message from the run row (and its entry's options)
        messages += _run_messages(store, conn, bare, destination)
    return messages


def _run_messages(store: Store, conn: Connection, run_ids: Collection[int],
                  destination: str) -> list[OutboxMessage]:
    """The messages of runs that have no trigger row (:func:`reliable_beat.unsent.
    run_messages`: built from the run row, with its entry's options), in run id order."""
    rows = conn.execute(select(runs).where(runs.c.id.in_(sorted(run_ids))).order_by(runs.c.id))
    return unsent.run_messages(conn, rows.all(), destination, sid=store_id_in(conn, store))


def _still_claimed(store: Store, stuck: list[OutboxMessage],
                   claimed_at: datetime) -> list[OutboxMessage]:
    """The messages whose runs still carry this claim's stamp (``updated_at`` =
    ``claimed_at``), re-stamped with the database's current time so no other process takes
    them meanwhile; the others were claimed again (or finished) since."""
    run_ids = [m.run_id for m in stuck if m.run_id is not None]
    try:
        with store.begin() as conn:
            now = store.now(conn)
            mine = {r.id for r in update_returning(
                conn,
                update(runs)
                .where(runs.c.id.in_(run_ids), runs.c.updated_at == claimed_at,
                       runs.c.state.in_(("dispatched", "running", "retrying")))
                .values(updated_at=now,
                        dispatched_at=case((runs.c.state == "dispatched", now),
                                           else_=runs.c.dispatched_at),
                        lease_expires_at=case((runs.c.state == "running", now),
                                              else_=runs.c.lease_expires_at),
                        retry_at=case((runs.c.state == "retrying", now),
                                      else_=runs.c.retry_at)),
                runs, (runs.c.id,), lock_by_primary_key=True,  # MariaDB: not via the state index
            )}
    except (StoreUnavailableError, DBAPIError) as exc:  # gone again: send nothing, retry later
        log.error("could not re-check %d stuck runs before re-sending (%s)", len(stuck), exc)
        return []
    return [m for m in stuck if m.run_id in mine]


def tracked_tasks(app: Any) -> list[str]:
    """Names of the tasks registered in framework ``app`` that keep run state (Celery: the
    ``IdempotentTask`` ones), asked of the app's adapter (:mod:`reliable_beat.adapters`)."""
    return adapter_for(app).tracked_tasks(app)


def redispatch_stuck_runs(store: Store, app: Any, settings: Settings) -> int:
    """Find stuck runs (:func:`claim_stuck_runs`) of the framework app's tracked tasks and
    publish their triggers again into its broker, both through the app's adapter
    (:mod:`reliable_beat.adapters`; Celery: ``publish_celery_batch``; see
    :func:`redispatch_with`).

    Returns:
        How many triggers were published again.
    """
    adapter = adapter_for(app)

    def publish(messages: list[OutboxMessage], now: datetime
                ) -> list[tuple[int, BaseException | None]]:
        return adapter.publish(app, messages, now)

    probe = getattr(adapter, "queue_depths", None)  # optional: not every adapter has one

    def depths(messages: list[OutboxMessage]) -> list[tuple[str, int | None]]:
        assert probe is not None
        return list(probe(app, messages))

    return redispatch_with(store, settings, tracked_tasks(app), publish,
                           schedule_group=schedule_group_of(app, settings.schedule_group),
                           queue_depths=None if probe is None else depths,
                           destination=adapter.name if adapter.name in TRIGGER_DESTINATIONS
                           else TRIGGER_DESTINATION)


#: ``publish(messages, now) -> [(outbox id, None or the error)]``, one per message, in order.
PublishFn = Callable[[list[OutboxMessage], datetime], list[tuple[int, "BaseException | None"]]]

#: ``depths(messages) -> [(queue name, ready messages in that queue or None)]``, one per
#: message, in order: the queue the message would be published to, and how many messages
#: wait there ready for a consumer (RabbitMQ: ``queue_declare(passive=True)``'s
#: ``message_count``; Redis: the queue's list length), None when the broker cannot tell.
#: May raise (the sweep then re-sends as without it). Given by the adapter (Celery:
#: :func:`reliable_beat.celery.backlog.queue_depths`).
QueueDepthFn = Callable[[list[OutboxMessage]], list[tuple[str, "int | None"]]]


@dataclass(frozen=True)
class Backlog:
    """A queue the backlog check found deep enough to hold every stuck run's trigger.

    Attributes:
        queue: the queue's name.
        ready: messages ready in it, as the broker reported.
        runs: stuck runs whose triggers go to it (not re-sent this time).
    """

    queue: str
    ready: int
    runs: int


def backlogged(candidates: Sequence[tuple[str, int | None, bool]]
               ) -> tuple[set[int], list[Backlog]]:
    """Decide which stuck runs wait in a backlog rather than lost their message (pure).

    Per queue: when it holds at least as many ready messages as the sweep would re-send to
    it (``ready >= n``) and every one of those runs is still *young* (waited less than the
    backoff cap, ``redispatch_seconds * 2**BACKOFF_CAP``), their triggers are taken to be
    queued behind others, not lost: none of them is re-sent. An unknown depth (None), a
    shorter queue, or one run past the cap: the queue's runs are re-sent as before.

    Args:
        candidates: per stuck run, ``(queue its trigger goes to, ready messages in that
            queue or None, young)``.

    Returns:
        The positions in ``candidates`` to hold back, and one :class:`Backlog` per queue
        held back (sorted by queue name).
    """
    by_queue: dict[str, list[int]] = {}
    ready: dict[str, int | None] = {}
    for i, (queue, depth, _young) in enumerate(candidates):
        by_queue.setdefault(queue, []).append(i)
        ready.setdefault(queue, depth)
    held: set[int] = set()
    notes = []
    for queue in sorted(by_queue):
        group, depth = by_queue[queue], ready[queue]
        if depth is None or depth < len(group) or not all(candidates[i][2] for i in group):
            continue
        held.update(group)
        notes.append(Backlog(queue, depth, len(group)))
    return held, notes


#: When each queue's "a backlog, not a loss" line was last logged at INFO (monotonic
#: seconds; this process): once per ``redispatch_seconds`` per queue, DEBUG between.
_backlog_logged: dict[str, float] = {}


def _log_once(key: str, every: timedelta, msg: str, *args: Any) -> None:
    """INFO, at most once per ``every`` for ``key`` in this process; DEBUG between."""
    last = _backlog_logged.get(key)
    quiet = last is not None and time.monotonic() - last < every.total_seconds()
    if not quiet:
        _backlog_logged[key] = time.monotonic()
    log.log(logging.DEBUG if quiet else logging.INFO, msg, *args)


def _hold_backlogged(store: Store, settings: Settings, tasks: Collection[str],
                     depths: QueueDepthFn, *, after: timedelta, retrying_after: timedelta,
                     schedule_group: str | None,
                     destination: str = TRIGGER_DESTINATION) -> set[int] | None:
    """Look at the runs the sweep would claim (no lock), ask the broker how deep their
    queues are (outside any transaction) and apply :func:`backlogged`.

    Returns:
        The ids of the looked-at runs that may be re-sent (for ``only_ids``), or None: no
        stuck run, nothing to claim.
    """
    with store.begin() as conn:
        now = store.now(conn)
        peek = conn.execute(_stuck_runs_select(
            now=now, after=after, tasks=tasks, limit=settings.batch_size,
            retrying_after=retrying_after, schedule_group=schedule_group)).all()
        if not peek:
            return None
        rows = {r.message_id: OutboxMessage.from_row(r)
                for r in _trigger_rows(conn, [p.idempotency_key for p in peek])}
        bare = [p.id for p in peek if trigger_message_id(p.idempotency_key) not in rows]
        if bare:  # their messages as a re-send builds them: the queue they would go to
            rows.update((m.message_id, m) for m in _run_messages(store, conn, bare, destination))
    looked = [(p, rows[trigger_message_id(p.idempotency_key)]) for p in peek
              if trigger_message_id(p.idempotency_key) in rows]
    # young: waited less than the backoff cap since the instant its state's wait counts from
    young = [p.since is not None and now - p.since < backoff_wait(
        retrying_after if p.state == "retrying" and p.retry_at is None else after,
        BACKOFF_CAP) for p, _ in looked]
    held = hold_backlog([m for _, m in looked], young, depths, every=after)
    return {p.id for p in peek} - {looked[i][0].id for i in held}


def hold_backlog(messages: Sequence[OutboxMessage], young: Sequence[bool],
                 depths: QueueDepthFn, *, every: timedelta) -> set[int]:
    """Ask the broker (``depths``) how deep the messages' queues are and apply
    :func:`backlogged`; log each queue held back at INFO (``N runs look stuck but queue Q
    holds M ready messages: a backlog, not a loss; not re-sending``, at most once per
    ``every`` per queue in this process). Shared by the run sweep and the workflow sweep.

    Args:
        messages: the messages a sweep would re-send.
        young: per message, whether it waited less than the backoff cap.
        depths: the adapter's probe (:data:`QueueDepthFn`); may raise.
        every: the re-dispatch period (``redispatch_seconds``).

    Returns:
        Positions in ``messages`` not to re-send; empty when the probe fails (logged at
        INFO, once per ``every``: the sweep re-sends as without the check).
    """
    if not messages:
        return set()
    try:
        seen = list(depths(list(messages)))
        if len(seen) != len(messages):
            raise ValueError(f"{len(seen)} depths for {len(messages)} messages")
    except Exception as exc:  # the broker could not tell: re-send as without the check
        _log_once("", every, "backlog check: the broker's queue depths are unknown (%r): "
                  "re-sending stuck messages as without the check", exc)
        return set()
    held, notes = backlogged([(q, ready, y) for (q, ready), y in zip(seen, young, strict=True)])
    for note in notes:
        _log_once(note.queue, every, "%d runs look stuck but queue %s holds %d ready "
                  "messages: a backlog, not a loss; not re-sending",
                  note.runs, note.queue, note.ready)
    return held


def redispatch_with(
    store: Store, settings: Settings, tasks: Collection[str], publish: PublishFn,
    *, schedule_group: str | None = None, queue_depths: QueueDepthFn | None = None,
    destination: str = TRIGGER_DESTINATION,
) -> int:
    """Find stuck runs of ``tasks`` (:func:`claim_stuck_runs`) and ``publish`` their trigger
    rows again: the framework-neutral re-dispatch, called every few seconds by beats and
    relays of any adapter. A trigger whose ``expires_at`` has passed
    (:class:`~reliable_beat.handlers.MessageExpiredError`) is not re-sent: its run becomes
    ``skipped`` (reason ``expired``).

    ``schedule_group``: only runs of this group's entries and of group-less ones (the
    caller publishes into its own app's broker; see :func:`claim_stuck_runs`); None: any.

    ``queue_depths``: the adapter's broker probe (:data:`QueueDepthFn`). With it (and
    ``reliable_beat_redispatch_backlog_check`` on), the sweep first looks at the stuck runs
    without claiming them and asks the broker how many messages wait ready in their queues:
    a queue holding at least as many as it would re-send there, with every such run younger
    than the backoff cap, is a backlog, not a loss (:func:`backlogged`): logged at INFO
    (``N runs look stuck but queue Q holds M ready messages: a backlog, not a loss; not
    re-sending``, once per ``redispatch_seconds`` per queue) and nothing is re-sent or
    counted for those runs. Without it, or when the probe fails: every stuck run is re-sent.

    ``destination``: the trigger destination whose payload shape ``publish`` reads
    (``celery``, ``dramatiq``), for runs re-sent without a trigger row.

    Returns:
        How many triggers were published again.
    """
    if not tasks:
        return 0
    after = timedelta(seconds=settings.redispatch_seconds)
    retrying_after = timedelta(seconds=settings.redispatch_seconds + settings.retry_cap_seconds)
    only_ids: set[int] | None = None
    if queue_depths is not None and settings.redispatch_backlog_check:
        only_ids = _hold_backlogged(store, settings, tasks, queue_depths, after=after,
                                    retrying_after=retrying_after,
                                    schedule_group=schedule_group, destination=destination)
        if not only_ids:
            return 0
    started = time.monotonic()
    with store.begin() as conn:
        now = store.now(conn)
        stuck = claim_stuck_runs(
            store, conn, now=now, after=after,
            tasks=tasks, limit=settings.batch_size,
            retrying_after=retrying_after,
            schedule_group=schedule_group, only_ids=only_ids, destination=destination,
        )
    if not stuck:
        return 0
    if time.monotonic() - started > after.total_seconds() / 2:
        # Paused between the claim and here: another process may have re-sent them since.
        stuck = _still_claimed(store, stuck, now)
        if not stuck:
            return 0
    log.warning(
        "re-sending %d triggers whose runs never started, whose worker died or whose retry "
        "never came (message lost by the broker or dropped by the framework?): %s",
        len(stuck), ", ".join(m.message_id for m in stuck[:5]),
    )
    # Their outbox rows are already `sent`: publish without re-marking them.
    outcomes = publish(stuck, now)
    expired = [
        m.run_id
        for m, (_, err) in zip(stuck, outcomes, strict=True)
        if isinstance(err, MessageExpiredError) and m.run_id is not None
    ]
    if expired:
        with store.begin() as conn:
            conn.execute(
                update(runs)
                .where(runs.c.id.in_(expired), runs.c.state == "dispatched")
                .values(state="skipped", reason="expired", updated_at=now)
            )
    return sum(1 for _, err in outcomes if err is None)
