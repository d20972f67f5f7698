"""The trigger vocabulary: what a beat writes to fire a slot and every reader decodes.

A trigger is what fires a run: a message for the run's task, written as one outbox row
(destination ``celery`` or ``dramatiq``) unless the beat publishes it right after its claim
(then its run row is its record: :mod:`reliable_beat.unsent`). This module names the
destinations, derives a run's task id and trigger message id from its idempotency key, and
builds and reads the trigger payload in both shapes. It sits below
everything that writes or reads triggers (the beat, the relay, the re-dispatch sweep, the
run store, the adapters) and imports nothing of theirs.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from reliable_beat.slots import SlotText, format_fire_at

__all__ = [
    "ACTIVE_RUN_STATES",
    "TRIGGER_DESTINATION",
    "TRIGGER_DESTINATIONS",
    "Trigger",
    "build_trigger_payload",
    "task_id_for",
    "trigger_identity",
    "trigger_message_id",
    "trigger_outbox_row",
]

#: Run states that mean "not finished yet" for the overlap policy.
ACTIVE_RUN_STATES = ("scheduled", "dispatched", "running", "retrying")
TRIGGER_DESTINATION = "celery"
#: Every outbox destination that carries a beat's triggers (one per framework adapter): rows
#: of these destinations move their runs (``scheduled -> dispatched`` on send, ``skipped`` on
#: expiry, ``dead`` when undeliverable) and are found by the re-dispatch sweep. The
#: destination is data: the Celery adapter writes ``celery``, the Dramatiq one ``dramatiq``.
TRIGGER_DESTINATIONS = frozenset({"celery", "dramatiq"})


def task_id_for(key: str) -> str:
    """The Celery task id of a run: ``uuid5(NAMESPACE_URL, "reliable_beat:" + key)``.

    Deterministic, so a duplicate trigger of one slot shows up under the same task id in
    Flower and result backends.

    Computed as :func:`uuid.uuid5` does (SHA-1 of the namespace's bytes and the name, the
    version and variant bits set), from a SHA-1 state that already holds the namespace and
    the prefix, without building a :class:`uuid.UUID` (a third of the cost; the same text:
    ``tests/unit/test_dispatch_memos.py``).

    Raises:
        UnicodeEncodeError: ``key`` holds a lone surrogate (as :func:`uuid.uuid5`).
    """
    digest = _TASK_ID_SHA1.copy()
    digest.update(key.encode("utf-8"))
    n = int.from_bytes(digest.digest()[:16], "big")
    n = (n & _UUID5_CLEAR) | _UUID5_SET
    x = f"{n:032x}"
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


#: SHA-1 state holding ``NAMESPACE_URL`` and ``"reliable_beat:"`` (copied per task id).
_TASK_ID_SHA1 = hashlib.sha1(uuid.NAMESPACE_URL.bytes + b"reliable_beat:", usedforsecurity=False)
#: The RFC 4122 variant (bits 62-63 = 10) and version 5 (bits 76-79), as ``uuid.UUID`` sets
#: them for ``uuid5``.
_UUID5_CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
_UUID5_SET = (0x8000 << 48) | (5 << 76)


def trigger_message_id(key: str) -> str:
    """The outbox message id of a run's trigger."""
    return "trigger:" + key


def trigger_outbox_row(
    key: str,
    run_id: int,
    payload: dict[str, Any],
    now: datetime,
    *,
    available_at: datetime,
    claimed_by: str | None,
    destination: str = TRIGGER_DESTINATION,
    traceparent: str | None = None,
) -> dict[str, Any]:
    """The ``reliable_beat_outbox`` row of a run's trigger (``destination``: one of
    :data:`TRIGGER_DESTINATIONS`, ``celery`` by default).

    ``available_at`` is when a relay or a beat's sweep may publish it: the beat gives its own
    fast path a head start (now + sweep delay); a manual trigger is due at once.
    ``traceparent``: the W3C context of the slot's ``fire`` span (:mod:`reliable_beat.tracing`).
    """
    return {
        "message_id": trigger_message_id(key),
        "destination": destination,
        "payload": payload,
        "headers": {},
        "run_id": run_id,
        "state": "pending",
        "attempts": 0,
        "available_at": available_at,
        "claimed_by": claimed_by,
        "created_at": now,
        # written only when tracing is on: a store not yet upgraded takes rows as before
        **({"traceparent": traceparent} if traceparent else {}),
    }


@dataclass(frozen=True)
class Trigger:
    """A committed trigger to publish.

    A trigger published right after its claim committed (its slot was due at the claim) has
    no outbox row: its run row is its record (:mod:`reliable_beat.unsent`). A trigger claimed
    ahead (held until its slot), a released buffered run and a manual trigger have one.

    Attributes:
        outbox_id: the trigger's outbox row id; None: no row.
        run_id: the run's id.
        payload: the outbox payload (task, args, kwargs, task_id, headers, options, expires_at).
        fire_at: the slot (UTC), or the request time for a manual trigger.
        traceparent: the W3C context of the slot's ``fire`` span (a row-less trigger keeps
            it here, for the row written if its publish fails), or None.
    """

    outbox_id: int | None
    run_id: int
    key: str
    payload: dict[str, Any]
    fire_at: datetime
    traceparent: str | None = None

    @classmethod
    def due(cls, run_id: int, key: str, payload: dict[str, Any], fire_at: datetime,
            traceparent: str | None) -> Trigger:
        """``cls(None, run_id, key, payload, fire_at, traceparent)`` (a trigger with no
        outbox row): an equal object, made without the frozen dataclass's per-field
        ``object.__setattr__`` (one per due slot; checked in
        ``tests/unit/test_dispatch_memos.py``)."""
        t = object.__new__(cls)
        t.__dict__.update(outbox_id=None, run_id=run_id, key=key, payload=payload,
                          fire_at=fire_at, traceparent=traceparent)
        return t

    @property
    def id(self) -> int:
        """The id its message carries to the publisher and back in the outcomes: the outbox
        row's id, else the run's id negated (no outbox row has a negative id)."""
        return self.outbox_id if self.outbox_id is not None else -self.run_id


def build_trigger_payload(
    *,
    task: str,
    args: list[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    key: str,
    entry: str | None,
    fire_at: datetime | None,
    trigger: str,
    store_id: str | None = None,
    slot_text: SlotText | None = None,
    destination: str = TRIGGER_DESTINATION,
    traceparent: str | None = None,
) -> dict[str, Any]:
    """The outbox payload of a trigger (JSON), in the shape of its ``destination``.

    ``celery`` (the default): an ordinary Celery task message description, ``{"task",
    "args", "kwargs", "task_id", "headers", "options", "expires_at"}``. Its headers carry the
    entry, the fire time (ISO 8601 UTC), the idempotency key and the id of the store the run
    was written to (``reliable_beat_store``, when known; see :mod:`reliable_beat.identity`);
    the task id is :func:`task_id_for`; ``expires_at`` = slot + ``options["expires"]``
    seconds.

    Any other trigger destination (``dramatiq``): the framework-neutral shape ``{"task",
    "args", "kwargs", "message_id", "reliable_beat": {"key", "entry", "fire_at",
    "trigger", "store"?}, "options", "expires_at"}`` (``message_id`` = :func:`task_id_for`;
    ``options`` without ``expires`` and ``headers``, which are Celery message fields). It
    also carries ``task_id`` and ``headers`` (the four ``reliable_beat_*`` identity headers
    only), copies for readers older than this shape (a relay or beat of the previous version
    during a rolling deploy), to be dropped a release later. Readers take the identity with
    :func:`trigger_identity`, which reads both shapes. ``slot_text``: a batch's memo of formatted
    instants (:class:`~reliable_beat.slots.SlotText`; same text, each instant formatted once).
    ``traceparent``: the W3C context of the slot's ``fire`` span (:mod:`reliable_beat.tracing`),
    carried as the ``traceparent`` message header (Celery) or in the identity object
    (``reliable_beat.traceparent``; the Dramatiq adapter makes it a message option).
    """
    fmt = format_fire_at if slot_text is None else slot_text.fire_at
    publish = {k: v for k, v in options.items() if k not in ("expires", "headers")} \
        if options else {}
    expires = options.get("expires") if options else None
    expires_at = (
        fmt(fire_at + timedelta(seconds=float(expires)))
        if expires and fire_at is not None else None
    )
    slot = fmt(fire_at) if fire_at is not None else None  # None: a run of no slot (ad hoc)
    if destination != TRIGGER_DESTINATION:
        identity: dict[str, Any] = {"key": key, "entry": entry, "fire_at": slot,
                                    "trigger": trigger}
        if store_id:
            identity["store"] = store_id
        if traceparent:
            identity["traceparent"] = traceparent
        message_id = task_id_for(key)
        return {
            "task": task,
            "args": args,
            "kwargs": kwargs,
            "message_id": message_id,
            "reliable_beat": identity,
            "options": publish,
            "expires_at": expires_at,
            # for readers older than the neutral shape (rolling deploys); see the docstring
            "task_id": message_id,
            "headers": {"reliable_beat_key": key, "reliable_beat_entry": entry,
                        "reliable_beat_fire_at": slot, "reliable_beat_trigger": trigger},
        }
    custom = options.get("headers") if options else None
    headers = dict(custom) if custom else {}
    headers["reliable_beat_key"] = key
    headers["reliable_beat_entry"] = entry
    headers["reliable_beat_fire_at"] = slot
    headers["reliable_beat_trigger"] = trigger
    if store_id:
        headers["reliable_beat_store"] = store_id
    if traceparent:
        headers["traceparent"] = traceparent
    return {
        "task": task,
        "args": args,
        "kwargs": kwargs,
        "task_id": task_id_for(key),
        "headers": headers,
        "options": publish,
        "expires_at": expires_at,
    }


def trigger_identity(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The run a trigger payload fires, whatever its shape (:func:`build_trigger_payload`):
    ``{"key", "entry", "fire_at", "trigger", "store"}`` (values None when absent), read from
    the neutral ``reliable_beat`` object, else from the ``reliable_beat_*`` headers of a
    Celery-shaped payload (every ``celery`` row, and ``dramatiq`` rows written before the
    neutral shape)."""
    block = payload.get("reliable_beat")
    if isinstance(block, Mapping):
        return {f: block.get(f) for f in ("key", "entry", "fire_at", "trigger", "store")}
    headers = payload.get("headers")
    headers = headers if isinstance(headers, Mapping) else {}
    return {f: headers.get(f"reliable_beat_{f}")
            for f in ("key", "entry", "fire_at", "trigger", "store")}
