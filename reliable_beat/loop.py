"""The framework-neutral beat loop (design.md §4), driven through a :class:`Publisher`.

Both adapters run this loop: the Celery adapter's
:class:`~reliable_beat.celery.scheduler.ReliableScheduler` delegates Celery's scheduler hooks
(``setup_schedule``, ``tick``, ``info``, ``close``) to one :class:`BeatLoop` with a Celery
publisher; ``reliable-beat dramatiq beat`` runs one with a Dramatiq publisher
(:meth:`BeatLoop.run_forever`). What the loop does, for every adapter:

* **start** (:meth:`BeatLoop.start`): check the adapter's entry definitions on the local
  clock (a bad entry is reported at once, every problem named, and the process exits 2), then
  wait for the database and for its schema (a beat started before the database, or before a
  deploy's migration step, logs why and retries with backoff up to 30 s instead of exiting),
  then sync the definitions into its schedule group and record the beat;
* **claim** (:meth:`~reliable_beat.beat.Beat.tick`: one transaction, ``SKIP LOCKED``, the
  database clock) once the earliest entry's claim moment has come, a NOTIFY arrived, or the
  last claim took a full batch;
* **publish at once** the triggers already due (the fast path; they have no outbox row, their
  runs are their record: :mod:`reliable_beat.unsent`) and mark the outcome (run
  ``dispatched`` / expired / a row for the sweep); a fast path that comes late (paused past
  half the sweep delay) first **takes back** the runs untouched since its claim;
* **hold and flush**: with ``reliable_beat_claim_ahead_seconds`` A > 0 a claim also takes the
  ``allow`` entries whose slot is at most A away and commits their runs and triggers; the
  triggers are held in memory, grouped by slot, and each group is published at the slot's
  instant (a :class:`HoldingPublisher` builds the batch a moment before and flushes it at
  the instant; any other publisher is called at the instant). A hold that overran takes back
  its rows first, like the fast path; a stop publishes what is held, each group at its slot;
* **sweep** every :data:`SWEEP_SECONDS`: write the rows of due triggers never published (a
  beat died between commit and publish), publish this destination's trigger rows left
  unsent (those, a broker that was down), then re-dispatch stuck runs of the tracked tasks
  (:func:`~reliable_beat.redispatch.redispatch_with`) and refresh the beat's heartbeat;
* **wait** until the next thing to do: on PostgreSQL on ``LISTEN reliable_beat_entries``
  (woken early by a NOTIFY when entries change), else asleep; bounded by ``max_interval``
  and :data:`SWEEP_SECONDS` (:data:`SQLITE_MAX_WAIT_SECONDS` without NOTIFY).

Published triggers whose ``sent`` mark could not be written (the database went away) are
recorded first when it returns, before any claim or sweep of this beat. SIGTERM / SIGINT are
held back from a claim until its triggers are marked or held (their Python handlers swapped
for a recorder: :func:`deferred_stop_signals`), and a round with a stop pending starts no
further claim. Any number of loops may run against
one store: the claim, not the process, decides who fires a slot.

What an adapter adds: its :class:`Publisher` (how a trigger row becomes a message of its
framework), which tasks are tracked and registered, its entry definitions, its logger name
and how the process is driven (Celery's beat service; a plain loop for Dramatiq).

The publisher port and its helpers live in :mod:`reliable_beat.publish`; the process side
(start, stop signals, the LISTEN wait) in :mod:`reliable_beat.process`, the base class of
:class:`BeatLoop`. Their names are importable from here too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import DBAPIError

from reliable_beat import tracing, unsent
from reliable_beat.beat import Beat, TickResult
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.entries import EntryDefinition, park_reason, sync_schedule_group
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.groups import (
    DEFAULT_GROUP,
    beat_heartbeat,
    beat_stopped,
    log_sync_result,
    record_beat,
)
from reliable_beat.handlers import MessageExpiredError
from reliable_beat.logs import RepeatedLog, event
from reliable_beat.outbox import OutboxMessage
from reliable_beat.process import (
    STOP_SIGNALS,
    BeatProcess,
    deferred_stop_signals,
    freeze_heap,
    thaw_heap,
)
from reliable_beat.process import skip_exit_gc as skip_exit_gc
from reliable_beat.publish import SPIN_SECONDS as SPIN_SECONDS
from reliable_beat.publish import HoldingPublisher, Publisher, record_unmarked, send_batch
from reliable_beat.publish import sleep_until as sleep_until
from reliable_beat.publish import trigger_messages as trigger_messages
from reliable_beat.redaction import get_logger
from reliable_beat.redispatch import redispatch_with
from reliable_beat.relay import claim_outbox_batch, mark_expired, mark_sent
from reliable_beat.retention import RetentionThread
from reliable_beat.rows import inconsistent_next_fire, quarantine_inconsistent_next_fire
from reliable_beat.settings import Settings
from reliable_beat.slots import format_fire_at
from reliable_beat.triggers import Trigger, trigger_identity

__all__ = [
    "STOP_SIGNALS",
    "SWEEP_SECONDS",
    "BeatLoop",
    "HoldingPublisher",
    "Publisher",
    "deferred_stop_signals",
    "publish_and_mark",
    "record_unmarked",
]

log = get_logger("reliable_beat.loop")

#: How often a loop sweeps unsent trigger rows and re-dispatches stuck runs (seconds).
SWEEP_SECONDS = 5.0
#: How often a loop's sweep checks its entries' ``next_fire_at`` against their schedules and
#: quarantines one no beat would ever claim (:func:`reliable_beat.rows.
#: quarantine_inconsistent_next_fire`; seconds).
NEXT_FIRE_CHECK_SECONDS = 300.0
#: How long a sweep's claim of a trigger row lasts before another sweep may take it.
SWEEP_LEASE = timedelta(seconds=60)
#: While published triggers wait for their "sent" mark (database gone), retry this often.
UNMARKED_RETRY_SECONDS = 1.0
#: Default wait bound on SQLite, which has no NOTIFY: entries added at runtime are seen
#: within this many seconds.
SQLITE_MAX_WAIT_SECONDS = 1.0
#: Default ``max_interval`` of a loop not driven by Celery (the Dramatiq beat): the longest
#: wait between two looks, so a stop and runtime entries are seen within a second.
MAX_WAIT_SECONDS = 1.0
#: A claim found entries claimable by the clock but took none (another beat holds their
#: row locks and commits in a moment): look again after this many seconds, do not spin.
LOCKED_RETRY_SECONDS = 0.005
#: A held slot's messages start being built this long (plus twice the measured build time
#: per message) before its instant, so the batch is ready to flush at the instant.
BUILD_LEAD_SECONDS = 0.002


def publish_and_mark(
    store: Store, publisher: Publisher, messages: list[OutboxMessage], now: datetime, *,
    wait: Callable[[], None] | None = None,
    unmarked: list[tuple[list[int], list[int]]] | None = None,
    logger: logging.Logger | None = None, published: list[int] | None = None,
) -> int:
    """Publish trigger rows through ``publisher`` and mark the outcome.

    Sent rows become ``sent`` (their runs ``dispatched``); expired ones are retired
    (:func:`~reliable_beat.relay.mark_expired`); rows that could not be published are handed
    to the sweep / relay at once (``available_at = now``). Nothing is lost if this process
    dies at any point: a row not marked sent is swept after ``available_at``.

    A negative id is a trigger with no outbox row (its run's id negated): its run is marked
    the same way, and if it was not published its row is written now
    (:func:`~reliable_beat.unsent.hand_back`).

    Args:
        now: the store's clock at the publish (UTC), for the ``expires_at`` check.
        wait: called right before the first message can reach the broker (the loop sleeps
            there until the slot of triggers it claimed ahead).
        unmarked: when the marks cannot be written (database gone), ``(sent ids, expired
            ids)`` is appended here so the caller records them first when the database
            returns (:func:`record_unmarked`); None: they are only logged.
        logger: where to log (default ``reliable_beat.loop``).
        published: when given, the ids of the messages the broker accepted are appended.

    Returns:
        How many were published.
    """
    logger = logger or log
    if not messages:
        return 0
    spans = tracing.PublishSpans.of(messages, publisher.destination)
    if spans is not None:  # a `send` span per trigger, in its slot's trace
        if wait is None:
            spans.start()
        else:
            wait = spans.after(wait)
    outcomes = send_batch(publisher, messages, now, wait)
    if spans is not None:
        spans.end(outcomes)
    sent = [i for i, err in outcomes if err is None]
    if published is not None:
        published.extend(sent)
    expired = [i for i, err in outcomes if isinstance(err, MessageExpiredError)]
    failed = [i for i, err in outcomes if err is not None and i not in expired]
    if failed:
        logger.warning("%d triggers not published (%s); they wait in the outbox for the relay",
                       len(failed), next(err for _, err in outcomes if err is not None))
    try:
        with store.begin() as conn:
            at = store.now(conn)
            mark_sent(conn, sent, at)
            mark_expired(conn, expired, at)
            if failed:
                unsent.hand_back(store, conn, failed, messages, at)
    except (StoreUnavailableError, DBAPIError) as exc:
        # Published but not marked. The caller (a beat) records them first when the database
        # returns; without one a sweep re-sends them later (at least once, same message id).
        logger.error("could not mark %d triggers sent (%s)%s", len(sent), exc,
                     "; recording them first when the database returns"
                     if unmarked is not None else "")
        if unmarked is not None and (sent or expired):
            unmarked.append((sent, expired))
    return len(sent)


class _HoldOverran(BaseException):
    """Raised inside a publish to abandon a held batch whose instant is long past.

    A ``BaseException`` so the publishers' ``except Exception`` do not turn it into a broker
    failure: it unwinds the batch (which discards the buffered messages).
    """


@dataclass
class _Held:
    """Committed triggers of one slot, claimed ahead, waiting for the slot's instant.

    Attributes:
        fire_at: the slot (UTC, database clock).
        at: ``time.monotonic()`` of this process at which the database clock reaches
            ``fire_at`` (never before it: see :attr:`TickResult.monotonic`).
        triggers: the committed triggers of that slot.
    """

    fire_at: datetime
    at: float
    triggers: list[Trigger]


class BeatLoop(BeatProcess):
    """The core beat loop (see the module docstring): one per beat process.

    Args:
        store: the store.
        settings: ``reliable_beat`` settings (batch size, claim-ahead, redispatch, ...).
        publisher: the adapter's :class:`Publisher`.
        owner: this process's id (default ``settings.owner``, ``host:pid``).
        is_tracked: task name -> True when it keeps run state (overlap policies other than
            ``allow`` need it); default: the publisher's :meth:`Publisher.tracked_tasks`.
        schedule_group: the group it fires (its own and group-less entries) and syncs its
            definitions into; default ``reliable_beat_schedule_group``, else
            :data:`~reliable_beat.groups.DEFAULT_GROUP`.
        definitions: ``now -> [EntryDefinition]``, the adapter's configured entries (may
            raise ``ConfigurationError`` naming every bad one); None: :meth:`start` syncs
            nothing.
        is_registered: task name -> True when this process's app knows it (an entry whose
            task it does not know is logged at start and recorded for ``status``).
        max_interval: the longest wait between two looks (seconds).
        logger: where the loop logs (the Celery adapter keeps ``reliable_beat.scheduler``).
    """

    def __init__(
        self, store: Store, settings: Settings, publisher: Publisher, owner: str | None = None,
        is_tracked: Callable[[str], bool] | None = None, *,
        schedule_group: str | None = None,
        definitions: Callable[[datetime], list[EntryDefinition]] | None = None,
        is_registered: Callable[[str], bool] | None = None,
        max_interval: float = MAX_WAIT_SECONDS,
        logger: logging.Logger | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.publisher = publisher
        self.owner = owner or settings.owner
        self.group = schedule_group or settings.schedule_group or DEFAULT_GROUP
        self.definitions = definitions
        self.is_registered = is_registered
        self.max_interval = max_interval
        self.log = logger or log
        self.stop_event: threading.Event | None = None
        self._listen: Any = None
        self._retention: RetentionThread | None = None
        self._metrics: Any = None
        self._failures = 0
        self._last_sweep = 0.0
        self._last_next_fire_check = 0.0
        self._tick_started = time.monotonic()
        self._claim_at = 0.0  # monotonic instant of the next claim
        self._held: dict[datetime, _Held] = {}
        self._closed = False
        # a pipe that ends a LISTEN wait when a stop is asked (request_stop), made on first use
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._clock: tuple[datetime, float] | None = None  # (database now, monotonic)
        self._build_seconds_per_message = 0.0005
        # Triggers this beat published but could not mark sent (database gone): recorded
        # before anything else when the database returns; no sweep runs meanwhile.
        self._unmarked: list[tuple[list[int], list[int]]] = []
        self._still_unmarked = RepeatedLog(self.log)
        # No sweep before this monotonic instant: after the database returns, a beat gives
        # the beats that published during the outage a sweep delay to record their marks.
        self._sweep_not_before = 0.0
        tracked = is_tracked or (lambda t: t in set(publisher.tracked_tasks()))
        self._beat = Beat(
            store, owner=self.owner, batch_size=settings.batch_size, is_tracked=tracked,
            claim_ahead=timedelta(seconds=settings.claim_ahead_seconds),
            trigger_destination=publisher.destination, schedule_group=self.group,
        )

    @property
    def schedule_group(self) -> str:
        """The schedule group this loop fires and syncs into."""
        return self.group

    @property
    def beat(self) -> Beat:
        """The claim side (:class:`~reliable_beat.beat.Beat`)."""
        return self._beat

    # -- sync (start, the LISTEN wait, request_stop: BeatProcess, reliable_beat.process) ---
    def sync(self, now: datetime) -> None:
        """Sync the definitions at ``now`` into the schedule group and record this beat."""
        definitions = self.check_definitions(now)
        self._sync(definitions, self._unregistered(definitions))

    def _sync(self, definitions: list[EntryDefinition], unregistered: dict[str, str]) -> None:
        result = sync_schedule_group(
            self.store, definitions, group=self.group, owner=self.owner,
            unregistered=unregistered if self.is_registered is not None else None)
        log_sync_result(self.log, result, self.store.safe_url)
        for name, task in sorted(unregistered.items()):
            if name in result.parked:
                self.log.error("entry %r: %s", name, park_reason(task))
            else:  # this beat's config was not synced (an older one): the group's stands
                self.log.error("entry %r: task %r is not registered in this beat's app: "
                               "unless a worker registers it, its triggers are dropped (check "
                               "the name, or import the task module in this app)", name, task)
        record_beat(self.store, owner=self.owner, group=self.group,
                    config_hash=result.config_hash, unregistered=unregistered,
                    destinations=[self.publisher.destination])

    # -- the loop --------------------------------------------------------------------------
    #
    # Each tick() does what is due, then waits (on LISTEN, or by sleeping) until the next
    # thing to do, bounded by max_interval and SWEEP_SECONDS:
    #
    # * publish the held triggers whose instant has come (claimed ahead, see below);
    # * claim, once the earliest claimable entry's claim moment has come (``next_claim_at``
    #   of the last tick, on the database clock), a NOTIFY arrived, or the last claim took a
    #   full batch;
    # * sweep unsent triggers and re-dispatch lost runs, every SWEEP_SECONDS.
    #
    # Claim ahead: with ``reliable_beat_claim_ahead_seconds`` A > 0, a claim also takes the
    # ``allow`` entries whose next slot is at most A away and commits their runs and trigger
    # rows at once (the triggers' ``available_at`` is slot + sweep delay). The triggers are
    # held in memory, grouped by slot, each with the monotonic instant at which the database
    # clock reaches the slot (``TickResult.monotonic`` is taken after the clock was read, so
    # that instant is never early). A moment before it the group's messages are built into
    # one batch (a Redis pipeline for Celery); at it the batch is flushed: every message of
    # the slot leaves at once, none before the slot.

    def tick(self) -> float:
        """Publish held triggers that are due, claim if it is time, sweep; then wait.

        Returns seconds for the caller to sleep (0 when this call already waited).

        SIGTERM / SIGINT are held back (:func:`deferred_stop_signals`) from a claim until its
        triggers are marked sent or held, so a graceful stop never splits a commit from its
        publish; the signal is delivered right after, and once one is pending the round
        starts no further claim. A stop that arrives while triggers claimed ahead are held
        publishes each group at its slot's instant (at most the claim-ahead away). Only
        SIGKILL can leave committed triggers unsent, and then the sweep of another beat (or a
        relay) publishes them after slot + sweep delay, under the same message ids.
        """
        try:
            with deferred_stop_signals() as stopping:
                self._step(stopping)
            return self._idle()
        except BaseException:
            if self._held:
                with deferred_stop_signals():
                    self._drain_held()
            raise

    def step(self) -> float:
        """One round without the wait: publish held triggers that are due, claim if it is
        time, sweep when due. Returns seconds until the next thing to do (never waits)."""
        with deferred_stop_signals() as stopping:
            self._step(stopping)
        return max(0.0, self._wake_at() - time.monotonic())

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """:meth:`tick` until ``stop`` is set, then :meth:`close` (held triggers go out at
        their slots). A failing round (database or broker down in an unexpected place) is
        logged and retried after a second, never fatal. Call :meth:`start` first."""
        stop = stop or threading.Event()
        self.stop_event = stop
        try:
            while not stop.is_set():
                try:
                    wait = self.tick()
                except Exception:
                    self.log.exception("beat step failed; retrying in 1s")
                    wait = 1.0
                if wait > 0:
                    stop.wait(wait)
        finally:
            self.close()

    def _step(self, stopping: Sequence[object] = ()) -> None:
        """One round (see :meth:`tick`). ``stopping``: the stop signals held back so far;
        once one is (or :attr:`stop_event` is set) no further claim starts: a beat asked to
        stop takes no new slot, so its stop waits only for what it already holds."""
        self._publish_held(drain=False)  # committed already: they need no database to leave
        if self._unmarked:
            # Published but not marked sent (the database was gone): record that first. Until
            # it is recorded, no claim and no sweep (this beat's own sweep would re-send them).
            if time.monotonic() < self._claim_at:
                return
            if not record_unmarked(self.store, self._unmarked, repeated=self._still_unmarked,
                                   logger=self.log):
                self._claim_at = time.monotonic() + UNMARKED_RETRY_SECONDS
                return
        claims = 0
        while time.monotonic() >= self._claim_at and claims < 10:
            if stopping or (self.stop_event is not None and self.stop_event.is_set()):
                break
            claims += 1
            outcome = self._claim()
            if isinstance(outcome, float):  # the store is down: retry later
                self._claim_at = time.monotonic() + outcome
                break
            self._publish_held(drain=False)
        try:
            self._sweep()
        except (StoreUnavailableError, DBAPIError) as exc:
            self.log.error("trigger sweep failed (%s); retrying on a later tick", exc)

    def _claim(self) -> TickResult | float:
        """One claim transaction; publish the triggers already due, hold the others."""
        self._tick_started = time.monotonic()
        try:
            result = self._beat.tick()
        except (StoreUnavailableError, DBAPIError) as exc:
            self._failures += 1
            wait: float = min(30.0, 0.5 * 2.0 ** min(self._failures, 6))
            self.log.error("tick failed: %s; retrying in %.1f s. Slots due meanwhile are "
                           "decided by the misfire policy when it returns.",
                           self.store.describe_failure(exc), wait)
            return wait
        if self._failures:
            # Back after an outage: other beats may hold published-but-unmarked triggers.
            self._sweep_not_before = time.monotonic() + self._beat.sweep_delay.total_seconds()
        self._failures = 0
        assert result.now is not None
        self._clock = (result.now, result.monotonic)
        ahead = result.ahead
        if ahead:
            ids = {t.id for t in ahead}
            for t in ahead:
                group = self._held.get(t.fire_at)
                if group is None:
                    at = result.monotonic + (t.fire_at - result.now).total_seconds()
                    group = self._held[t.fire_at] = _Held(t.fire_at, at, [])
                group.triggers.append(t)
            due = [t for t in result.triggers if t.id not in ids]
            result = replace(result, triggers=due)
        if result.triggers or result.skipped or result.duplicates:
            self._publish(result)
        if result.claimed:
            freeze_heap()  # once per process: its long-lived objects exist now
        self._claim_at = self._next_claim(result)
        return result

    def _bound(self) -> float:
        """Longest wait between two claims: runtime entries and buffered runs are found at
        least this often even without a NOTIFY (always on SQLite, which has none)."""
        bound = min(float(self.max_interval), SWEEP_SECONDS)
        if self.store.dialect != "postgresql":
            bound = min(bound, SQLITE_MAX_WAIT_SECONDS)
        return bound

    def _next_claim(self, result: TickResult) -> float:
        """The monotonic instant of the next claim."""
        now = time.monotonic()
        if result.claimed >= self.settings.batch_size or result.more:
            return now  # more claimable entries are waiting
        latest = now + self._bound()
        if result.next_claim_at is None:
            return latest
        assert result.now is not None
        at = result.monotonic + (result.next_claim_at - result.now).total_seconds()
        if at <= now and not result.claimed:
            # Claimable by the clock but nothing was claimed: another beat holds those rows
            # (SKIP LOCKED) and commits in a moment. Look again shortly instead of spinning.
            return now + LOCKED_RETRY_SECONDS
        return min(at, latest)

    def _build_lead(self, group: _Held) -> float:
        """Seconds before its instant to start building a held group's messages."""
        return BUILD_LEAD_SECONDS + 2.0 * self._build_seconds_per_message * len(group.triggers)

    def _publish_held(self, *, drain: bool) -> None:
        """Publish the held groups whose build moment has come (``drain``: every group), each
        flushed at its instant, oldest first."""
        while self._held:
            group = min(self._held.values(), key=lambda g: g.at)
            if not drain and time.monotonic() < group.at - self._build_lead(group):
                return
            del self._held[group.fire_at]
            self._publish_group(group)

    def _drain_held(self) -> None:
        """On the way out: every held group, each at its instant (the hold is at most the
        claim-ahead); a failure leaves the rest to the sweep."""
        self.log.info("reliable_beat: stopping; publishing %d held triggers at their slots",
                      sum(len(g.triggers) for g in self._held.values()))
        try:
            self._publish_held(drain=True)
        except Exception as exc:
            self.log.error("could not publish held triggers on stop (%s); the sweep sends "
                           "them after their slot + %s", exc, self._beat.sweep_delay)
        self._held.clear()

    def _publish_triggers(self, triggers: list[Trigger], now: datetime,
                          wait: Callable[[], None] | None = None) -> list[Trigger]:
        """Publish and mark ``triggers``; returns those the broker accepted."""
        sent: list[int] = []
        publish_and_mark(
            self.store, self.publisher, trigger_messages(triggers, self.publisher.destination),
            now, wait=wait, unmarked=self._unmarked, logger=self.log, published=sent)
        return [t for t in triggers if t.id in set(sent)]

    def _publish_group(self, group: _Held) -> None:
        """Publish one held slot: build its messages, flush them at its instant, mark sent.

        A hold that overran (this process was paused or starved for longer than half the
        sweep delay, e.g. SIGSTOP) does not publish blindly: another beat's sweep may have
        published those rows already. It first takes back, in one statement, the rows still
        pending under its own name (pushing their ``available_at`` a sweep delay on, so no
        sweep takes them meanwhile) and publishes only those.
        """
        started = time.monotonic()
        built: list[float] = []
        overrun = self._beat.sweep_delay.total_seconds() / 2

        def at_instant() -> None:
            built.append(time.monotonic())
            sleep_until(group.at)
            if time.monotonic() - group.at > overrun:
                raise _HoldOverran  # the buffered batch is discarded: nothing was sent

        triggers = group.triggers
        try:
            if time.monotonic() - group.at > overrun:
                raise _HoldOverran
            triggers = self._publish_triggers(triggers, self._db_now(group.fire_at),
                                              wait=at_instant)
        except _HoldOverran:
            triggers = self._take_back(triggers)
            self.log.warning("held triggers of %s published %.1f s late (this process was "
                             "paused); %d of %d still pending under this beat",
                             format_fire_at(group.fire_at), time.monotonic() - group.at,
                             len(triggers), len(group.triggers))
            built.clear()
            if triggers:
                triggers = self._publish_triggers(triggers, self._db_now(group.fire_at))
        if built:
            per = (built[0] - started) / max(1, len(triggers))
            self._build_seconds_per_message += 0.2 * (per - self._build_seconds_per_message)
        done = time.monotonic()
        for t in triggers if self.log.isEnabledFor(logging.INFO) else ():
            ident = trigger_identity(t.payload)
            event(self.log, logging.INFO, "slot.fired", entry=ident["entry"],
                  fire_at=ident["fire_at"], key=t.key, task=t.payload["task"],
                  claimed_ahead=True)
        # built_ms: the time taken to build the messages (never negative); ready_ahead_ms:
        # how long before the instant they were ready (they left at it; 0 when late);
        # marked_ms: the instant to the rows marked sent.
        event(self.log, logging.INFO, "slots.published", fire_at=format_fire_at(group.fire_at),
              count=len(triggers),
              built_ms=round(max(0.0, built[0] - started) * 1000, 2) if built else None,
              ready_ahead_ms=round(max(0.0, group.at - built[0]) * 1000, 2) if built else None,
              marked_ms=round((done - group.at) * 1000, 2), claimed_ahead=True)

    def _db_now(self, at_least: datetime) -> datetime:
        """The database clock estimated from the last claim (never behind ``at_least``)."""
        assert self._clock is not None
        now, mono = self._clock
        return max(at_least, now + timedelta(seconds=time.monotonic() - mono))

    def _take_back(self, triggers: list[Trigger],
                   claimed_at: datetime | None = None) -> list[Trigger]:
        """The triggers still this beat's to publish (rows pending under its name; row-less
        ones: runs untouched since the claim at ``claimed_at``, :func:`~reliable_beat.unsent.
        take_back_runs`), re-leased for a sweep delay; the others were swept meanwhile."""
        ids = self._take_back_ids([t.outbox_id for t in triggers if t.outbox_id is not None])
        runs_back = unsent.take_back_runs(
            self.store, [t.run_id for t in triggers if t.outbox_id is None], claimed_at)
        return [t for t in triggers
                if (t.outbox_id in ids if t.outbox_id is not None else t.run_id in runs_back)]

    def _take_back_ids(self, outbox_ids: list[int]) -> set[int]:
        """The ids of ``outbox_ids`` still ``pending`` and claimed by this beat, re-leased for
        a sweep delay from now; empty when the database is unavailable."""
        if not outbox_ids:
            return set()
        try:
            with self.store.begin() as conn:
                now = self.store.now(conn)
                return set(conn.execute(
                    update(outbox)
                    .where(outbox.c.id.in_(outbox_ids),
                           outbox.c.state == "pending",
                           outbox.c.claimed_by == self.owner)
                    .values(available_at=now + self._beat.sweep_delay)
                    .returning(outbox.c.id)
                ).scalars())
        except (StoreUnavailableError, DBAPIError) as exc:
            self.log.error("could not take back late triggers (%s); a sweep sends them", exc)
            return set()

    def _overran(self, since: float) -> bool:
        """True when more than half the sweep delay passed since the monotonic ``since``
        (this process was paused or starved: a sweep may have taken its rows meanwhile)."""
        return time.monotonic() - since > self._beat.sweep_delay.total_seconds() / 2

    def _publish(self, result: TickResult) -> None:
        """The fast path right after the claim's commit. A publish that comes late (this
        process was paused between the commit and here) first takes back its triggers not
        swept meanwhile, like a held slot that overran, and publishes only those."""
        assert result.now is not None
        triggers = result.triggers
        if triggers and self._overran(result.monotonic):
            triggers = self._take_back(triggers, result.now)
            self.log.warning("triggers claimed at %s published %.1f s after the claim (this "
                             "process was paused); %d of %d still pending under this beat",
                             format_fire_at(result.now), time.monotonic() - result.monotonic,
                             len(triggers), len(result.triggers))
        published = time.monotonic()  # the messages leave right after this
        if triggers:
            triggers = self._publish_triggers(triggers, result.now)
        for t in triggers if self.log.isEnabledFor(logging.INFO) else ():
            # true lateness: slot -> publish, on the database clock estimated from the claim
            lateness = (result.now - t.fire_at).total_seconds() + (published - result.monotonic)
            ident = trigger_identity(t.payload)
            event(self.log, logging.INFO, "slot.fired", entry=ident["entry"],
                  fire_at=ident["fire_at"], key=t.key, task=t.payload["task"],
                  claim_lateness_ms=round((result.now - t.fire_at).total_seconds() * 1000, 1),
                  lateness_ms=round(lateness * 1000, 1))
        if triggers:
            # one event per slot, like a held slot's (the non-held path publishes the slots
            # already due at the claim: usually one, several after a catch-up)
            done = time.monotonic()
            per_slot: dict[datetime, int] = {}
            for t in triggers:
                per_slot[t.fire_at] = per_slot.get(t.fire_at, 0) + 1
            for fire_at, count in sorted(per_slot.items()):
                event(self.log, logging.INFO, "slots.published", fire_at=format_fire_at(fire_at),
                      count=count, claimed_ahead=False,
                      published_ms=round((done - published) * 1000, 2))
        if result.skipped:
            event(self.log, logging.INFO, "slots.skipped", count=result.skipped)
        if result.duplicates:
            event(self.log, logging.INFO, "slots.already_fired", count=result.duplicates)

    def sweep(self) -> None:
        """Sweep now (see :meth:`_sweep`), whenever the last one was."""
        self._last_sweep = 0.0
        self._last_next_fire_check = 0.0
        self._sweep_not_before = 0.0
        self._sweep()

    def _sweep(self) -> None:
        """Publish triggers whose fast path never happened (a beat died between commit and
        publish: :func:`~reliable_beat.unsent.materialise_unsent` first; or the broker was
        down). A relay does the same; the beat does it too so plain-task users without a relay
        lose nothing. At most every ``SWEEP_SECONDS``."""
        now_mono = time.monotonic()
        if now_mono - self._last_sweep < SWEEP_SECONDS or now_mono < self._sweep_not_before:
            return
        self._last_sweep = now_mono
        with self.store.begin() as conn:
            now = self.store.now(conn)
            # their trigger rows first, so this same claim publishes them
            unsent.materialise_unsent(
                self.store, conn, now=now, sweep_delay=self._beat.sweep_delay,
                destination=self.publisher.destination, schedule_group=self.group,
                limit=self.settings.batch_size)
            messages = claim_outbox_batch(
                self.store, conn, owner=self.owner, now=now,
                lease=SWEEP_LEASE, limit=self.settings.batch_size,
                destinations=[self.publisher.destination], schedule_group=self.group,
            )
        claimed = time.monotonic()
        if messages and claimed - now_mono > SWEEP_LEASE.total_seconds() / 2:
            # Paused between the claim and here: another sweep may own them by now.
            ids = self._take_back_ids([m.id for m in messages])
            messages = [m for m in messages if m.id in ids]
        if messages:
            self.log.warning("sweeping %d unsent triggers", len(messages))
            publish_and_mark(self.store, self.publisher, messages, now,
                             unmarked=self._unmarked, logger=self.log)
        self.redispatch()
        self._check_next_fire(now_mono)
        beat_heartbeat(self.store, self.owner, self.group)

    def _check_next_fire(self, now_mono: float) -> None:
        """Every :data:`NEXT_FIRE_CHECK_SECONDS`: quarantine this group's active entries
        whose ``next_fire_at`` no beat would ever claim as it is (NULL while the schedule
        has a next slot, or far beyond it: a row changed by SQL), as a malformed column is
        quarantined; each is logged at ERROR once, naming the entry and the fix
        (``reliable-beat entries resume NAME`` recomputes it). A failure is logged, never
        stops the sweep."""
        if now_mono - self._last_next_fire_check < NEXT_FIRE_CHECK_SECONDS:
            return
        self._last_next_fire_check = now_mono
        groups = [self.group, None]
        try:
            # read first, write only when there is something to quarantine: the check reads
            # every active entry not due within minutes (about 0.3 s at 20,000 crons on
            # SQLite), which must not hold SQLite's write lock
            with self.store.engine.connect() as conn:
                found = inconsistent_next_fire(conn, self.store.now(conn), groups=groups)
            if found:
                with self.store.begin() as conn:  # checked again in the transaction
                    quarantine_inconsistent_next_fire(conn, self.store.now(conn),
                                                      groups=groups)
        except Exception as exc:
            self.log.error("next_fire_at check failed (%s); retrying in %.0f s", exc,
                           NEXT_FIRE_CHECK_SECONDS)

    def redispatch(self) -> int:
        """Re-send the triggers of this group's stuck runs of the tracked tasks
        (:func:`~reliable_beat.redispatch.redispatch_with`). Returns how many."""
        return redispatch_with(self.store, self.settings, list(self.publisher.tracked_tasks()),
                               self.publisher.publish, schedule_group=self.group,
                               # optional: a publisher that can ask its broker (backlog check)
                               queue_depths=getattr(self.publisher, "queue_depths", None),
                               destination=getattr(self.publisher, "destination", "celery"))

    def _wake_at(self) -> float:
        """The monotonic instant of the next thing to do."""
        wake = min(self._claim_at, time.monotonic() + self._bound())
        for group in self._held.values():
            wake = min(wake, group.at - self._build_lead(group))
        return wake

    def _idle(self) -> float:
        """Wait until the next thing to do; returns what is left for the caller to sleep."""
        # Wake at least every SWEEP_SECONDS so the sweep of unsent triggers and the
        # re-dispatch of lost ones run even when no entry is due for a long time.
        wait = self._wake_at() - time.monotonic()
        if wait <= 0.0005:
            return 0.0
        if self.store.dialect == "postgresql":
            if self._wait_for_notify(wait):
                self._claim_at = 0.0  # entries changed: claim at once
            return 0.0
        if self._held:
            self._sleep(wait)  # here, not in the caller: a stop must find the held ones
            return 0.0
        return wait

    def close(self) -> None:
        """Publish any triggers still held (each at its slot, at most the claim-ahead away),
        then release the LISTEN connection, record the stop and dispose of the pool.

        Idempotent: Celery's beat calls it twice on a SIGTERM (its signal handler's
        ``Service.sync()``, then the service's ``finally``); the second call does nothing.
        Each step's time is logged at DEBUG (``stop: ... ms``), to see where a stop goes."""
        if self._closed:
            return
        self._closed = True
        started = time.monotonic()

        def step(what: str) -> None:
            self.log.debug("reliable_beat: stop: %s at %.1f ms", what,
                           (time.monotonic() - started) * 1000)

        if self._held:
            with deferred_stop_signals():
                self._drain_held()
            step("held triggers published")
        if self._listen is not None:
            with contextlib.suppress(Exception):
                self._listen.close()
            self._listen = None
            step("LISTEN connection closed")
        with contextlib.suppress(Exception):
            beat_stopped(self.store, self.owner)
        step("stop recorded")
        if self._retention is not None:
            self._retention.stop()
            self._retention = None
            step("retention thread joined")
        self.store.dispose()
        step("pool disposed")
        thaw_heap()
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = None
