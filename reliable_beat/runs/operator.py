"""Runs: what operators do to them: free a stuck lease, requeue a dead letter.

``reliable-beat lease clear`` (:func:`release_lease`) and ``dead-letters requeue``
(:func:`requeue_dead_letter`, :func:`mark_dispatched`, :func:`undo_requeue`), also called
by the dashboard and the Django admin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from reliable_beat import unsent
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, outbox, runs
from reliable_beat.errors import DeadLetterNotFound, RunNotFound
from reliable_beat.outbox import _notify_once
from reliable_beat.runs.claim import _FREE_STATES
from reliable_beat.slots import parse_fire_at
from reliable_beat.triggers import TRIGGER_DESTINATIONS, trigger_message_id

__all__ = [
    "NOT_RESENT",
    "REQUEUEABLE_MESSAGE_REASONS",
    "RESEND_SKIPPED",
    "RESENT",
    "UNSTORABLE",
    "LeaseCleared",
    "clear_lease",
    "dismiss_dead_letter",
    "mark_dispatched",
    "release_lease",
    "requeue_dead_letter",
    "requeue_dead_message",
    "requeue_outbox_dead_letter",
    "undo_requeue",
]


#: ``LeaseCleared.resend`` values: what :func:`release_lease` did about the run's message.
RESENT = "resent"
NOT_RESENT = "not_resent"
RESEND_SKIPPED = "skipped"


@dataclass(frozen=True)
class LeaseCleared:
    """The outcome of :func:`release_lease` (what ``reliable-beat lease clear`` prints).

    Attributes:
        key: the run's idempotency key.
        fence_token: the run's fence token after the clear (the old holder's + 1).
        previous_state: the run's state before (``running`` when a lease was held).
        state: the run's state after (``retrying`` for a run that was ``running``;
            otherwise unchanged).
        holder: ``leased_by`` before the clear (None: nobody held a lease).
        lease_expires_at: the cleared lease's end (UTC), or None.
        fenced_out_attempts: the holder's ``running`` attempt rows closed ``fenced_out``.
        resend: ``resent`` (the run's trigger outbox row is ``pending`` again, due now, in
            the clear's transaction: a relay or beat publishes it), ``not_resent`` (it
            could not be: :attr:`note` says why and what to do) or ``skipped`` (asked not
            to, or the run was not ``running``: nothing to re-send).
        message_id: the outbox message re-sent (``trigger:<key>``), when ``resent``.
        destination: its outbox destination (``celery``, ``dramatiq``), when ``resent``.
        note: one sentence on what happened to the run's message.
    """

    key: str
    fence_token: int
    previous_state: str
    state: str
    holder: str | None
    lease_expires_at: datetime | None
    fenced_out_attempts: int
    resend: str
    message_id: str | None
    destination: str | None
    note: str

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (instants stay datetimes)."""
        return {
            "key": self.key, "fence_token": self.fence_token,
            "previous_state": self.previous_state, "state": self.state,
            "holder": self.holder, "lease_expires_at": self.lease_expires_at,
            "fenced_out_attempts": self.fenced_out_attempts, "resend": self.resend,
            "message_id": self.message_id, "destination": self.destination,
            "note": self.note,
        }


def clear_lease(store: Store, key: str) -> int:
    """Free a lease and fence its holder out, re-sending nothing.

    :func:`release_lease` with ``resend=False`` (the testing kit's "the lease expired").

    Returns:
        The new fence token.

    Raises:
        RunNotFound: no run has ``key``.
    """
    return release_lease(store, key, resend=False).fence_token


def release_lease(store: Store, key: str, *, resend: bool = True) -> LeaseCleared:
    """Free a stuck lease: bump the fence so the old holder is fenced out, and re-send.

    The documented way out when a worker holds a lease it will never finish (a process
    frozen for hours with a long lease; ``reliable-beat lease clear``). In **one**
    transaction:

    * ``fence_token += 1``, ``leased_by`` / ``lease_expires_at`` cleared; a ``running`` run
      becomes ``retrying`` (other states are kept). The old holder's renewal then returns
      False and its commit raises :class:`StaleFenceToken` (everything it wrote rolls
      back), so the re-sent message's runner is the only one that can commit.
    * the holder's ``running`` attempt rows become ``fenced_out`` (``finished_at`` = now,
      the error names the clear), so the attempt history does not show a try running
      forever. (A holder that comes back records the same outcome again.)
    * with ``resend`` and a run that was ``running``: its trigger outbox row
      (``trigger:<key>``, destination ``celery`` / ``dramatiq``) is made ``pending`` again,
      due now (``available_at`` = the database's now, unclaimed; PostgreSQL: a ``NOTIFY``
      wakes the relays). A relay, or a beat's sweep of unsent triggers, publishes it: the
      same message (task id, idempotency key) as the first delivery, so a duplicate is
      deduplicated by the key. A crash after the commit loses nothing: the row is in the
      store. A periodic run whose trigger was published with no row (the beat's fast path)
      gets its row now (:func:`reliable_beat.unsent.write_run_trigger`: built as the beat
      builds it, with the entry's options). Not re-sent (``resend = not_resent``,
      :attr:`LeaseCleared.note` says why): a run of no entry with no trigger row (an ad-hoc
      call: its sender holds the message; a workflow activity: the workflow sweep re-sends
      it) and a trigger whose ``expires_at`` passed.

    Idempotent in effect (a second clear bumps the fence again and re-sends nothing: the
    run is no longer ``running``). Safe from several processes (the run row is locked on
    PostgreSQL and MySQL/MariaDB; SQLite serialises writers).

    Args:
        store: the store.
        key: the run's idempotency key.
        resend: re-send the run's trigger (default); False: only fence and free.

    Returns:
        The :class:`LeaseCleared` outcome (committed).

    Raises:
        RunNotFound: no run has ``key``.
        StoreUnavailableError: the database cannot be reached (nothing was changed).
    """
    with store.begin() as conn:
        now = store.now(conn)
        stmt = select(runs.c.id, runs.c.state, runs.c.fence_token, runs.c.leased_by,
                      runs.c.lease_expires_at).where(runs.c.idempotency_key == key)
        if store.dialect != "sqlite":
            stmt = stmt.with_for_update()
        row = conn.execute(stmt).one_or_none()
        if row is None:
            raise RunNotFound(f"no run with key {key!r}")
        fence = int(row.fence_token) + 1
        was_running = row.state == "running"
        new_state = "retrying" if was_running else row.state
        conn.execute(
            update(runs)
            .where(runs.c.id == row.id)
            .values(
                fence_token=fence,
                leased_by=None,
                lease_expires_at=None,
                state=new_state,
                updated_at=now,
                # a cleared run is due at once: the sweep re-sends it if nothing else does
                **({"retry_at": now, "redispatches": 0} if was_running else {}),
            )
        )
        holder = row.leased_by
        closed = conn.execute(
            update(attempts)
            .where(attempts.c.run_id == row.id, attempts.c.outcome == "running")
            .values(
                outcome="fenced_out",
                finished_at=now,
                error=f"lease of {holder or 'nobody'} cleared (`reliable-beat lease clear`): "
                f"fence token {row.fence_token} -> {fence}; this try can no longer commit "
                "(its writes roll back)",
            )
        ).rowcount or 0
        outcome: dict[str, Any] = {"resend": RESEND_SKIPPED, "message_id": None,
                                   "destination": None}
        if not was_running:
            note = (f"run was {row.state}, not running: nothing re-sent"
                    + (" (no worker holds it)" if row.state in _FREE_STATES else ""))
        elif not resend:
            note = ("not re-sent (--no-resend): the next delivery of its message (broker "
                    "redelivery, a retry) or the re-dispatch sweep runs it")
        else:
            mid = trigger_message_id(key)
            trigger_row = (
                select(outbox.c.id, outbox.c.destination, outbox.c.payload).where(
                    outbox.c.message_id == mid,
                    outbox.c.destination.in_(sorted(TRIGGER_DESTINATIONS))))
            trig = conn.execute(trigger_row).first()
            if trig is None and unsent.write_run_trigger(store, conn, row.id, now):
                trig = conn.execute(trigger_row).first()  # a slot's trigger sent with no row
            expires = _trigger_expires_at(trig.payload) if trig is not None else None
            if trig is None:
                outcome["resend"] = NOT_RESENT
                note = ("not re-sent: the run has no trigger row to re-send ("
                        + ("a workflow activity: the workflow sweep re-sends it"
                           if key.startswith("wf:") else
                           "an ad-hoc call: its sender holds the message; call the task "
                           "again with the same idempotency key")
                        + ", or the broker redelivers it)")
            elif expires is not None and expires <= now:
                outcome["resend"] = NOT_RESENT
                note = (f"not re-sent: its trigger expired at {expires.isoformat()} (the "
                        "entry's `expires` option); the run stays retrying")
            else:
                conn.execute(
                    update(outbox).where(outbox.c.id == trig.id).values(
                        state="pending", available_at=now, claimed_by=None, sent_at=None,
                        last_error=None)
                )
                if store.dialect == "postgresql":
                    _notify_once(conn, trig.destination)
                outcome = {"resend": RESENT, "message_id": mid,
                           "destination": trig.destination}
                note = (f"re-sent: outbox row {mid!r} ({trig.destination}) is pending again, "
                        "due now; a relay or beat publishes it")
        return LeaseCleared(
            key=key, fence_token=fence, previous_state=str(row.state), state=str(new_state),
            holder=holder, lease_expires_at=row.lease_expires_at if was_running else None,
            fenced_out_attempts=int(closed), note=note, **outcome,
        )


def _trigger_expires_at(payload: Any) -> datetime | None:
    """A trigger payload's ``expires_at`` (ISO 8601 UTC text) as a datetime, or None (also
    when malformed). Read by :func:`reliable_beat.slots.parse_fire_at`: no zone is UTC."""
    text_value = payload.get("expires_at") if isinstance(payload, Mapping) else None
    if not isinstance(text_value, str):
        return None
    try:
        return parse_fire_at(text_value, "expires_at")
    except ValueError:
        return None


def requeue_dead_letter(
    store: Store, dead_letter_id: int, *, by: str, force: bool = False
) -> dict[str, Any]:
    """Reset a dead run so it can run again under the same key (one short transaction).

    The run goes back to ``scheduled`` with ``attempts = 0`` (a fresh retry budget; fence
    tokens keep increasing, so old and new attempt rows stay distinguishable), its lease,
    error and reason cleared; the dead letter gets ``requeued_at`` / ``requeued_by`` and is
    kept (history is never deleted). The caller then sends the task again (the payload says
    how) and calls :func:`mark_dispatched`; if sending fails, :func:`undo_requeue`.

    Args:
        store: the store.
        dead_letter_id: ``reliable_beat_dead_letters.id``.
        by: who decided (recorded in ``requeued_by``).
        force: requeue even if this dead letter was requeued before.

    Returns:
        The dead letter as a dict (``payload`` holds ``task``, ``args``, ``kwargs``, ``key``).

    Raises:
        DeadLetterNotFound: no such id, or it is not a run dead letter.
        ValueError: already requeued or handled (dismissed; without ``force``), the run is
            not ``dead``, or
            its effect committed (a try completed, or outbox rows were written with it):
            running it again would repeat the effect, ``force`` or not.
    """
    with store.begin() as conn:
        now = store.now(conn)
        dl = conn.execute(
            select(dead_letters).where(dead_letters.c.id == dead_letter_id)
        ).mappings().one_or_none()
        if dl is None or dl["kind"] != "run":
            raise DeadLetterNotFound(f"no run dead letter with id {dead_letter_id}")
        committed = _committed_effect(conn, dl["run_id"])
        if committed:
            raise ValueError(
                f"dead letter {dead_letter_id}: the run's effect committed ({committed}); "
                "running it again would repeat the effect, so it is not requeued"
            )
        _refuse_repeat(dl, force)
        done = conn.execute(
            update(runs)
            .where(runs.c.id == dl["run_id"], runs.c.state == "dead")
            .values(
                state="scheduled",
                attempts=0,
                error=None,
                reason=None,
                leased_by=None,
                lease_expires_at=None,
                finished_at=None,
                updated_at=now,
            )
        )
        if done.rowcount != 1:
            raise ValueError(f"run of dead letter {dead_letter_id} is not dead; not requeued")
        conn.execute(
            update(dead_letters)
            .where(dead_letters.c.id == dead_letter_id)
            .values(requeued_at=now, requeued_by=by)
        )
        return dict(dl)


#: The ``message`` dead letters a person can send again (a worker dropped the message
#: because no task of that name was registered there; see
#: :mod:`reliable_beat.celery.lost_messages`).
REQUEUEABLE_MESSAGE_REASONS = frozenset({"unregistered"})
#: The key of the stand-in a ``message`` dead letter keeps for arguments the store cannot
#: take (their ``repr``): such a dead letter is not requeueable.
UNSTORABLE = "reliable_beat_unstorable"


def _locked_dead_letter(conn: Connection, dead_letter_id: int, *, kind: str | None
                        ) -> Any:
    """The dead letter ``dead_letter_id`` (of ``kind``, None: any), locked for this
    transaction.

    Raises:
        DeadLetterNotFound: no such dead letter (of that kind).
    """
    dl = conn.execute(
        select(dead_letters).where(dead_letters.c.id == dead_letter_id).with_for_update()
    ).mappings().one_or_none()
    if dl is None or (kind is not None and dl["kind"] != kind):
        what = f"{kind} dead letter" if kind else "dead letter"
        raise DeadLetterNotFound(f"no {what} with id {dead_letter_id}")
    return dl


def requeue_dead_message(
    store: Store, dead_letter_id: int, *, by: str, force: bool = False
) -> dict[str, Any]:
    """Mark a ``message`` dead letter of a dropped task message requeued (one short
    transaction); the caller then sends the message again (its ``payload`` says what) and,
    if sending fails, calls :func:`undo_requeue`.

    Raises:
        DeadLetterNotFound: no such id, or it is not a ``message`` dead letter.
        ValueError: not requeueable (its reason is not ``unregistered``: the message itself
            must be fixed and sent again by its caller), or requeued before (without
            ``force``).
    """
    with store.begin() as conn:
        now = store.now(conn)
        dl = _locked_dead_letter(conn, dead_letter_id, kind="message")
        if dl["reason"] not in REQUEUEABLE_MESSAGE_REASONS:
            raise ValueError(
                f"dead letter {dead_letter_id} ({dl['reason']}) is not requeueable: the "
                "message itself was refused; fix the caller and send the work again")
        _refuse_repeat(dl, force)
        conn.execute(
            update(dead_letters)
            .where(dead_letters.c.id == dead_letter_id)
            .values(requeued_at=now, requeued_by=by)
        )
        return dict(dl)


def _committed_effect(conn: Connection, run_id: int) -> str | None:
    """Evidence that run ``run_id``'s effect committed, or None.

    A try that completed (attempt outcome ``succeeded``) committed the effect with the key;
    an outbox row stamped with the run was written in the effect's transaction. Either
    means the body's work is done: repeating it would do it twice. The run's own trigger
    row (:func:`~reliable_beat.triggers.trigger_message_id`, written by the beat or a manual
    trigger before the body ran) is how the run was sent, not an effect.
    """
    done = conn.execute(
        select(attempts.c.attempt).where(
            attempts.c.run_id == run_id, attempts.c.outcome == "succeeded"
        ).limit(1)
    ).first()
    if done is not None:
        return f"try {done.attempt} completed"
    key = conn.execute(select(runs.c.idempotency_key).where(runs.c.id == run_id)).scalar()
    sent = conn.execute(
        select(func.count()).select_from(outbox).where(
            outbox.c.run_id == run_id,
            outbox.c.message_id != trigger_message_id(key or ""),
        )
    ).scalar_one()
    if sent:
        return f"{sent} outbox row(s) were written with it"
    return None


def undo_requeue(store: Store, dead_letter_id: int) -> None:
    """Put a requeued run back to ``dead`` after the re-send failed (short transaction); a
    ``message`` dead letter (no run) is only marked not requeued again."""
    with store.begin() as conn:
        dl = conn.execute(
            select(dead_letters.c.run_id).where(dead_letters.c.id == dead_letter_id)
        ).one()
        if dl.run_id is not None:
            conn.execute(
                update(runs)
                .where(runs.c.id == dl.run_id, runs.c.state == "scheduled")
                .values(state="dead", reason="requeue_failed")
            )
        conn.execute(
            update(dead_letters)
            .where(dead_letters.c.id == dead_letter_id)
            .values(requeued_at=None, requeued_by=None)
        )


def mark_dispatched(store: Store, key: str) -> bool:
    """``scheduled -> dispatched`` after the task message was published (short transaction).

    Returns:
        True when the state changed (False if a worker already picked the run up).
    """
    with store.begin() as conn:
        now = store.now(conn)
        done = conn.execute(
            update(runs)
            .where(runs.c.idempotency_key == key, runs.c.state == "scheduled")
            .values(state="dispatched", dispatched_at=now, updated_at=now)
        )
        return done.rowcount == 1


def requeue_outbox_dead_letter(
    store: Store, dead_letter_id: int, *, by: str, force: bool = False
) -> dict[str, Any]:
    """Deliver the outbox row of an ``outbox`` dead letter again (one short transaction): the
    row goes back to ``pending`` with a fresh attempt budget, due now, and keeps its
    ``message_id`` (the far end still deduplicates on it); the dead letter records
    ``requeued_at`` / ``requeued_by``. A relay delivers it on its next claim.

    A ``malformed`` row must be repaired first (`dead-letters show` holds it as it was): one
    still malformed is dead-lettered again by the relay, visibly.

    Raises:
        DeadLetterNotFound: no such id, or it is not an ``outbox`` dead letter.
        ValueError: requeued before (without ``force``), or its outbox row is gone (purged)
            or not ``dead``; nothing changed.
    """
    with store.begin() as conn:
        now = store.now(conn)
        dl = _locked_dead_letter(conn, dead_letter_id, kind="outbox")
        _refuse_repeat(dl, force)
        moved = conn.execute(
            update(outbox).where(outbox.c.id == dl["outbox_id"], outbox.c.state == "dead")
            .values(state="pending", attempts=0, available_at=now, last_error=None,
                    claimed_by=None)
        ).rowcount
        if moved != 1:
            raise ValueError(
                f"dead letter {dead_letter_id}: its outbox row {dl['outbox_id']} is gone "
                "(purged) or not dead; not requeued (add the message again with "
                "outbox.add, same key, from the dead letter's payload)")
        conn.execute(update(dead_letters).where(dead_letters.c.id == dead_letter_id)
                     .values(requeued_at=now, requeued_by=by))
        destination = conn.execute(
            select(outbox.c.destination).where(outbox.c.id == dl["outbox_id"])).scalar()
        if isinstance(destination, str) and store.dialect == "postgresql":
            _notify_once(conn, destination)
        return dict(dl)


def _refuse_repeat(dl: Any, force: bool) -> None:
    """Refuse (ValueError) to requeue a dead letter a person already decided on, unless
    ``force``: one requeued before, or one handled (dismissed by a person, or handled by
    design such as a saga's compensated step). Both need the same ``--force``."""
    if force:
        return
    if dl["requeued_at"] is not None:
        done = f"was requeued at {dl['requeued_at']} by {dl['requeued_by']}"
    elif dl["handled_at"] is not None:
        by = str(dl["handled_by"] or "")
        done = (f"was dismissed at {dl['handled_at']} by {by.removesuffix(' (dismissed)')}"
                if by.endswith(" (dismissed)")
                else f"was handled at {dl['handled_at']} by {by}")
    else:
        return
    raise ValueError(
        f"dead letter {dl['id']} {done}; to requeue it anyway pass --force "
        f"(`reliable-beat dead-letters requeue {dl['id']} --force`)")


def dismiss_dead_letter(store: Store, dead_letter_id: int, *, by: str) -> dict[str, Any]:
    """Mark a dead letter handled by a person who decided not to replay it: it stays listed
    (``dead-letters list`` shows who and when) but no longer counts as waiting for a person
    in ``status --check`` or the metrics (``handled_at`` / ``handled_by = "<by>
    (dismissed)"``).

    Raises:
        DeadLetterNotFound: no such id.
        ValueError: already requeued or handled; nothing changed.
    """
    with store.begin() as conn:
        now = store.now(conn)
        dl = _locked_dead_letter(conn, dead_letter_id, kind=None)
        if dl["requeued_at"] is not None or dl["handled_at"] is not None:
            done = (f"requeued at {dl['requeued_at']} by {dl['requeued_by']}"
                    if dl["requeued_at"] is not None
                    else f"handled at {dl['handled_at']} by {dl['handled_by']}")
            raise ValueError(f"dead letter {dead_letter_id} was already {done}")
        conn.execute(update(dead_letters).where(dead_letters.c.id == dead_letter_id)
                     .values(handled_at=now, handled_by=f"{by} (dismissed)"[:200]))
        return dict(dl)
