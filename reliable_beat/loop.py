"""A framework-neutral beat loop driven through a :class:`Publisher` (design.md §4).

Each step: :meth:`reliable_beat.beat.Beat.tick` (one claim transaction, ``SKIP LOCKED``, the
database clock) commits the due slots' triggers to the outbox; the loop publishes them through
the adapter's :class:`Publisher` and marks the outcome (:func:`~reliable_beat.relay.mark_sent`
/ :func:`~reliable_beat.relay.mark_expired`); rows that could not be published stay
``pending`` for the sweep. Every :data:`SWEEP_SECONDS` it sweeps unsent trigger rows of its
destination and re-dispatches stuck runs of the tracked tasks
(:func:`~reliable_beat.redispatch.redispatch_with`). Any number of loops may run against one
store: the claim, not the process, decides who fires a slot.

This is the loop of the Dramatiq adapter (``reliable-beat dramatiq beat``). The Celery
adapter's :class:`~reliable_beat.celery.scheduler.ReliableScheduler` still carries its own
loop, which adds claim-ahead hold-and-flush and pipelined publishing (see docs/dramatiq.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from reliable_beat import relay as rb_relay
from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store
from reliable_beat.groups import DEFAULT_GROUP
from reliable_beat.outbox import OutboxMessage, db_now
from reliable_beat.redaction import get_logger
from reliable_beat.redispatch import redispatch_with
from reliable_beat.settings import Settings

__all__ = ["SWEEP_SECONDS", "BeatLoop", "Publisher", "publish_and_mark"]

log = get_logger("reliable_beat.loop")

#: How often a loop sweeps unsent trigger rows and re-dispatches stuck runs (seconds).
SWEEP_SECONDS = 5.0
#: Longest sleep between two ticks (seconds), so entries added at runtime are seen.
MAX_WAIT_SECONDS = 1.0


class Publisher(Protocol):
    """What a framework adapter gives the core loop.

    Attributes:
        destination: the outbox destination of its trigger rows (one of
            :data:`reliable_beat.beat.TRIGGER_DESTINATIONS`).
    """

    destination: str

    def publish(
        self, messages: Sequence[OutboxMessage], now: datetime
    ) -> list[tuple[int, BaseException | None]]:
        """Publish trigger rows (payload of :func:`reliable_beat.beat.build_trigger_payload`).

        Returns ``(outbox id, None or the error)`` per message, in order; never raises.
        :class:`~reliable_beat.handlers.MessageExpiredError` for a trigger past its
        ``expires_at``, :class:`~reliable_beat.handlers.DestinationUnavailableError` when the
        broker cannot be reached."""
        ...

    def tracked_tasks(self) -> Collection[str]:
        """Names of the tasks/actors that keep run state (idempotent ones)."""
        ...


def publish_and_mark(
    store: Store, publisher: Publisher, messages: list[OutboxMessage], now: datetime,
) -> int:
    """Publish ``messages`` and mark the outcome: sent rows ``sent`` (runs ``dispatched``),
    expired ones retired; failed rows stay ``pending`` (due at once) for a sweep or a relay.

    Returns:
        How many were published.
    """
    from reliable_beat.handlers import MessageExpiredError

    if not messages:
        return 0
    outcomes = publisher.publish(messages, now)
    sent = [i for i, err in outcomes if err is None]
    expired = [i for i, err in outcomes if isinstance(err, MessageExpiredError)]
    failed = [(i, err) for i, err in outcomes if err is not None and i not in expired]
    if failed:
        log.warning("%d triggers not published (%s); they stay in the outbox for the sweep",
                    len(failed), failed[0][1])
    with store.begin() as conn:
        if sent:
            rb_relay.mark_sent(conn, sent, now)
        if expired:
            rb_relay.mark_expired(conn, expired, now)
        if failed:
            from sqlalchemy import update

            from reliable_beat.db.tables import outbox

            conn.execute(update(outbox).where(
                outbox.c.id.in_([i for i, _ in failed]), outbox.c.state == "pending",
            ).values(available_at=now, claimed_by=None))
    return len(sent)


@dataclass
class BeatLoop:
    """The core beat loop: tick, publish, mark; sweep and re-dispatch every few seconds.

    Args:
        store: the store (its schema must be at head).
        settings: ``reliable_beat`` settings (batch size, redispatch, retry cap).
        publisher: the adapter's :class:`Publisher`.
        owner: this process's id (``host:pid``).
        is_tracked: task name -> True when it keeps run state (overlap policies other than
            ``allow`` need it); default: the publisher's :meth:`Publisher.tracked_tasks`.

    It fires only the entries of its schedule group (:attr:`schedule_group`) and group-less
    ones: another group's entries belong to another app (e.g. a Celery app on the same
    store), whose workers alone know their tasks.
    """

    store: Store
    settings: Settings
    publisher: Publisher
    owner: str
    is_tracked: Callable[[str], bool] | None = None
    _beat: Beat | None = field(default=None, repr=False)
    _last_sweep: float = field(default=float("-inf"), repr=False)

    @property
    def schedule_group(self) -> str:
        """``reliable_beat_schedule_group``, else :data:`~reliable_beat.groups.DEFAULT_GROUP`
        (the group its config entries are synced into)."""
        return self.settings.schedule_group or DEFAULT_GROUP

    @property
    def beat(self) -> Beat:
        if self._beat is None:
            tracked = self.is_tracked or (lambda t: t in set(self.publisher.tracked_tasks()))
            self._beat = Beat(
                store=self.store, owner=self.owner, batch_size=self.settings.batch_size,
                is_tracked=tracked, trigger_destination=self.publisher.destination,
                schedule_group=self.schedule_group,
            )
        return self._beat

    def step(self) -> float:
        """One tick + publish (+ a sweep when due). Returns seconds to sleep before the next."""
        import time

        result = self.beat.tick()
        now = result.now
        if result.triggers and now is not None:
            messages = [OutboxMessage(
                id=t.outbox_id, message_id="trigger:" + t.key,
                destination=self.publisher.destination, payload=t.payload, run_id=t.run_id,
            ) for t in result.triggers]
            publish_and_mark(self.store, self.publisher, messages, now)
        if time.monotonic() - self._last_sweep >= SWEEP_SECONDS:
            self._last_sweep = time.monotonic()
            self.sweep()
        if result.more or result.claimed:
            return 0.0
        if result.next_claim_at is not None and now is not None:
            return max(0.0, min(MAX_WAIT_SECONDS, (result.next_claim_at - now).total_seconds()))
        return MAX_WAIT_SECONDS

    def sweep(self) -> None:
        """Publish this destination's unsent trigger rows whose fast path failed or whose
        beat died, then re-send triggers of stuck tracked runs."""
        with self.store.begin() as conn:
            now = db_now(conn)
            unsent = rb_relay.claim_outbox_batch(
                self.store, conn, owner=self.owner, now=now, lease=timedelta(seconds=60),
                limit=self.settings.batch_size, destinations=[self.publisher.destination],
            )
        publish_and_mark(self.store, self.publisher, unsent, now)

        def publish(messages: list[OutboxMessage], at: datetime
                    ) -> list[tuple[int, BaseException | None]]:
            return self.publisher.publish(messages, at)

        redispatch_with(self.store, self.settings, list(self.publisher.tracked_tasks()), publish,
                        schedule_group=self.schedule_group)

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Step until ``stop`` is set; a failing step (database or broker down) is logged and
        retried after a second, never fatal."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                wait = self.step()
            except Exception:
                log.exception("beat step failed; retrying in 1s")
                wait = 1.0
            if wait > 0:
                stop.wait(wait)
