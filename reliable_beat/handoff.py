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

Inside an advance (:func:`deferred_marks`) the rows it publishes are marked sent by its
release transaction (:func:`mark_in`) rather than by a transaction of their own.

The wake of an activity's completion need not travel at all: when the publisher has an
``advance`` (the adapter's in-process advance, which says whether this process may run the
workflow here: its code is registered and it consumes the workflow's queue), the process
that completed the activity advances the workflow itself right after the activity's
execution, and the wake row, still pending and due to the relays after
:data:`HANDOFF_DELAY`, is marked sent by that advance's release transaction. A crash
anywhere before that commit leaves the wake pending: the relay sends it and an advance
replays (finding nothing new if the in-process one got further). An advance that raises,
or a workflow this process may not run, has its wake published at once, as before::

    completing process
    ------------------
    BEGIN; effect; run succeeded; history event completed; wake_seq + 1;
      INSERT wake row (available_at = now + HANDOFF_DELAY)
    COMMIT
    advance (claim, replay, record the next activity, publish it)
    release: UPDATE workflows ... ; UPDATE outbox SET state = 'sent' (activity row, wake row)

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
from typing import Any, TypeVar

from sqlalchemy import select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from reliable_beat import outbox as outbox_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.messages import OutboxMessage
from reliable_beat.outbox import now_sql
from reliable_beat.redaction import get_logger

__all__ = [
    "HANDOFF_DELAY",
    "UNKNOWN",
    "Advance",
    "Publish",
    "Wake",
    "add",
    "added",
    "after_commit",
    "answering",
    "deferred_marks",
    "handing_off",
    "mark",
    "mark_in",
    "publishing",
    "publishing_for",
    "register",
    "send",
]

log = get_logger("reliable_beat.workflows")

_T = TypeVar("_T")

#: A handed-off row is due to the relays this long after its commit (if not marked sent).
HANDOFF_DELAY = timedelta(seconds=5)

#: The ``group`` of a row whose schedule group the writer does not know: never handed off.
UNKNOWN = "\x00unknown"

#: ``publish(messages) -> [(row id, None or the error)]`` (the adapter's batch publish).
Publish = Callable[[Sequence[OutboxMessage]], Sequence[tuple[int, "BaseException | None"]]]


@dataclass(frozen=True)
class Wake:
    """The workflow a wake row wakes: its id, its registered name, its queue; for the wake
    of an activity's completion, the run, the ``wake_seq`` its completion set and the
    completed history event as stored (None when the writer did not read them back)."""

    workflow_id: str
    name: str
    queue: str | None
    run_no: int | None = None
    wake_seq: int | None = None
    event: Any = None


#: ``advance(store, wake) -> outcome``, or None when this process may not advance that
#: workflow here (the adapter's in-process advance; see the module docstring).
Advance = Callable[[Store, Wake], "str | None"]


@dataclass
class _Publisher:
    publish: Publish
    group: str | None
    advance: Advance | None = None
    #: wakes committed inside this block that this process advances when the block ends
    woken: list[tuple[Store, OutboxMessage, Wake]] = field(default_factory=list)


@dataclass
class _Pending:
    store: Store
    messages: list[OutboxMessage] = field(default_factory=list)
    wakes: dict[int, Wake] = field(default_factory=dict)


_publisher: contextvars.ContextVar[_Publisher | None] = contextvars.ContextVar(
    "reliable_beat_handoff_publisher", default=None)
_pending: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar(
    "reliable_beat_handoff_pending", default=None)
#: the wake an in-process advance answers (see :func:`answering`)
_answering: contextvars.ContextVar[Wake | None] = contextvars.ContextVar(
    "reliable_beat_handoff_answering", default=None)
#: ids of rows published inside an advance, marked sent by its release transaction
_deferred: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "reliable_beat_handoff_deferred", default=None)

_Factory = Callable[[], "tuple[Publish, str | None] | tuple[Publish, str | None, Advance]"]

#: owner (a framework app) -> () -> (its publish, its schedule group[, its advance])
_registered: weakref.WeakKeyDictionary[Any, _Factory] = weakref.WeakKeyDictionary()


def register(owner: Any, factory: _Factory) -> None:
    """Name the publisher of ``owner`` (an adapter's app that runs workflows):
    ``factory()`` returns its batch publish, its schedule group and, optionally, its
    in-process advance (:data:`Advance`)."""
    _registered[owner] = factory


@contextmanager
def publishing_for(owner: Any) -> Iterator[None]:
    """:func:`publishing` with ``owner``'s registered publisher (none registered: a no-op,
    the relay delivers)."""
    factory = _registered.get(owner)
    if factory is None:
        yield
        return
    publish, group, *advance = factory()
    with publishing(publish, group, advance[0] if advance else None):
        yield


@contextmanager
def publishing(publish: Publish, group: str | None,
               advance: Advance | None = None) -> Iterator[None]:
    """While the block runs, rows written by :func:`add` inside an :func:`after_commit`
    block of schedule group ``group`` are published with ``publish`` after their commit.

    With ``advance``, the wakes of activities completed inside the block are not published:
    when the block ends normally this process advances their workflows itself (see the
    module docstring); when it raises, or ``advance`` declines or raises, they are
    published then."""
    publisher = _Publisher(publish, group, advance)
    token = _publisher.set(publisher)
    ok = False
    try:
        yield
        ok = True
    finally:
        try:
            _advance_woken(publisher, ok)
        finally:
            _publisher.reset(token)


def _advance_woken(publisher: _Publisher, ok: bool) -> None:
    """Advance (or, failing that, publish the wake of) each workflow woken in the block."""
    woken, publisher.woken = publisher.woken, []
    for store, message, wake in woken:
        outcome = None
        if ok and publisher.advance is not None:
            try:
                with deferred_marks(store) as marks:
                    marks.append(message.id)  # the wake: marked sent by the advance's release
                    token = _answering.set(wake)
                    try:
                        outcome = publisher.advance(store, wake)
                    finally:
                        _answering.reset(token)
                    if outcome is None and message.id in marks:
                        marks.remove(message.id)  # not advanced here: the wake goes out
            except Exception as exc:
                log.warning("could not advance workflow %s after its activity completed "
                            "(%r); its wake is published", wake.workflow_id, exc)
                outcome = None
        if outcome is None:
            send(store, [message])


def answering(workflow_id: str) -> Wake | None:
    """The wake of ``workflow_id`` this process is advancing in process right after the
    activity's completion it committed (its ``event``: the completed history event as that
    commit stored it), or None."""
    wake = _answering.get()
    return wake if wake is not None and wake.workflow_id == workflow_id else None


@contextmanager
def deferred_marks(store: Store) -> Iterator[list[int]]:
    """Wrap an advance: the rows it publishes are marked sent by its release transaction
    (:func:`mark_in`); those still unmarked when the block ends normally are marked then,
    in a transaction of their own (when it raises, they stay pending: the relay sends them
    again after :data:`HANDOFF_DELAY`, the receivers deduplicate). Nested: the outer
    block's list. Yields the list of row ids to mark."""
    outer = _deferred.get()
    if outer is not None:
        yield outer
        return
    ids: list[int] = []
    token = _deferred.set(ids)
    try:
        yield ids
    finally:
        _deferred.reset(token)
    if ids:
        mark(store, ids, [])


def mark_in(conn: Connection, with_statement: Callable[[list[int]], _T] | None = None,
            ) -> _T | None:
    """Inside :func:`deferred_marks`: mark the rows published so far ``sent`` in the
    caller's transaction (an advance's release), and forget them.

    ``with_statement``: the caller writes the marks in a statement of its own
    (``with_statement(ids)``: the advance's release and the marks as one statement); its
    return value is returned. Called with the ids to mark (possibly none)."""
    ids = _deferred.get()
    if with_statement is not None:
        marked = list(ids or ())
        if ids:
            ids.clear()
        return with_statement(marked)
    if not ids:
        return None
    conn.execute(update(outbox).where(outbox.c.id.in_(list(ids)), outbox.c.state == "pending")
                 .values(state="sent", sent_at=now_sql(conn), last_error=None))
    ids.clear()
    return None




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
    if not pending.messages:
        return
    publisher = _publisher.get()
    if pending.wakes and publisher is not None and publisher.advance is not None:
        # advanced by this process when its publishing block ends (see the docstring)
        publisher.woken.extend((pending.store, m, pending.wakes[m.id])
                               for m in pending.messages if m.id in pending.wakes)
        pending.messages = [m for m in pending.messages if m.id not in pending.wakes]
    if pending.messages:
        send(pending.store, pending.messages)


def add(conn: Connection, destination: str, payload: Any, *, key: str,
        group: str | None, schedule_group: str | ColumnElement[Any] | None,
        wakes: Wake | None = None,
        fenced: Callable[[Connection, dict[str, Any] | None], Any] | None = None) -> str:
    """:func:`reliable_beat.outbox.add` of a workflow message of schedule group ``group``
    (:data:`UNKNOWN`: not known to the writer; ``schedule_group``: the group as the row
    stores it, a value or SQL); handed off to this process
    when it publishes for that group inside an :func:`after_commit` block. ``wakes``: the
    row is the wake of that workflow, which the publisher may advance in-process instead
    (:func:`publishing`).

    ``fenced``: the writer's statement that must run before the insert in its transaction
    (the fence check of a workflow's record): ``fenced(conn, params)`` runs it together with
    the hand-off's insert where the insert is the psycopg one (``params``: its parameters,
    see :func:`reliable_beat.outbox.add`'s ``insert``); ``fenced(conn, None)`` runs it
    alone, before the insert, on every other path."""
    pending, publisher = _pending.get(), _publisher.get()
    if pending is None or publisher is None or publisher.group != group:
        if fenced is not None:
            fenced(conn, None)
        return outbox_mod.add(conn, destination, payload, key=key,
                              schedule_group=schedule_group)
    returned: list[Any] = []
    message_id = outbox_mod.add(conn, destination, payload, key=key, delay=HANDOFF_DELAY,
                                schedule_group=schedule_group, notify=False,
                                returned=returned, insert=fenced)
    _hand_off(conn, pending, message_id, returned[0] if returned else None, wakes)
    return message_id


def _hand_off(conn: Connection, pending: _Pending, message_id: str, row: Any,
              wakes: Wake | None) -> None:
    """Publish the row ``message_id`` (``row``: as inserted, or None: the id existed
    already) after the commit."""
    if row is None:  # an existing row already sent is not sent again (or no RETURNING here)
        row = conn.execute(select(outbox).where(outbox.c.message_id == message_id,
                                                outbox.c.state == "pending")).first()
    if row is not None:
        message = OutboxMessage.from_row(row)
        pending.messages.append(message)
        if wakes is not None:
            pending.wakes[message.id] = wakes


def handing_off() -> tuple[bool, str | None]:
    """(True, the publisher's schedule group) when :func:`add` would hand off a row of that
    group now (inside :func:`after_commit`, a publisher named); else (False, None)."""
    pending, publisher = _pending.get(), _publisher.get()
    if pending is None or publisher is None:
        return False, None
    return True, publisher.group


def added(conn: Connection, message_id: str, row: Any, *, group: str | None,
          wakes: Wake | None = None) -> bool:
    """A workflow message of schedule group ``group`` the caller inserted itself (``row``:
    as ``INSERT ... RETURNING *`` returned it; None: the id existed already), due after
    :data:`HANDOFF_DELAY` when :func:`handing_off` named that group: handed off as
    :func:`add` hands off its row. False when not handed off (the row is the relay's: the
    caller wrote it due at once and notifies the relays)."""
    pending, publisher = _pending.get(), _publisher.get()
    if pending is None or publisher is None or publisher.group != group:
        return False
    _hand_off(conn, pending, message_id, row, wakes)
    return True


def send(store: Store, messages: list[OutboxMessage]) -> None:
    """Publish committed rows, then mark the published ones ``sent`` (inside
    :func:`deferred_marks`: later, by :func:`mark_in`) and hand the others to the relay at
    once. Never raises: the rows are committed, the relay is the safety net."""
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
    deferred = _deferred.get()
    if deferred is not None:
        deferred.extend(sent)
        sent = []
    if sent or failed:
        mark(store, sent, failed)


def mark(store: Store, sent: list[int], failed: list[int]) -> None:
    """Mark published rows ``sent``; make the others due to the relay now. Never raises (a
    row left pending is sent again by the relay after :data:`HANDOFF_DELAY`)."""
    try:
        with store.begin() as conn:
            now = now_sql(conn)
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
