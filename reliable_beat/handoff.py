"""Hand-off: a workflow's next message published by the process that committed it.

A workflow step crosses two messages (the activity's, then the wake of the workflow). Left
to a relay, each costs a relay wake-up, a claim transaction and a mark transaction in
another process. Instead, the process that commits the row publishes it itself right after
the commit and marks it ``sent``, as the beat does with its held triggers; the outbox row
stays the durable record and the relay the safety net::

    committing process                         relay
    ------------------                         -----
    BEGIN
      INSERT outbox row (available_at = now + HANDOFF_DELAY, no NOTIFY)
    COMMIT
    publish (same message id, same task id)
    UPDATE ... SET state = 'sent'             (due after HANDOFF_DELAY if still pending:
                                               the process died, or the publish failed)

At least once: a crash before the publish leaves the row pending, due after the delay; a
crash between the publish and the mark sends it twice, under the same message id and task
id, and the receivers deduplicate (an activity by its idempotency key, an advance by the
workflow's fence and history). A publish that fails hands the row to the relay at once.

Who takes part: a framework adapter names the publisher of the running task or advance with
:func:`publishing`; the code that commits the transaction wraps it in :func:`after_commit`;
the code that writes the row calls :func:`add`. Without both (another adapter, a user's own
transaction, a different schedule group), :func:`add` is :func:`reliable_beat.outbox.add`
and the relay delivers the row as before.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from reliable_beat import outbox as outbox_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.messages import OutboxMessage
from reliable_beat.outbox import db_now
from reliable_beat.redaction import get_logger

__all__ = ["HANDOFF_DELAY", "UNKNOWN", "Publish", "add", "after_commit", "mark", "publishing",
           "publishing_for", "register", "send"]

log = get_logger("reliable_beat.workflows")

#: A handed-off row is due to the relays this long after its commit (if not marked sent).
HANDOFF_DELAY = timedelta(seconds=5)

#: The ``group`` of a row whose schedule group the writer does not know: never handed off.
UNKNOWN = "\x00unknown"

#: ``publish(messages) -> [(row id, None or the error)]`` (the adapter's batch publish).
Publish = Callable[[Sequence[OutboxMessage]], Sequence[tuple[int, "BaseException | None"]]]


@dataclass
class _Publisher:
    publish: Publish
    group: str | None


@dataclass
class _Pending:
    store: Store
    messages: list[OutboxMessage] = field(default_factory=list)


_publisher: contextvars.ContextVar[_Publisher | None] = contextvars.ContextVar(
    "reliable_beat_handoff_publisher", default=None)
_pending: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar(
    "reliable_beat_handoff_pending", default=None)


#: owner (a framework app) -> () -> (its publish, its schedule group)
_registered: weakref.WeakKeyDictionary[Any, Callable[[], tuple[Publish, str | None]]] = (
    weakref.WeakKeyDictionary())


def register(owner: Any, factory: Callable[[], tuple[Publish, str | None]]) -> None:
    """Name the publisher of ``owner`` (an adapter's app that runs workflows):
    ``factory()`` returns its batch publish and its schedule group."""
    _registered[owner] = factory


@contextmanager
def publishing_for(owner: Any) -> Iterator[None]:
    """:func:`publishing` with ``owner``'s registered publisher (none registered: a no-op,
    the relay delivers)."""
    factory = _registered.get(owner)
    if factory is None:
        yield
        return
    publish, group = factory()
    with publishing(publish, group):
        yield


@contextmanager
def publishing(publish: Publish, group: str | None) -> Iterator[None]:
    """While the block runs, rows written by :func:`add` inside an :func:`after_commit`
    block of schedule group ``group`` are published with ``publish`` after their commit."""
    token = _publisher.set(_Publisher(publish, group))
    try:
        yield
    finally:
        _publisher.reset(token)


@contextmanager
def after_commit(store: Store) -> Iterator[None]:
    """Wrap exactly one transaction (``with store.begin()``, or the block that commits it):
    when the block exits normally, the transaction committed, and the rows :func:`add`
    wrote in it are published and marked sent. When it raises, they are forgotten (rolled
    back; or, committed after all, delivered by the relay after :data:`HANDOFF_DELAY`)."""
    if _publisher.get() is None or _pending.get() is not None:
        yield  # no publisher here, or nested in an outer block: that one publishes
        return
    pending = _Pending(store)
    token = _pending.set(pending)
    try:
        yield
    finally:
        _pending.reset(token)
    if pending.messages:
        send(pending.store, pending.messages)


def add(conn: Connection, destination: str, payload: Any, *, key: str,
        group: str | None, schedule_group: str | ColumnElement[Any] | None) -> str:
    """:func:`reliable_beat.outbox.add` of a workflow message of schedule group ``group``
    (:data:`UNKNOWN`: not known to the writer; ``schedule_group``: the group as the row
    stores it, a value or SQL); handed off to this process
    when it publishes for that group inside an :func:`after_commit` block."""
    pending, publisher = _pending.get(), _publisher.get()
    if pending is None or publisher is None or publisher.group != group:
        return outbox_mod.add(conn, destination, payload, key=key,
                              schedule_group=schedule_group)
    message_id = outbox_mod.add(conn, destination, payload, key=key, delay=HANDOFF_DELAY,
                                schedule_group=schedule_group, notify=False)
    row = conn.execute(select(outbox).where(outbox.c.message_id == message_id,
                                            outbox.c.state == "pending")).first()
    if row is not None:  # an existing row already sent is not sent again
        pending.messages.append(OutboxMessage.from_row(row))
    return message_id


def send(store: Store, messages: list[OutboxMessage]) -> None:
    """Publish committed rows, then mark the published ones ``sent`` and hand the others to
    the relay at once. Never raises: the rows are committed, the relay is the safety net."""
    publisher = _publisher.get()
    if publisher is None:
        return
    try:
        outcomes = list(publisher.publish(messages))
    except Exception as exc:  # a publisher never raises; if it does, the relay delivers
        log.warning("could not publish %d workflow messages (%s); the relay sends them",
                    len(messages), exc)
        outcomes = [(m.id, exc) for m in messages]
    sent = [i for i, err in outcomes if err is None]
    failed = [i for i, err in outcomes if err is not None]
    mark(store, sent, failed)


def mark(store: Store, sent: list[int], failed: list[int]) -> None:
    """Mark published rows ``sent``; make the others due to the relay now. Never raises (a
    row left pending is sent again by the relay after :data:`HANDOFF_DELAY`)."""
    try:
        with store.begin() as conn:
            now = db_now(conn)
            if sent:
                conn.execute(update(outbox).where(outbox.c.id.in_(sent),
                                                  outbox.c.state == "pending")
                             .values(state="sent", sent_at=now, last_error=None))
            if failed:  # the relay, now (it re-publishes under the same task id)
                conn.execute(update(outbox).where(outbox.c.id.in_(failed),
                                                  outbox.c.state == "pending")
                             .values(available_at=now))
    except Exception as exc:
        log.warning("published %d workflow messages but could not mark them sent (%s); "
                    "the relay sends them again after %s (receivers deduplicate)",
                    len(sent), exc, HANDOFF_DELAY)
