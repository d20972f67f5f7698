"""Operator actions: fire an entry now, backfill a window, requeue a dead run.

These are the verbs behind ``reliable-beat entries trigger|backfill`` and ``dead-letters
requeue``, and the Django admin's and the dashboard's actions of those names; they are
framework-neutral (an app is optional for a trigger or a backfill and only used to publish at
once; a requeue sends the task through it).

* :func:`trigger` fires an entry once, now, under its own key
  (``"<entry>@manual:<db now, ISO 8601 UTC with microseconds>"``). The run has
  ``trigger='manual'`` and ``fire_at`` NULL, so it can never collide with a slot's
  UNIQUE(entry, fire_at) and the schedule is untouched.
* :func:`backfill` creates the runs of every slot in ``[start, end)`` that has none
  (``trigger='backfill'``, the slot's own key, so a later backfill or the beat itself is a
  no-op for it).
* :func:`requeue_dead_run` runs a dead run again under the **same** idempotency key: a
  person's decision, recorded with who made it; nothing is ever requeued automatically.

Triggers are written to the outbox in the same transaction as their runs, with
``available_at = now``: the relay (or a beat's sweep) publishes them; when an app is given
they are also published at once and marked sent (a crash between the two only means the
relay sends them again: delivery is at-least-once). :mod:`reliable_beat.ops.describe`
answers the five questions an operator asks of a job.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from reliable_beat import runs as rb_runs
from reliable_beat import schedules as sch
from reliable_beat.adapters import adapter_for, app_settings
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.entries import notify_entries_changed
from reliable_beat.errors import ConfigurationError, EntryNotFoundError, ReliableBeatError
from reliable_beat.groups import schedule_group_of
from reliable_beat.identity import store_id as _store_id
from reliable_beat.redaction import get_logger
from reliable_beat.rows import MALFORMED, check_options, check_run_call
from reliable_beat.slots import idempotency_key
from reliable_beat.triggers import (
    TRIGGER_DESTINATION,
    TRIGGER_DESTINATIONS,
    Trigger,
    build_trigger_payload,
    trigger_message_id,
    trigger_outbox_row,
)

__all__ = [
    "KEY_HEADER",
    "BackfillLimitError",
    "BackfillResult",
    "RequeueSendError",
    "app_publishes",
    "backfill",
    "manual_key",
    "requeue_dead_message",
    "requeue_dead_run",
    "requeue_payload",
    "requeue_payload_problem",
    "require_entry",
    "trigger",
]

# the name operators' log configurations know these records by
log = get_logger("reliable_beat.runtime")

class BackfillLimitError(ConfigurationError):
    """A backfill window holds more slots than the limit; narrow it or force it.

    Attributes:
        slots: how many slots were counted (at least ``limit + 1``; counting stops there).
        limit: the limit in force (``reliable_beat_backfill_limit``).
    """

    def __init__(self, entry: str, slots: int, limit: int) -> None:
        self.slots = slots
        self.limit = limit
        super().__init__(
            f"entry {entry!r}: the backfill window holds more than {limit} slots "
            f"(reliable_beat_backfill_limit); narrow START/END or pass --force"
        )


@dataclass
class BackfillResult:
    """What one backfill did.

    Attributes:
        entry: the entry name.
        slots: slots of the schedule in the window, up to the database's now.
        created: runs inserted (each has its trigger: sent now, queued, or buffered).
        existing: slots that already had a run (untouched; never a second run).
        buffered: created runs held as ``buffered`` because the entry's overlap policy is
            ``skip`` or ``buffer_one``: the beat releases them one at a time, oldest first,
            whenever the entry has no active run.
        future: slots of the window after the database's now, ignored (the beat fires them).
        keys: idempotency keys of the created runs, ascending by slot.
        published: triggers published at once (an app was given).
    """

    entry: str
    slots: int = 0
    created: int = 0
    existing: int = 0
    buffered: int = 0
    future: int = 0
    keys: list[str] = field(default_factory=list)
    published: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The result as a JSON-serialisable dict."""
        return {
            "entry": self.entry,
            "slots": self.slots,
            "created": self.created,
            "existing": self.existing,
            "buffered": self.buffered,
            "future": self.future,
            "keys": list(self.keys),
            "published": self.published,
        }


def require_entry(conn: Connection, name: str) -> Any:
    """The stored row of entry ``name``.

    Raises:
        EntryNotFoundError: no such entry (the message names the command that lists them).
    """
    row = conn.execute(select(entries).where(entries.c.name == name)).first()
    if row is None:
        raise EntryNotFoundError(f"no entry named {name!r} (see `reliable-beat entries list`)")
    return row


def manual_key(name: str, now: datetime) -> str:
    """The idempotency key of a manual trigger: ``"<name>@manual:<now ISO, µs, Z>"``.

    Args:
        name: the entry name.
        now: the database clock at the request (tz-aware; microseconds kept, so two
            triggers in the same second get two keys).

    Raises:
        ValueError: ``now`` is naive.
    """
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("manual_key needs a tz-aware instant")
    return f"{name}@manual:{now.astimezone(timezone.utc):%Y-%m-%dT%H:%M:%S.%fZ}"


def _outbox_row(key: str, run_id: int, payload: dict[str, Any], now: datetime,
                destination: str = TRIGGER_DESTINATION) -> dict[str, Any]:
    """A trigger outbox row (the beat's shape), due at once (``available_at = now``), for
    ``destination`` (``celery``; ``dramatiq`` for the Dramatiq adapter's CLI)."""
    return trigger_outbox_row(key, run_id, payload, now, available_at=now, claimed_by=None,
                              destination=destination)


def app_publishes(app: Any, schedule_group: str | None) -> bool:
    """True when ``app`` may publish the triggers of an entry of ``schedule_group`` into its
    broker: the entry has no group, or it is the app's own
    (:func:`~reliable_beat.groups.schedule_group_of`). Another group's triggers would reach
    the wrong app's workers (lost as an unregistered task): they are left in the outbox for a
    beat or relay of their own group. False when ``app`` is None."""
    if app is None:
        return False
    if schedule_group is None:
        return True
    return schedule_group_of(app, app_settings(app).schedule_group) == schedule_group


def _publisher(app: Any, name: str, schedule_group: str | None) -> Any:
    """``app`` if it may publish entry ``name``'s triggers (:func:`app_publishes`), else
    None (logged: the outbox row waits for the entry's own group)."""
    if app is None or app_publishes(app, schedule_group):
        return app
    log.warning(
        "entry %r belongs to schedule group %r, not to app %r: its triggers stay in the "
        "outbox for a beat's sweep or a relay of %r (publishing them into this app's broker "
        "would lose them)", name, schedule_group, getattr(app, "main", app), schedule_group,
    )
    return None


def _publish(store: Store, app: Any, triggers: list[Trigger], now: datetime) -> int:
    return adapter_for(app).publish_triggers(store, app, triggers, now)


def _destination_of(app: Any, destination: str | None) -> str:
    """``destination``, else the trigger destination of ``app``'s framework (its adapter's
    name when it is one of :data:`~reliable_beat.beat.TRIGGER_DESTINATIONS`: ``dramatiq``
    for a Dramatiq broker), else ``celery``."""
    if destination is not None:
        return destination
    if app is None:
        return TRIGGER_DESTINATION
    name = adapter_for(app).name
    return name if name in TRIGGER_DESTINATIONS else TRIGGER_DESTINATION


def trigger(store: Store, name: str, *, app: Any = None,
            destination: str | None = None) -> str:
    """Fire entry ``name`` once, now, outside its schedule.

    In one transaction: insert a run (``trigger='manual'``, ``fire_at`` NULL, state
    ``scheduled``) under :func:`manual_key` and its trigger outbox row (``available_at`` =
    the database's now, so the relay delivers it). With ``app``, the trigger is also
    published at once and marked sent. The schedule (``next_fire_at``) is not touched, and
    the overlap policy does not apply: a manual trigger is a person's explicit request.
    Works on paused entries too (pausing stops the schedule, not an operator).

    Args:
        store: the store.
        name: the entry name.
        app: a Celery app to publish with at once (None: leave it to the relay). Only for an
            entry of its schedule group or of none (:func:`app_publishes`); another group's
            trigger is left to that group's beat sweep or relay.
        destination: the trigger row's outbox destination (a member of
            :data:`~reliable_beat.beat.TRIGGER_DESTINATIONS`): ``celery``, or ``dramatiq``
            for an entry of a Dramatiq actor (``reliable-beat dramatiq entries trigger``
            publishes it through the broker at once); None (default): ``app``'s framework's
            (``dramatiq`` for a Dramatiq broker), ``celery`` without an app.

    Returns:
        The run's idempotency key.

    Raises:
        EntryNotFoundError: no such entry.
        ConfigurationError: the stored entry is malformed (quarantined).
        StoreUnavailableError: the database is down (nothing was written).
    """
    destination = _destination_of(app, destination)
    sid = _store_id(store)  # outside the transaction (SQLite: one writer)
    with store.begin() as conn:
        row = require_entry(conn, name)
        app = _publisher(app, name, row.schedule_group)
        malformed = check_run_call(row.task, row.args, row.kwargs) + check_options(row.options)
        if malformed:  # a quarantined row (reliable_beat.rows): refuse, naming the fix
            raise ConfigurationError(
                f"entry {name!r} is malformed ({'; '.join(malformed)}): fix it first "
                f"(`reliable-beat entries update {name}` or the beat_schedule)"
            )
        now = store.now(conn)
        key = manual_key(name, now)
        run_id = conn.execute(
            runs.insert().returning(runs.c.id),
            [{
                "idempotency_key": key, "entry_name": name, "fire_at": None,
                "trigger": "manual", "task": row.task, "args": row.args, "kwargs": row.kwargs,
                "state": "scheduled", "reason": "manual trigger", "created_at": now,
                "updated_at": now,
            }],
        ).scalar_one()
        payload = build_trigger_payload(
            task=row.task, args=row.args, kwargs=row.kwargs, options=row.options, key=key,
            entry=name, fire_at=now, trigger="manual", store_id=sid, destination=destination,
        )
        oid = conn.execute(
            outbox.insert().returning(outbox.c.id),
            [_outbox_row(key, run_id, payload, now, destination)]
        ).scalar_one()
    if app is not None:
        _publish(store, app, [Trigger(oid, run_id, key, payload, now)], now)
    return key


def _aware(value: datetime, what: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ConfigurationError(
            f"{what}={value.isoformat()!r} is naive: give a UTC offset (e.g. ...Z or +02:00)"
        )
    return value.astimezone(timezone.utc)


def _in_skipped_ranges(conn: Connection, name: str, slots: list[datetime]) -> set[datetime]:
    """The ``slots`` that lie inside a recorded skipped range of entry ``name``.

    After a long downtime the beat records the older skipped slots as **one** ``skipped``
    run row keyed by the first slot (``result = {"skipped_range": {"first", "last",
    "count"}}``, see :mod:`reliable_beat.beat`). Every slot of that range is recorded (as
    skipped) just as a slot with its own skipped row is, so backfill leaves them alone too.
    """
    found: set[datetime] = set()
    ranges = conn.execute(
        select(runs.c.result).where(
            runs.c.entry_name == name, runs.c.state == "skipped",
            runs.c.fire_at <= slots[-1], runs.c.reason.contains("; slots "),
        )
    ).scalars()
    for result in ranges:
        rng = result.get("skipped_range") if isinstance(result, dict) else None
        if not isinstance(rng, dict):
            continue
        try:
            first = datetime.fromisoformat(str(rng["first"]).replace("Z", "+00:00"))
            last = datetime.fromisoformat(str(rng["last"]).replace("Z", "+00:00"))
        except (KeyError, ValueError):
            continue  # a malformed range row: its slots are not known, treat as unrecorded
        found.update(slot for slot in slots if first <= slot <= last)
    return found


def backfill(
    store: Store,
    name: str,
    start: datetime,
    end: datetime,
    *,
    limit: int,
    force: bool = False,
    app: Any = None,
    destination: str | None = None,
) -> BackfillResult:
    """Create the runs of every slot of ``name`` in ``[start, end)`` that has none.

    Slots come from the entry's schedule (its time zone and DST rule), bounded by the
    database's now: slots still in the future are left to the beat. Each created run has the
    slot's ordinary idempotency key (``"<entry>@<slot>"``) and ``trigger='backfill'``; the
    insert is ``ON CONFLICT DO NOTHING``, so a slot that has a run (fired, skipped, or made by
    an earlier backfill) is never run twice, and backfilling the same window again creates
    nothing. A slot inside a recorded skipped *range* (one row standing for many skipped
    slots after a long downtime) counts as skipped, like a slot with its own skipped row: it
    is left alone (``entries trigger`` runs a skipped slot's work by hand).

    Overlap: for an ``allow`` entry every created run is ``scheduled`` and triggered at once.
    For ``skip`` and ``buffer_one`` entries the created runs are ``buffered``: the beat releases
    one at a time, oldest first, whenever the entry has no active run (so a backfill never
    makes a job overlap itself). The entry's misfire policy does not apply: a backfill is an
    explicit request for those slots.

    Args:
        store: the store.
        name: the entry name.
        start / end: tz-aware window bounds (any offset; half-open, ``start`` included).
        limit: most slots one backfill may create (``reliable_beat_backfill_limit``).
        force: create them even when the window holds more than ``limit`` slots.
        app: a Celery app to publish the scheduled triggers with at once (None: the relay
            delivers them). Only for an entry of its schedule group or of none
            (:func:`app_publishes`).
        destination: the trigger rows' outbox destination (see :func:`trigger`).

    Returns:
        Counts and keys; see :class:`BackfillResult`.

    Raises:
        EntryNotFoundError: no such entry.
        ConfigurationError: naive bounds, or ``start >= end``.
        BackfillLimitError: more than ``limit`` slots in the window and not ``force``.
        StoreUnavailableError: the database is down (nothing was written).
    """
    start = _aware(start, "START")
    end = _aware(end, "END")
    if start >= end:
        raise ConfigurationError(
            f"entry {name!r}: backfill window is empty: START {start.isoformat()} must be "
            f"before END {end.isoformat()}"
        )
    destination = _destination_of(app, destination)
    result = BackfillResult(entry=name)
    triggers: list[Trigger] = []
    destination = _destination_of(app, destination)
    sid = _store_id(store)  # outside the transaction (SQLite: one writer)
    with store.begin() as conn:
        row = require_entry(conn, name)
        app = _publisher(app, name, row.schedule_group)
        now = store.now(conn)
        schedule = sch.schedule_from_spec(row.schedule)
        upto = min(end, now + timedelta(microseconds=1))  # slots at or before now
        result.future = 0
        if end > upto:
            cap = limit + 1
            result.future = sum(1 for _ in itertools.islice(schedule.slots_between(upto, end), cap))
        window = schedule.slots_between(start, upto) if start < upto else iter(())
        slots = list(window if force else itertools.islice(window, limit + 1))
        if not force and len(slots) > limit:
            raise BackfillLimitError(name, len(slots), limit)
        result.slots = len(slots)
        if not slots:
            return result
        existing: set[datetime] = set()
        for chunk_start in range(0, len(slots), 1000):
            chunk = slots[chunk_start:chunk_start + 1000]
            existing.update(
                conn.execute(
                    select(runs.c.fire_at).where(
                        runs.c.entry_name == name, runs.c.fire_at.in_(chunk)
                    )
                ).scalars()
            )
        existing.update(_in_skipped_ranges(conn, name, slots))
        buffered = row.overlap_policy != "allow"
        state = "buffered" if buffered else "scheduled"
        rows = [
            {
                "idempotency_key": idempotency_key(name, slot), "entry_name": name,
                "fire_at": slot, "trigger": "backfill", "task": row.task, "args": row.args,
                "kwargs": row.kwargs, "state": state,
                "reason": f"backfill (overlap:{row.overlap_policy})" if buffered else "backfill",
                "created_at": now, "updated_at": now,
            }
            for slot in slots
            if slot not in existing
        ]
        by_key = {r["idempotency_key"]: r for r in rows}
        inserted: list[tuple[int, str]] = []
        for chunk_start in range(0, len(rows), 1000):
            batch = rows[chunk_start:chunk_start + 1000]
            inserted.extend(
                (int(i), str(k))
                for i, k in conn.execute(
                    store.insert_ignore(runs).returning(runs.c.id, runs.c.idempotency_key),
                    batch,
                ).all()
            )
        inserted.sort(key=lambda ik: by_key[ik[1]]["fire_at"])
        result.created = len(inserted)
        result.existing = len(slots) - len(inserted)
        result.keys = [k for _, k in inserted]
        if buffered:
            result.buffered = len(inserted)
            if inserted:
                notify_entries_changed(conn, store)  # wake a beat to release the first
        elif inserted:
            pending: list[tuple[int, str, dict[str, Any], datetime]] = []
            for run_id, key in inserted:
                r = by_key[key]
                payload = build_trigger_payload(
                    task=row.task, args=row.args, kwargs=row.kwargs, options=row.options,
                    key=key, entry=name, fire_at=r["fire_at"], trigger="backfill",
                    store_id=sid, destination=destination,
                )
                pending.append((run_id, key, payload, r["fire_at"]))
            ids = conn.execute(
                outbox.insert().returning(outbox.c.id, outbox.c.message_id),
                [_outbox_row(k, rid, p, now, destination) for rid, k, p, _ in pending],
            ).all()
            oid_by_mid = {mid: oid for oid, mid in ids}
            triggers = [
                Trigger(oid_by_mid[trigger_message_id(k)], rid, k, p, fa)
                for rid, k, p, fa in pending
            ]
    if app is not None and triggers:
        result.published = _publish(store, app, triggers, now)
    return result


# -- requeue -------------------------------------------------------------------------------

#: The header a requeued task carries its idempotency key in.
KEY_HEADER = "reliable_beat_key"


class RequeueSendError(ReliableBeatError, RuntimeError):
    """The requeued task could not be sent; the requeue was undone and the run stays dead.
    The message says why (the broker's error)."""


def requeue_payload_problem(payload: Any) -> str | None:
    """Why ``payload`` cannot be sent as a requeued task, or None. Sending needs
    ``{"task": str, "key": str, "args"?: list, "kwargs"?: dict, "headers"?: dict,
    "queue"?: str}``."""
    if not isinstance(payload, Mapping):
        return f"expected an object, got {type(payload).__name__}"
    problems = [f"{k} must be a non-empty string" for k in ("task", "key")
                if not isinstance(payload.get(k), str) or not payload.get(k)]
    for k, kind in (("args", list), ("kwargs", dict), ("headers", dict)):
        if payload.get(k) is not None and not isinstance(payload[k], kind):
            problems.append(f"{k} must be an {'array' if kind is list else 'object'}")
    if payload.get("queue") is not None and not isinstance(payload["queue"], str):
        problems.append("queue must be a string")
    return "; ".join(problems) or None


def requeue_payload(store: Store, dead_letter: Mapping[str, Any]) -> dict[str, Any]:
    """The task a requeue of run dead letter ``dead_letter`` (a
    :func:`reliable_beat.runs.get_dead_letter` dict) sends: its stored payload; for a
    ``malformed`` dead letter (its payload is the bad row as it was), the run row as it is
    now, once a person repaired it.

    Raises:
        ValueError: nothing sendable (names the problems and the fix); nothing changed.
    """
    dl_id = dead_letter["id"]
    payload: Any = dead_letter.get("payload")
    if dead_letter.get("reason") == MALFORMED:
        try:
            run = rb_runs.get_run(store, str(dead_letter.get("key")))
        except rb_runs.RunNotFound as exc:
            raise ValueError(f"dead letter {dl_id}: {exc}; nothing to requeue") from exc
        payload = {"task": run.get("task"), "key": run.get("idempotency_key"),
                   "args": run.get("args"), "kwargs": run.get("kwargs")}
        problem = requeue_payload_problem(payload)
        if problem:
            raise ValueError(
                f"dead letter {dl_id}: its run row is still malformed ({problem}); repair "
                "the row from the dead letter's payload (`reliable-beat dead-letters show "
                f"{dl_id}`), then requeue it")
        return dict(payload)
    problem = requeue_payload_problem(payload)
    if problem:
        raise ValueError(f"dead letter {dl_id}: its stored payload is malformed "
                         f"({problem}); the run stays dead")
    return dict(payload)


def requeue_dead_run(store: Store, app: Any, dead_letter_id: int, payload: Mapping[str, Any],
                     *, by: str, force: bool = False, queue: str | None = None) -> None:
    """Run the dead run of dead letter ``dead_letter_id`` again under the **same**
    idempotency key, through ``app``'s ``send_task`` (a Celery app).

    Resets the run (:func:`reliable_beat.runs.requeue_dead_letter`, recording ``by``), sends
    ``payload``'s task with its args, kwargs and headers plus the key header
    (:data:`KEY_HEADER`) under a fresh task id, to ``queue`` or else the queue it died on,
    then marks the run dispatched. If sending fails, the requeue is undone
    (:func:`reliable_beat.runs.undo_requeue`).

    Args:
        store: the store.
        app: the app whose ``send_task`` sends the task.
        dead_letter_id: the run dead letter.
        payload: its stored payload (``{"task", "key", "args"?, "kwargs"?, "headers"?,
            "queue"?}``), already checked by the caller.
        by: who decided (recorded on the dead letter).
        force: requeue even if it was requeued before.
        queue: the queue to send to (None: the payload's).

    Raises:
        ValueError: refused (the run's effect committed, requeued before without ``force``,
            ...), as :func:`reliable_beat.runs.requeue_dead_letter` says; nothing changed.
        DeadLetterNotFound: no such run dead letter (a ``LookupError``).
        RequeueSendError: the task could not be sent; the run stays dead.
    """
    rb_runs.requeue_dead_letter(store, dead_letter_id, by=by, force=force)
    headers = dict(payload.get("headers") or {})
    headers[KEY_HEADER] = payload["key"]
    try:
        app.send_task(payload["task"], args=payload.get("args") or [],
                      kwargs=payload.get("kwargs") or {}, headers=headers,
                      task_id=str(uuid.uuid4()), queue=queue or payload.get("queue"))
    except Exception as exc:
        rb_runs.undo_requeue(store, dead_letter_id)
        raise RequeueSendError(f"could not send the task ({exc}); the run stays dead") from exc
    rb_runs.mark_dispatched(store, payload["key"])


def requeue_dead_message(store: Store, app: Any, dead_letter_id: int,
                         payload: Mapping[str, Any], *, by: str, force: bool = False,
                         queue: str | None = None) -> None:
    """Send a dropped task message (a ``message`` dead letter, reason ``unregistered``)
    again through ``app``'s ``send_task``: the same task name, task id, arguments and the
    caller's headers (its idempotency key among them), to ``queue`` or else the queue it
    came from. The dead letter is marked requeued first
    (:func:`reliable_beat.runs.requeue_dead_message`, recording ``by``); if sending fails,
    that is undone.

    Raises:
        ValueError: not requeueable, or requeued before without ``force``; nothing changed.
        DeadLetterNotFound: no such ``message`` dead letter.
        RequeueSendError: the message could not be sent; the dead letter stays pending.
    """
    rb_runs.requeue_dead_message(store, dead_letter_id, by=by, force=force)
    args, kwargs = payload.get("args") or [], payload.get("kwargs") or {}
    if (not isinstance(args, list) or not isinstance(kwargs, Mapping)
            or rb_runs.UNSTORABLE in kwargs):
        rb_runs.undo_requeue(store, dead_letter_id)
        raise ValueError(f"dead letter {dead_letter_id}: its arguments could not be stored "
                         "(only their repr was kept); send the work again from its caller")
    try:
        app.send_task(str(payload["task"]), args=args, kwargs=dict(kwargs),
                      headers=dict(payload.get("headers") or {}),
                      task_id=payload.get("task_id") or str(uuid.uuid4()),
                      queue=queue or payload.get("queue"))
    except Exception as exc:
        rb_runs.undo_requeue(store, dead_letter_id)
        raise RequeueSendError(
            f"could not send the message ({exc}); the dead letter stays pending") from exc
