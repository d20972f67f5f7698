"""The sticky history cache: the advance that answers an activity's completion in the
process that committed it (the hand-off, :mod:`reliable_beat.handoff`) reads only the
events that can have changed since this process last read the workflow's history (Temporal
keeps the decoded history of a workflow in the worker the same way; here, of the rows only).

After an advance that released its workflow (``waiting``), the process keeps the history
*as it read it from the store* (the decoded rows, never the values the code saw or the
events the advance recorded itself), keyed by the workflow's identity (store, row id,
workflow id, creation time) and remembered with the run, the advance's fence token and the
``wake_seq`` it released at. Only the next claim of that workflow in this process that
answers the wake of an activity's completion this process committed just before uses the
entry, and only when all of these hold; otherwise it reads the whole history, as without a
cache (every other wake: a signal, a timer, a wake the relay or the sweep sent):

* same run, and the claim's fence token is the remembered one + 1: no other advance
  claimed the workflow in between (so none appended or changed an event: every write of an
  advance is fenced), and it was not parked (a park bumps the fence too);
* ``wake_seq`` one more than remembered, and that one is the completion's own bump: no
  signal, cancel or other completion came in between.

The completion returned its event as stored. If it is the one event the entry lacks (the
entry holds every event before it, and the claimed row counts one event more), the
history is the entry and that event, with no read. Otherwise (several activities in
flight) one indexed read fetches the events from the first one that may have changed: the
first one not ``completed`` or ``failed`` (a ``scheduled`` event is completed by its
activity or child; a saga's compensation events change state), or one the advance changed
itself, or else the first event after the remembered ones (what the advance recorded, read
back as the store stores it); the merged history must then hold exactly the claim's
``history_len`` events, else the whole history is read.

Each entry is used once (taken at the claim) and the cache holds at most
:data:`MAX_WORKFLOWS` workflows and :data:`MAX_EVENTS` events (least recently used first
out). Replay itself, the determinism checks and every write are unchanged: the history an
advance replays is the same, row for row, as the one a full read returns. The history is
append-only (design invariant): an event already read is not read again while the entry
fits; a row changed by SQL meanwhile is found by the next advance that reads the whole
history (any wake but a hand-off's, another process, a restart).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from reliable_beat.db.driver import uses_psycopg
from reliable_beat.db.tables import workflow_events
from reliable_beat.workflows import pg_statements
from reliable_beat.workflows.history import load_history

__all__ = ["MAX_EVENTS", "MAX_WORKFLOWS", "clear", "expects", "read_history", "remember",
           "stats"]

#: Workflows whose history one process keeps at most.
MAX_WORKFLOWS = 1000
#: Events all entries of one process hold at most.
MAX_EVENTS = 200_000

#: (store url, workflow row id, workflow id, created_at): one workflow's identity.
Key = tuple[Any, ...]


#: Event states no writer but an advance of a blocked-then-resumed workflow changes (a
#: fence token later): an event in any other state is read again by the next advance.
SETTLED = frozenset({"completed", "failed"})


@dataclass
class _Entry:
    run_no: int
    fence_token: int
    wake_seq: int
    #: the events below ``low``, as read from the store
    history: dict[int, Any]
    #: the next advance reads the events from this seq on
    low: int


_lock = threading.Lock()
_entries: OrderedDict[Key, _Entry] = OrderedDict()
#: (store url, workflow id) -> the key of its entry
_keys: dict[tuple[str, str], Key] = {}
_events = 0
#: hits (a partial read), misses (a full read although an entry existed), reads (claims)
_stats = {"hits": 0, "misses": 0, "reads": 0, "unread": 0}


def clear() -> None:
    """Forget every entry (after a fork the child starts empty)."""
    global _events
    with _lock:
        _entries.clear()
        _keys.clear()
        _events = 0


os.register_at_fork(after_in_child=clear)


def stats() -> dict[str, int]:
    """Counters of this process: ``reads`` (claims that read a history), ``hits`` (of which
    completed from an entry), ``unread`` (of the hits, completed with no read at all),
    ``misses`` (an entry existed but did not fit: full read)."""
    return dict(_stats)


def _drop(key: Key) -> _Entry | None:
    global _events
    entry = _entries.pop(key, None)
    if entry is not None:
        _events -= len(entry.history)
        if _keys.get((key[0], key[2])) == key:
            del _keys[(key[0], key[2])]
    return entry


def _take(key: Key) -> _Entry | None:
    with _lock:
        return _drop(key)


def expects(url: str, workflow_id: str, known: tuple[Any, Any, Any]) -> bool:
    """Whether this process holds an entry of ``workflow_id`` on the store ``url`` that the
    completion ``known`` (run, ``wake_seq``, event) would complete with no read, as far as
    can be told before the claim (the claim's fence token and counts decide)."""
    with _lock:
        key = _keys.get((url, workflow_id))
        entry = None if key is None else _entries.get(key)
    if entry is None:
        return False
    k_run, k_wake, event = known
    return bool(entry.run_no == k_run and entry.wake_seq + 1 == k_wake
                and event.seq == entry.low)


def remember(key: Key, run_no: int, fence_token: int, wake_seq: int,
             loaded: dict[int, Any], replayed: dict[int, Any]) -> None:
    """Keep the history of the workflow ``key`` released by the advance of ``fence_token``
    at ``wake_seq``: ``loaded`` as that advance read it from the store, ``replayed`` as its
    runtime left it (an event it replaced there, it wrote: read again, as is every event
    from the first one not :data:`SETTLED` on)."""
    global _events
    low = max(loaded, default=0) + 1
    for seq, ev in loaded.items():
        if seq < low and (ev.state not in SETTLED or replayed.get(seq) is not ev):
            low = seq
    history = {seq: ev for seq, ev in loaded.items() if seq < low}
    if len(history) > MAX_EVENTS // 4:
        return
    with _lock:
        _drop(key)
        stale = _keys.get((key[0], key[2]))
        if stale is not None:  # the same id, another workflow row (ended, started again)
            _drop(stale)
        _entries[key] = _Entry(run_no, fence_token, wake_seq, history, low)
        _keys[(key[0], key[2])] = key
        _events += len(history)
        while _entries and (len(_entries) > MAX_WORKFLOWS or _events > MAX_EVENTS):
            _drop(next(iter(_entries)))


def _since(conn: Connection, pk: int, run_no: int, low: int) -> list[Any]:
    """The run's events from ``seq`` ``low`` on, in seq order (the history's columns)."""
    if uses_psycopg(conn):  # the same select, on the driver connection
        return pg_statements.history_since(conn, pk, run_no, low)
    return list(conn.execute(
        select(
            workflow_events.c.seq, workflow_events.c.kind, workflow_events.c.name,
            workflow_events.c.args_digest, workflow_events.c.state, workflow_events.c.result,
            workflow_events.c.error, workflow_events.c.fire_at, workflow_events.c.run_key,
        )
        .where(workflow_events.c.workflow_pk == pk, workflow_events.c.run_no == run_no,
               workflow_events.c.seq >= low)
        .order_by(workflow_events.c.seq)
    ).all())


def read_history(conn: Connection, key: Key, run_no: int, fence_token: int, wake_seq: int,
                 history_len: int, known: tuple[Any, Any, Any] | None = None,
                 ) -> dict[int, Any]:
    """The run's history by seq, for the advance that just claimed workflow ``key`` (its
    ``run_no``, new ``fence_token``, ``wake_seq`` and ``history_len`` as the claim read
    them), in the claim's transaction (see the module's docstring).

    ``known``: ``(run, wake_seq, event)`` of the activity completion this process committed
    right before this advance, whose wake it answers (its run, the ``wake_seq`` it set, its
    event as stored); None (any other wake): the whole history."""
    _stats["reads"] += 1
    entry = _take(key)
    pk = key[1]
    if entry is None or known is None:
        return load_history(conn, pk, run_no)
    k_run, k_wake, event = known
    if (entry.run_no != run_no or k_run != run_no or entry.fence_token + 1 != fence_token
            or not k_wake == wake_seq == entry.wake_seq + 1):
        _stats["misses"] += 1
        return load_history(conn, pk, run_no)
    history = dict(entry.history)
    if event.seq == entry.low and history_len == len(history) + 1:
        history[event.seq] = event
        _stats["hits"] += 1
        _stats["unread"] += 1
        return history
    for row in _since(conn, pk, run_no, entry.low):
        history[row.seq] = row
    if len(history) != history_len:  # not what the row counts: read it all
        _stats["misses"] += 1
        return load_history(conn, pk, run_no)
    _stats["hits"] += 1
    return history
