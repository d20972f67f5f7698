"""The outbox relay: claim due rows, deliver them, mark them sent / back off / dead-letter.

One cycle (:meth:`Relay.run_once`)::

    1. claim   (short txn)  UPDATE outbox SET claimed_by, attempts = attempts + 1,
                                   available_at = now + claim lease
                            WHERE id IN (SELECT id ... pending, due, ordering rule,
                                         ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED)
                              [AND within the byte budget: running sum of payload sizes]
                            RETURNING *
    2. deliver (no txn)     per destination; batches over one connection where the handler can
    3. settle  (short txns) sent -> state sent (+ the trigger's run scheduled -> dispatched)
                            failed -> available_at = now + full-jitter backoff
                            permanent / attempts exhausted -> dead + dead-letter row

Guarantees (safe with any number of relays, threads or processes, on PostgreSQL; on SQLite
the claim runs under ``BEGIN IMMEDIATE``, which serialises claimers on the one host):

* **At least once.** A row leaves ``pending`` only after its handler returned. A relay that
  dies between delivery and step 3 leaves the row claimed; when the claim lease expires
  (``claim_lease_seconds``) another relay claims and delivers it again, with the same
  ``message_id``. Deduplication is the far end's job (Celery task ids, ``Idempotency-Key``,
  ``Message-ID``); at least once + a stable key = effectively once there.
* **No duplicates from claiming.** ``FOR UPDATE SKIP LOCKED`` plus the lease: two live relays
  never hold the same row at once.
* **Ordering keys.** A row is not claimable while a row with the same ``ordering_key`` and a
  lower id is still ``pending`` (claimed, backing off or due), so at most one row per key
  is in flight and a later one never goes before an earlier one is ``sent`` or ``dead``.
  Rows inserted by concurrent, still-uncommitted transactions have no defined order.
* **One poison row never blocks the others** (except its own ordering-key successors): it
  backs off alone, then is dead-lettered.
* **A destination outage never dead-letters.** :class:`~reliable_beat.handlers.
  DestinationUnavailableError` releases the batch with a per-destination backoff and gives
  the attempt back.
* **Expired triggers.** A ``celery`` row whose payload ``expires_at`` passed is not
  published: it is marked ``sent`` with ``last_error = "expired before publish"`` and its run
  goes ``scheduled -> skipped`` with reason ``expired``.
* **Retention.** ``sent`` rows older than ``outbox_retention_seconds`` are deleted, at most
  1000 per pass and one pass a minute per relay; ``dead`` rows are kept until a person acts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.engine import Connection

from reliable_beat import tracing, unsent
from reliable_beat.adapters import adapter_for, app_settings
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters, outbox
from reliable_beat.errors import PermanentDeliveryError, StoreUnavailableError
from reliable_beat.groups import (
    record_relay,
    relay_forget,
    relay_heartbeat,
    relay_stopped,
    schedule_group_of,
)
from reliable_beat.handlers import (
    DestinationUnavailableError,
    MessageExpiredError,
    load_handlers,
)
from reliable_beat.logs import RepeatedLog
from reliable_beat.outbox import OutboxMessage, db_now
from reliable_beat.outbox_queue import (
    _MAX_ERROR_CHARS,
    EXPIRED_ERROR,
    _Listener,
    _move_runs,
    claim_outbox_batch,
    dead_letter_malformed,
    mark_expired,
    mark_sent,
    outbox_status,
    purge_sent,
)
from reliable_beat.policies import backoff_delay
from reliable_beat.redaction import get_logger, redact_text
from reliable_beat.redispatch import redispatch_stuck_runs
from reliable_beat.retention import start_retention
from reliable_beat.settings import Settings
from reliable_beat.triggers import TRIGGER_DESTINATIONS
from reliable_beat.workflows.engine import redispatch_workflows

__all__ = [
    "EXPIRED_ERROR",
    "MAX_UNCHARGED_RETURNS",
    "Relay",
    "claim_outbox_batch",
    "dead_letter_malformed",
    "mark_expired",
    "mark_sent",
    "outbox_status",
    "purge_sent",
]

log = get_logger(__name__)

#: After a database outage a relay leaves beat triggers (destination ``celery``) alone this
#: long (the beat's sweep delay): a beat that published one while the database was gone
#: records it as sent first, so the relay does not send it a second time.
TRIGGER_HOLD_AFTER_OUTAGE_SECONDS = 10.0
#: How many times one row may be handed back uncharged ("destination unavailable") while its
#: destination delivers other rows meanwhile; after that it is charged an attempt like any
#: failure, so a row that only *looks* like an outage to the handler still dead-letters.
MAX_UNCHARGED_RETURNS = 5
Handler = Callable[[OutboxMessage], None]


# --------------------------------------------------------------------------- relay


@dataclass
class _Outcome:
    sent: list[int]
    expired: list[int]
    failed: list[tuple[OutboxMessage, BaseException]]
    unavailable: dict[str, list[tuple[OutboxMessage, BaseException]]]
    #: destinations at least one row of this batch was delivered to
    delivered_to: set[str] = field(default_factory=set)


class Relay:
    """Delivers outbox rows. Safe to run many at once (threads or processes, any hosts).

    Args:
        store: the reliable_beat store (create one per process).
        app: the Celery app for the ``celery`` and ``kombu`` handlers (None: those
            destinations are not claimed by this relay and stay pending for another). Of the
            triggers (destination ``celery``) it only claims its schedule group's and
            group-less ones: they go into this app's broker (several apps may share a store).
        handlers: destination -> handler; default :func:`~reliable_beat.handlers.
            load_handlers` (built-ins, entry points, ``reliable_beat_outbox_handlers``).
            Only destinations with a handler are claimed.
        owner: the relay's id in ``claimed_by`` (default ``settings.owner``).
        batch_size: rows per claim (default ``settings.outbox_batch_size``).
        settings: default :meth:`Settings.from_celery(app) <Settings.from_celery>` or
            ``Settings()``; supplies attempts, backoff, retention and poll period.
        claim_lease_seconds: how long a claim lasts; a relay that dies after claiming loses
            its rows to others after this long. Must exceed the time to deliver one batch.
        purge_interval_seconds: at most one retention pass per this many seconds.
        rng: random source for the backoff jitter.
    """

    def __init__(
        self,
        store: Store,
        app: Any = None,
        handlers: Mapping[str, Handler] | None = None,
        *,
        owner: str | None = None,
        batch_size: int | None = None,
        settings: Settings | None = None,
        claim_lease_seconds: float = 60.0,
        purge_interval_seconds: float = 60.0,
        rng: random.Random | None = None,
        redispatch: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.app = app
        #: The re-dispatch sweep of a framework adapter (None: the Celery app's, when given).
        self._redispatch = redispatch
        if settings is None:
            settings = app_settings(app) if app is not None else Settings()
        self.settings = settings
        # a relay with an app publishes triggers into that app's broker: only its schedule
        # group's (and group-less ones); without an app it claims no `celery` rows at all
        self.schedule_group = (
            schedule_group_of(app, settings.schedule_group) if app is not None else None
        )
        self.handlers: dict[str, Handler] = dict(
            handlers if handlers is not None else load_handlers(
                app, settings.outbox_handlers, settings=settings)
        )
        self.owner = owner or settings.owner
        self.batch_size = batch_size or settings.outbox_batch_size
        self.claim_lease = timedelta(seconds=claim_lease_seconds)
        self.purge_interval_seconds = purge_interval_seconds
        self._rng = rng or random.Random()
        self._last_purge = float("-inf")
        self._last_redispatch = float("-inf")
        self._last_unsent = float("-inf")
        #: A due trigger committed without a row and still ``scheduled`` this long after its
        #: slot and its claim was never published (its beat died): its row is written
        #: (:meth:`maybe_materialise_unsent`). The beats' sweep delay.
        self.unsent_after = timedelta(seconds=TRIGGER_HOLD_AFTER_OUTAGE_SECONDS)
        self._down_streak: dict[str, int] = {}
        #: destination -> ids of rows this relay backed off while the destination was down:
        #: made due again at once when a delivery to it succeeds (see :meth:`settle`)
        self._backed_off: dict[str, set[int]] = {}
        self._last_scan = float("-inf")  # last claim that also took unreadable rows
        self._last_unhandled_check = float("-inf")
        self._outage_log = RepeatedLog(log)  # "store unavailable": first, then every 30 s
        self._uncharged: dict[int, tuple[int, float]] = {}  # row id -> (returns, first at)
        self._delivered_at: dict[str, float] = {}  # destination -> last success (monotonic)
        self._listener: _Listener | None = None
        # After a database outage, beat triggers (destination ``celery``) are left alone for
        # a sweep delay: the beat that published one during the outage records it first.
        self._triggers_after = 0.0
        self._retention: Any = None  # a RetentionThread while run_forever runs
        # heartbeat row in reliable_beat_beats (role 'relay'): `status` tells a group whose
        # rows no live relay or beat publishes; None until first recorded
        self._heartbeat_key: str | None = None
        self._last_heartbeat = float("-inf")
        self._heartbeat_log = RepeatedLog(log)
        # the heartbeat thread (run_forever) and run_once both beat: one at a time
        self._heartbeat_lock = threading.Lock()
        #: monotonic start of the cycle now running (None between cycles): the heartbeat
        #: thread stops beating for a cycle stuck longer than STALLED_CYCLE_SECONDS
        self._cycle_started: float | None = None
        self._stall_log = RepeatedLog(log)

    # -- one cycle -----------------------------------------------------------------------

    def claim(self) -> list[OutboxMessage]:
        """Claim one batch in its own short transaction (see :func:`claim_outbox_batch`)."""
        destinations = [d for d in self.handlers
                        if d not in TRIGGER_DESTINATIONS
                        or time.monotonic() >= self._triggers_after]
        if not destinations:
            return []
        scan = time.monotonic() - self._last_scan >= 60.0
        if scan:
            self._last_scan = time.monotonic()
        with self.store.begin() as conn:
            now = db_now(conn)
            return claim_outbox_batch(
                self.store,
                conn,
                owner=self.owner,
                now=now,
                lease=self.claim_lease,
                limit=self.batch_size,
                destinations=destinations,
                max_bytes=self.settings.outbox_batch_bytes,
                unreadable=scan,
                schedule_group=self.schedule_group,
            )

    def run_once(self) -> int:
        """Claim one batch, deliver it, settle it; purge old sent rows when due.

        Returns:
            How many rows were claimed (0: nothing was due).

        Raises:
            StoreUnavailableError: the database cannot be reached (nothing was lost: claimed
                rows are delivered again after their lease).
        """
        self._cycle_started = time.monotonic()
        try:
            self.maybe_heartbeat()
            self.maybe_materialise_unsent()
            messages = self.claim()
            if messages:
                outcome = self.deliver(messages)
                self.settle(outcome)
            self.maybe_warn_unhandled()
            self.maybe_purge()
            self.maybe_redispatch()
        finally:
            self._cycle_started = None
        return len(messages)

    def maybe_heartbeat(self) -> bool:
        """Every :data:`HEARTBEAT_SECONDS`: record this relay as alive in
        ``reliable_beat_beats`` (``role = 'relay'``: its owner id, schedule group, handler
        destinations and ``seen_at`` on the store clock; :func:`~reliable_beat.groups.
        record_relay`). ``reliable-beat status`` reads it to tell a schedule group whose
        outbox rows no live relay or beat publishes.

        A failure other than the store being unreachable (e.g. a store not yet upgraded to
        0011_relaywatch) is logged at WARNING (first, then every 30 s) and never stops
        delivery.

        Returns:
            True when a heartbeat was written now.

        Raises:
            StoreUnavailableError: the database cannot be reached.
        """
        with self._heartbeat_lock:
            if time.monotonic() - self._last_heartbeat < HEARTBEAT_SECONDS:
                return False
            self._last_heartbeat = time.monotonic()
            try:
                if self._heartbeat_key is None or not relay_heartbeat(self.store,
                                                                      self._heartbeat_key):
                    self._heartbeat_key = record_relay(
                        self.store, owner=self.owner, group=self.schedule_group,
                        destinations=self.handlers)
            except StoreUnavailableError:
                raise
            except Exception as exc:
                self._heartbeat_log.log(
                    logging.WARNING, "relay: could not record its heartbeat (`reliable-beat "
                    "status` may report its schedule group %r as unserved; run `reliable-beat "
                    "db upgrade`?): %s", self.schedule_group, _describe(exc))
                return False
            self._heartbeat_log.reset()
            return True

    def heartbeat_from_thread(self) -> bool:
        """One beat of the heartbeat thread :meth:`run_forever` runs: :meth:`maybe_heartbeat`
        whatever the delivery loop is doing (a long batch, a slow broker), so ``status``
        does not take a busy relay for a dead one; never raises (an unreachable store is the
        delivery loop's to report).

        A cycle running longer than :data:`STALLED_CYCLE_SECONDS` is taken to be stuck (a
        publish that never returns): the thread then stops beating, logs WARNING (first,
        then every 30 s) and ``status`` shows the relay gone after its liveness window,
        as if it had died (its claimed rows go to other relays when their lease ends).

        Returns:
            True when a heartbeat was written now.
        """
        started = self._cycle_started
        if started is not None and time.monotonic() - started > STALLED_CYCLE_SECONDS:
            self._stall_log.log(
                logging.WARNING, "relay: one delivery cycle has been running for %.0f s "
                "(more than %.0f s: a publish that does not return?): no longer recording "
                "a heartbeat, so `reliable-beat status` shows this relay gone",
                time.monotonic() - started, STALLED_CYCLE_SECONDS)
            return False
        self._stall_log.reset()
        try:
            return self.maybe_heartbeat()
        except Exception as exc:  # the store is down: the delivery loop says so
            log.debug("relay: heartbeat thread could not record a heartbeat: %s", exc)
            return False

    def maybe_warn_unhandled(self) -> list[tuple[str, int]]:
        """Once a minute: WARN about due rows of destinations no relay takes.

        A pending row due for more than :data:`UNHANDLED_AFTER_SECONDS` whose destination
        this relay has no handler for (and that no other relay claimed meanwhile: a claim
        moves ``available_at`` a lease ahead) waits forever: usually a typo in
        ``outbox.add(conn, "emial", ...)``. Logged at WARNING once per check, naming the
        destination, the row count and this relay's handlers; ``status --check`` alarms on
        the same rows after ``--outbox-stuck`` minutes.

        Returns:
            ``[(destination, rows)]`` warned about (empty when the check was not due).
        """
        if time.monotonic() - self._last_unhandled_check < UNHANDLED_CHECK_SECONDS:
            return []
        self._last_unhandled_check = time.monotonic()
        with self.store.begin() as conn:
            cutoff = db_now(conn) - timedelta(seconds=UNHANDLED_AFTER_SECONDS)
            found = [(str(d), int(n)) for d, n in conn.execute(
                select(outbox.c.destination, func.count())
                .where(outbox.c.state == "pending", outbox.c.available_at <= cutoff,
                       outbox.c.destination.not_in(list(self.handlers)))
                .group_by(outbox.c.destination)
                .order_by(outbox.c.destination)
            )]
        for destination, n in found:
            log.warning(
                "relay: %d outbox rows for destination %r are due and no relay claims them: "
                "this relay has no handler for %r (its handlers: %s). A typo in "
                "outbox.add(..., destination)? Or start a relay with that handler "
                "(reliable_beat_outbox_handlers).",
                n, destination, destination, ", ".join(sorted(self.handlers)) or "none")
        return found

    def maybe_materialise_unsent(self) -> int:
        """Every :data:`UNSENT_SECONDS`, for a relay with an app (it knows its schedule group
        and the payload shape of its triggers): write the trigger rows of its group's due
        slots a beat committed but never published (:func:`~reliable_beat.unsent.
        materialise_unsent`), so this relay's claim publishes them. Not during the hold
        after a database outage (a beat records what it published meanwhile first).

        Returns:
            How many trigger rows were written.
        """
        destination = self._trigger_destination()
        if (destination is None or time.monotonic() < self._triggers_after
                or time.monotonic() - self._last_unsent < UNSENT_SECONDS):
            return 0
        self._last_unsent = time.monotonic()
        with self.store.begin() as conn:
            return unsent.materialise_unsent(
                self.store, conn, now=db_now(conn), sweep_delay=self.unsent_after,
                destination=destination, schedule_group=self.schedule_group,
                limit=self.batch_size)

    def _trigger_destination(self) -> str | None:
        """The trigger destination of this relay's app, if it delivers it; None without an
        app (a relay of no group cannot know which payload shape a run's trigger takes)."""
        if self.app is None or self.schedule_group is None:
            return None
        name = getattr(adapter_for(self.app), "name", None)
        return name if name in TRIGGER_DESTINATIONS and name in self.handlers else None

    def maybe_redispatch(self) -> None:
        """Every few seconds, with an app: re-send triggers of stuck tracked runs (their
        message was lost; see :mod:`reliable_beat.redispatch`)."""
        if (self.app is None and self._redispatch is None) or \
                time.monotonic() - self._last_redispatch < 5.0:
            return
        self._last_redispatch = time.monotonic()
        if self._redispatch is not None:
            self._redispatch()
            return
        redispatch_stuck_runs(self.store, self.app, self.settings)
        # durable workflows: dead advances, lost wakes, lost activity messages
        app, probe = self.app, getattr(adapter_for(self.app), "queue_depths", None)
        redispatch_workflows(self.store, older_than=timedelta(
            seconds=self.settings.redispatch_seconds), retrying_after=timedelta(
            seconds=self.settings.redispatch_seconds + self.settings.retry_cap_seconds),
            # the backlog check (optional adapter hook): a queue deep enough is not re-sent to
            queue_depths=None if probe is None or not self.settings.redispatch_backlog_check
            else (lambda messages: list(probe(app, messages))),
            max_takeovers=self.settings.workflow_max_takeovers)

    def deliver(self, messages: Sequence[OutboxMessage]) -> _Outcome:
        """Deliver claimed rows outside any transaction; never raises for one bad row."""
        outcome = _Outcome([], [], [], {})
        groups: dict[str, list[OutboxMessage]] = {}
        for m in messages:
            groups.setdefault(m.destination, []).append(m)
        for destination, group in groups.items():
            results = self._deliver_group(destination, group)
            for m, err in zip(group, results, strict=True):
                if err is None:
                    outcome.sent.append(m.id)
                    outcome.delivered_to.add(destination)
                    self._delivered_at[destination] = time.monotonic()
                    self._uncharged.pop(m.id, None)
                elif isinstance(err, MessageExpiredError):
                    outcome.expired.append(m.id)
                elif isinstance(err, DestinationUnavailableError):
                    outcome.unavailable.setdefault(destination, []).append((m, err))
                else:
                    outcome.failed.append((m, err))
            if destination not in outcome.unavailable:
                self._down_streak.pop(destination, None)
        return outcome

    #: While a destination is down, one of the rows handed back is retried after this long
    #: (seconds) at most, whatever the backoff of the others: the probe that notices the
    #: destination is back (the others then become due at once, :meth:`settle`).
    PROBE_SECONDS = 5.0

    def _deliver_group(self, destination: str, group: list[OutboxMessage]) -> list[Any]:
        handler = self.handlers.get(destination)
        if handler is None:  # cannot happen through claim(); kept for direct callers
            err = PermanentDeliveryError(f"no outbox handler for destination {destination!r}")
            return [err] * len(group)
        spans = tracing.DeliverySpans.of(group)  # None: tracing off
        if spans is not None:
            results = self._deliver_to(handler, destination, spans.messages)
            spans.end(results)
            return results
        return self._deliver_to(handler, destination, group)

    def _deliver_to(self, handler: Any, destination: str, group: list[OutboxMessage]
                    ) -> list[Any]:
        batch = getattr(handler, "deliver_batch", None)
        if batch is not None:
            try:
                batch_results = list(batch(group))
                if len(batch_results) != len(group):
                    raise RuntimeError(
                        f"handler {destination!r}.deliver_batch returned {len(batch_results)} "
                        f"results for {len(group)} messages"
                    )
                return batch_results
            except Exception as exc:
                log.exception("outbox handler %r failed on a batch of %d", destination, len(group))
                return [exc] * len(group)
        results: list[Any] = []
        for m in group:
            try:
                handler(m)
                results.append(None)
            except Exception as exc:
                results.append(exc)
        return results

    def settle(self, outcome: _Outcome) -> None:
        """Record the outcome of a delivered batch, in short transactions.

        Rows of a destination that is down are handed back with a growing backoff (up to
        ``outbox_retry_cap_seconds``), except one, retried within :attr:`PROBE_SECONDS`; once
        a delivery to the destination succeeds again, the rows this relay backed off for it
        are made due at once (a broker back after a hang does not leave them waiting out a
        5-minute backoff)."""
        with self.store.begin() as conn:
            now = db_now(conn)
            mark_sent(conn, outcome.sent, now)
            mark_expired(conn, outcome.expired, now)
            back = sorted(d for d in outcome.delivered_to if d in self._backed_off)
            for destination in back:
                ids = sorted(self._backed_off.pop(destination))
                for i in range(0, len(ids), 500):
                    conn.execute(
                        update(outbox)
                        .where(outbox.c.id.in_(ids[i:i + 500]), outbox.c.state == "pending",
                               outbox.c.claimed_by.is_(None), outbox.c.available_at > now)
                        .values(available_at=now))
                log.info("outbox destination %r answers again: %d rows it was backed off for "
                         "are due now", destination, len(ids))
        if outcome.failed:
            with self.store.begin() as conn:
                self._record_failures(conn, outcome.failed, db_now(conn))
        for destination, items in list(outcome.unavailable.items()):
            items = self._charge_repeat_returns(destination, items)
            if not items:
                continue
            streak = self._down_streak.get(destination, 0)
            self._down_streak[destination] = streak + 1
            delay = max(
                self.settings.outbox_retry_base_seconds,
                backoff_delay(
                    streak,
                    base=self.settings.outbox_retry_base_seconds,
                    cap=self.settings.outbox_retry_cap_seconds,
                    rng=self._rng,
                ),
            )
            log.warning("outbox destination %r unavailable (%s); %d rows back off %.1f s",
                        destination, items[0][1], len(items), delay)
            ids = [m.id for m, _ in items]
            self._backed_off.setdefault(destination, set()).update(ids)
            with self.store.begin() as conn:
                now = db_now(conn)
                for chunk, wait in ((ids[:1], min(delay, self.PROBE_SECONDS)), (ids[1:], delay)):
                    if not chunk:
                        continue
                    conn.execute(
                        update(outbox)
                        .where(outbox.c.id.in_(chunk), outbox.c.state == "pending",
                               outbox.c.claimed_by == self.owner)
                        .values(available_at=now + timedelta(seconds=wait), claimed_by=None,
                                attempts=outbox.c.attempts - 1,
                                last_error=_describe(items[0][1]))
                    )

    def _charge_repeat_returns(
        self, destination: str, items: list[tuple[OutboxMessage, BaseException]]
    ) -> list[tuple[OutboxMessage, BaseException]]:
        """The rows to hand back uncharged; the others are charged as ordinary failures.

        A row handed back :data:`MAX_UNCHARGED_RETURNS` times while the destination
        delivered other rows since its first return is not an outage: it is charged (and so
        dead-lettered after ``outbox_max_attempts``). A real outage delivers nothing, so it
        never charges anyone (at-least-once, never dead-letter on an outage).
        """
        now = time.monotonic()
        if len(self._uncharged) > 100_000:  # bounded memory
            self._uncharged.clear()
        keep: list[tuple[OutboxMessage, BaseException]] = []
        charge: list[tuple[OutboxMessage, BaseException]] = []
        delivered = self._delivered_at.get(destination, float("-inf"))
        for m, err in items:
            count, first = self._uncharged.get(m.id, (0, now))
            count += 1
            if count >= MAX_UNCHARGED_RETURNS and delivered > first:
                log.error("outbox row %d (%s) to %r handed back %d times as 'unavailable' "
                          "while the destination delivered other rows: charging it an "
                          "attempt (%s)", m.id, m.message_id, destination, count, _describe(err))
                self._uncharged.pop(m.id, None)
                charge.append((m, err))
            else:
                self._uncharged[m.id] = (count, first)
                keep.append((m, err))
        if charge:
            with self.store.begin() as conn:
                self._record_failures(conn, charge, db_now(conn))
        return keep

    def _record_failures(
        self, conn: Connection, failed: list[tuple[OutboxMessage, BaseException]], now: datetime
    ) -> None:
        retries: list[dict[str, Any]] = []
        for m, err in failed:
            permanent = isinstance(err, PermanentDeliveryError)
            if permanent or m.attempts >= self.settings.outbox_max_attempts:
                self._dead_letter(conn, m, err, now, "permanent" if permanent else "exhausted")
                continue
            delay = backoff_delay(
                m.attempts - 1,
                base=self.settings.outbox_retry_base_seconds,
                cap=self.settings.outbox_retry_cap_seconds,
                rng=self._rng,
            )
            log.warning("outbox row %d (%s) to %r failed (attempt %d), retry in %.1f s: %s",
                        m.id, m.message_id, m.destination, m.attempts, delay, _describe(err))
            retries.append({"b_id": m.id, "b_attempts": m.attempts, "b_err": _describe(err),
                            "b_at": now + timedelta(seconds=delay)})
        if retries:
            conn.execute(
                update(outbox)
                .where(outbox.c.id == bindparam("b_id"),
                       outbox.c.attempts == bindparam("b_attempts"),
                       outbox.c.state == "pending")
                .values(available_at=bindparam("b_at"), last_error=bindparam("b_err"),
                        claimed_by=None),
                retries,
            )

    def _dead_letter(
        self, conn: Connection, m: OutboxMessage, err: BaseException, now: datetime, reason: str
    ) -> None:
        error = _describe(err)
        changed = conn.execute(
            update(outbox)
            .where(outbox.c.id == m.id, outbox.c.attempts == m.attempts,
                   outbox.c.state == "pending")
            .values(state="dead", claimed_by=None, last_error=error)
        ).rowcount
        if not changed:  # someone else settled it after our lease expired
            return
        log.error("outbox row %d (%s) to %r dead-lettered (%s) after %d attempt(s): %s",
                  m.id, m.message_id, m.destination, reason, m.attempts, error)
        conn.execute(
            dead_letters.insert().values(
                kind="outbox",
                run_id=m.run_id,
                outbox_id=m.id,
                key=m.message_id,
                destination=m.destination,
                payload={
                    "message_id": m.message_id,
                    "destination": m.destination,
                    "payload": m.payload,
                    "headers": dict(m.headers),
                    "ordering_key": m.ordering_key,
                    "run_id": m.run_id,
                },
                reason=reason,
                error=error,
                attempts=m.attempts,
                created_at=now,
            )
        )
        _move_runs(conn, [m.id], frm="scheduled", to="dead", now=now,
                   reason=f"trigger undeliverable: {error}"[:_MAX_ERROR_CHARS])

    def maybe_purge(self) -> int:
        """Run one retention pass if the last one is older than ``purge_interval_seconds``.

        Off while :meth:`run_forever` runs: its :class:`~reliable_beat.retention.
        RetentionThread` purges every table in bounded batches until caught up.
        """
        if self._retention is not None or self.settings.outbox_retention_seconds is None:
            return 0
        if time.monotonic() - self._last_purge < self.purge_interval_seconds:
            return 0
        self._last_purge = time.monotonic()
        with self.store.begin() as conn:
            cutoff = db_now(conn) - timedelta(seconds=self.settings.outbox_retention_seconds)
            deleted = purge_sent(conn, older_than=cutoff)
        if deleted:
            log.info("outbox retention: purged %d sent rows older than %s", deleted, cutoff)
        return deleted

    # -- loop ----------------------------------------------------------------------------

    def run_forever(self, stop_event: threading.Event | None = None) -> None:
        """Run cycles until ``stop_event`` is set; never dies on one bad row or a DB outage.

        After a cycle that claimed rows the next starts at once (sending a row may unblock
        its ordering-key successor); otherwise it waits up to ``relay_poll_seconds`` for a
        PostgreSQL ``NOTIFY reliable_beat_outbox`` (or just sleeps on other dialects).
        """
        stop = stop_event or threading.Event()
        poll = self.settings.relay_poll_seconds
        self._retention = start_retention(self.store, self.settings, role="relay")
        beating = threading.Event()  # set: the heartbeat thread stops
        heart = threading.Thread(target=self._heartbeat_loop, args=(beating,),
                                 name="reliable-beat-relay-heartbeat", daemon=True)
        heart.start()
        try:
            # LISTEN before the first claim: a row committed between that claim and a later
            # LISTEN would wake no one and wait a whole poll period.
            self._listen()
            while not stop.is_set():
                try:
                    claimed = self.run_once()
                except StoreUnavailableError as exc:
                    self._outage_log.log(logging.WARNING,
                                         "relay: store unavailable, retrying in %.1f s: %s",
                                         poll, exc)
                    self._triggers_after = time.monotonic() + TRIGGER_HOLD_AFTER_OUTAGE_SECONDS
                    stop.wait(poll)
                    continue
                except Exception:
                    log.exception("relay cycle failed; retrying in %.1f s", poll)
                    stop.wait(poll)
                    continue
                self._outage_log.reset()
                if claimed:
                    continue
                self._wait(stop, poll)
        finally:
            beating.set()
            heart.join(timeout=HEARTBEAT_SECONDS + 30.0)
            if self._retention is not None:
                self._retention.stop()
                self._retention = None
            self._mark_stopped()
            self.close()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        """The heartbeat thread: :meth:`heartbeat_from_thread` every second (it writes at
        most every :data:`HEARTBEAT_SECONDS`) until ``stop`` is set."""
        while not stop.wait(min(1.0, HEARTBEAT_SECONDS)):
            self.heartbeat_from_thread()

    def forget(self) -> None:
        """Delete this relay's heartbeat row (a one-shot run, ``relay --once``, at exit): a
        run that is over is not a relay that died, so it leaves no row to age into
        ``status``'s "last seen" (best effort: logged at DEBUG when the store is gone)."""
        if self._heartbeat_key is None:
            return
        try:
            relay_forget(self.store, self._heartbeat_key)
            self._heartbeat_key = None
        except Exception as exc:
            log.debug("relay: could not delete its heartbeat row: %s", exc)

    def _mark_stopped(self) -> None:
        """Graceful exit: mark the heartbeat row stopped (best effort: a relay that cannot
        reach the store just stops; its row ages out of the live window)."""
        if self._heartbeat_key is None:
            return
        try:
            relay_stopped(self.store, self._heartbeat_key)
        except Exception as exc:
            log.debug("relay: could not mark its heartbeat row stopped: %s", exc)

    def _listen(self) -> None:
        """On PostgreSQL: open the LISTEN connection now (no-op elsewhere, or when open)."""
        if self.store.dialect != "postgresql":
            return
        if self._listener is None:
            self._listener = _Listener(self.store)
        self._listener.listen()

    def _wait(self, stop: threading.Event, timeout: float) -> None:
        """Wait up to ``timeout`` s for a ``NOTIFY`` (PostgreSQL) or ``stop``.

        The LISTEN connection is read for the whole wait, in slices of at most 1 s so that
        ``stop`` is seen within a second. Without a LISTEN connection (it failed: logged,
        retried at the next wait) the rest of the wait is a plain sleep.
        """
        if self.store.dialect != "postgresql":
            stop.wait(timeout)
            return
        if self._listener is None:
            self._listener = _Listener(self.store)
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._listener.wait(min(left, 1.0)):
                return
            if self._listener.conn is None:  # the connection failed
                stop.wait(max(deadline - time.monotonic(), 0.0))
                return

    def close(self) -> None:
        """Close the LISTEN connection and handler resources."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None


#: Seconds between two looks of a relay for due triggers no beat published
#: (:meth:`Relay.maybe_materialise_unsent`).
UNSENT_SECONDS = 5.0
#: Seconds between two heartbeats of a relay (``status`` counts one seen within 60 s live).
#: Written by a thread of its own while :meth:`Relay.run_forever` runs, so a long batch or
#: a slow broker does not make a busy relay look dead.
HEARTBEAT_SECONDS = 10.0
#: A delivery cycle running longer than this is stuck (a publish that never returns): the
#: heartbeat thread stops beating, so ``status`` shows the relay gone.
STALLED_CYCLE_SECONDS = 600.0
#: Seconds between two checks for due rows of destinations this relay has no handler for.
UNHANDLED_CHECK_SECONDS = 60.0
#: A row due this long and still unclaimed is reported (other relays had time to take it).
UNHANDLED_AFTER_SECONDS = 60.0


def _describe(err: BaseException) -> str:
    text = redact_text(f"{type(err).__name__}: {err}")  # webhook URLs, tokens: never stored
    return text[:_MAX_ERROR_CHARS]
