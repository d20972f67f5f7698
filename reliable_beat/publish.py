"""Publishing a beat's triggers: the port an adapter gives the loop, and what surrounds it.

:class:`Publisher` (and :class:`HoldingPublisher`, which builds a batch ahead and flushes it
at an instant) is how a trigger row becomes a message of the adapter's framework;
:func:`trigger_messages` turns committed triggers into the outbox messages a publisher takes;
:func:`record_unmarked` writes the ``sent`` marks a publish could not write (the database was
gone); :func:`sleep_until` waits for a held slot's instant. The loop
(:mod:`reliable_beat.loop`) publishes through them with
:func:`~reliable_beat.loop.publish_and_mark`.
"""

from __future__ import annotations

import logging
import select as _select
import time
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from sqlalchemy.exc import DBAPIError

from reliable_beat.db.dialects import Store
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.logs import RepeatedLog
from reliable_beat.outbox import OutboxMessage
from reliable_beat.redaction import get_logger
from reliable_beat.relay import mark_expired, mark_sent
from reliable_beat.triggers import Trigger, trigger_message_id

__all__ = [
    "SPIN_SECONDS",
    "HoldingPublisher",
    "Outcomes",
    "Publisher",
    "beat_publish_timeout",
    "record_unmarked",
    "send_batch",
    "sleep_until",
    "trigger_messages",
]

log = get_logger("reliable_beat.loop")

#: The last this-many seconds before a held slot's instant are spent spinning, not asleep.
SPIN_SECONDS = 0.002

#: ``(outbox id, None or the error)`` per message, in order.
#: (A negative id: a trigger with no outbox row, its run's id negated; publishers only hand
#: ids back.)
Outcomes = list[tuple[int, "BaseException | None"]]


@runtime_checkable
class Publisher(Protocol):
    """What a framework adapter gives the core loop.

    Attributes:
        destination: the outbox destination of its trigger rows (one of
            :data:`reliable_beat.beat.TRIGGER_DESTINATIONS`).
    """

    destination: str

    def publish(self, messages: Sequence[OutboxMessage], now: datetime) -> Outcomes:
        """Publish trigger rows (payload of :func:`reliable_beat.beat.build_trigger_payload`).

        Args:
            messages: the rows, in order.
            now: the store's clock (UTC), for the ``expires_at`` check.

        Returns:
            ``(outbox id, None or the error)`` per message, in order; never raises.
            :class:`~reliable_beat.handlers.MessageExpiredError` for a trigger past its
            ``expires_at``, :class:`~reliable_beat.handlers.DestinationUnavailableError` when
            the broker cannot be reached.
        """
        ...

    def tracked_tasks(self) -> Collection[str]:
        """Names of the tasks/actors that keep run state (idempotent ones)."""
        ...


@runtime_checkable
class HoldingPublisher(Publisher, Protocol):
    """A :class:`Publisher` that can build a batch ahead and flush it at an instant.

    The loop uses :meth:`publish_at` for the triggers it claimed ahead and holds; a publisher
    without it is simply called at the instant.
    """

    def publish_at(self, messages: Sequence[OutboxMessage], now: datetime,
                   wait: Callable[[], None]) -> Outcomes:
        """Like :meth:`Publisher.publish`, but build the batch first and call ``wait()``
        right before the first message can reach the broker (the loop sleeps there until
        the slot). ``wait`` may raise a ``BaseException`` to abandon the batch: nothing may
        have been sent then, and the exception must propagate."""
        ...


def send_batch(publisher: Publisher, messages: Sequence[OutboxMessage], now: datetime,
               wait: Callable[[], None] | None) -> Outcomes:
    """``publisher``'s outcomes for ``messages``; ``wait`` runs right before the first can
    reach the broker (inside the batch for a :class:`HoldingPublisher`)."""
    if wait is None:
        return publisher.publish(messages, now)
    if isinstance(publisher, HoldingPublisher):
        return publisher.publish_at(messages, now, wait)
    wait()
    return publisher.publish(messages, now)


def beat_publish_timeout(configured: float, sweep_delay: timedelta,
                         logger: logging.Logger | None = None, *, default: bool = False
                         ) -> float:
    """The longest a beat's publish may wait on a broker: ``configured``
    (``reliable_beat_publish_timeout_seconds``), at most half of ``sweep_delay``.

    Past the sweep delay after the claim another process's sweep may publish the same
    slots; a beat's publish that waited that long on a slow broker would send every slot of
    its batch a second time. Bounded, it gives up first and hands the batch back (rows for
    the relay), like a publish to a broker that is down. A ``configured`` value over the
    bound is logged once on ``logger`` (the beat calls this at start): a WARNING when the
    user set it, INFO when it is the setting's ``default``.
    """
    bound = sweep_delay.total_seconds() / 2
    if configured <= bound:
        return configured
    (logger or log).log(
        logging.INFO if default else logging.WARNING,
        "reliable_beat_publish_timeout_seconds=%g is more than this beat can use: its "
        "publishes wait at most %g s (half the sweep delay of %g s), so that a publish on a "
        "slow broker gives up and hands its slots back before another beat's or relay's sweep "
        "may publish them a second time (relays keep %g s)",
        configured, bound, sweep_delay.total_seconds(), configured)
    return bound


def trigger_messages(triggers: Sequence[Trigger], destination: str) -> list[OutboxMessage]:
    """The outbox messages of committed triggers (as a sweep would read them); a trigger
    with no outbox row carries its run's id negated (:attr:`Trigger.id`)."""
    of_trigger = OutboxMessage.of_trigger
    return [
        of_trigger(t.id, trigger_message_id(t.key), destination, t.payload, t.run_id,
                   t.traceparent)
        for t in triggers
    ]


#: "still cannot record ..." is retried every tick during an outage: first, then every 30 s
_STILL_UNMARKED = RepeatedLog(log)


def record_unmarked(store: Store, unmarked: list[tuple[list[int], list[int]]], *,
                    repeated: RepeatedLog | None = None,
                    logger: logging.Logger | None = None) -> bool:
    """Write the marks a publish could not write (see :func:`publish_and_mark`).

    Args:
        repeated: rate-limits the "still cannot record" line (default a module one).

    Returns:
        True when nothing is left to record (``unmarked`` is emptied); False: the database
        is still unavailable (``unmarked`` is kept).
    """
    if not unmarked:
        return True
    repeated = repeated or _STILL_UNMARKED
    try:
        with store.begin() as conn:
            at = store.now(conn)
            for sent, expired in unmarked:
                mark_sent(conn, sent, at)
                mark_expired(conn, expired, at)
    except (StoreUnavailableError, DBAPIError) as exc:
        repeated.log(logging.ERROR, "still cannot record %d published triggers as sent (%s)",
                     sum(len(a) + len(b) for a, b in unmarked), exc)
        return False
    repeated.reset()
    (logger or log).warning("recorded %d triggers published while the database was "
                            "unavailable", sum(len(a) for a, _ in unmarked))
    unmarked.clear()
    return True


def sleep_until(at: float) -> None:
    """Return once ``time.monotonic() >= at``: sleep, then spin the last
    :data:`SPIN_SECONDS` (a process woken from sleep on a busy machine can wait a few ms for
    a CPU; one that is already running does not)."""
    left = at - time.monotonic()
    if left > SPIN_SECONDS:
        # select(), not time.sleep(): Python 3.11's sleep is an absolute clock_nanosleep,
        # which libfaketime-style clock shims (used to test skewed clocks) break with EINVAL.
        _select.select([], [], [], left - SPIN_SECONDS)
    while time.monotonic() < at:
        pass
