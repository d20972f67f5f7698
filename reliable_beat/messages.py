"""The outbox row as handlers see it: :class:`OutboxMessage` (also importable from
:mod:`reliable_beat.outbox`). A module of its own so that the handlers and the write-time
payload checks (:mod:`reliable_beat.payloads`) need not import the outbox writer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Row

__all__ = ["OutboxMessage"]


@dataclass(frozen=True)
class OutboxMessage:
    """One outbox row, as handlers see it.

    Attributes:
        id: the row's primary key (insertion order).
        message_id: the stable message id / idempotency key; the far end dedupes on it.
        destination: the handler name (``celery``, ``kombu``, ``webhook``, ``smtp`` or a user
            handler name).
        payload: the JSON payload; its shape is defined by the destination's handler.
        headers: JSON object of handler options / message headers (may be empty).
        ordering_key: rows sharing it are delivered in id order, or None.
        run_id: the ``reliable_beat_runs`` row this message belongs to, or None.
        attempts: delivery attempts so far, this one included once claimed.
        available_at: UTC instant before which the row is not claimed.
        created_at: UTC instant of the insert (store clock).
        state: ``pending``, ``sent`` or ``dead``.
        traceparent: the W3C context of the span that wrote the row (the relay's delivery span
            joins its trace: :mod:`reliable_beat.tracing`), or None.
    """

    id: int
    message_id: str
    destination: str
    payload: Any
    headers: Mapping[str, Any] = field(default_factory=dict)
    ordering_key: str | None = None
    run_id: int | None = None
    attempts: int = 0
    available_at: datetime | None = None
    created_at: datetime | None = None
    state: str = "pending"
    traceparent: str | None = None

    @classmethod
    def of_trigger(cls, id: int, message_id: str, destination: str, payload: Any,
                   run_id: int | None, traceparent: str | None) -> OutboxMessage:
        """``cls(id=..., message_id=..., destination=..., payload=..., run_id=...,
        traceparent=...)``, the other fields at their defaults: an equal object, made
        without the frozen dataclass's per-field ``object.__setattr__`` (the beat builds one
        per due slot; ``tests/unit/test_dispatch_memos.py`` checks it against ``__init__``).
        """
        m = object.__new__(cls)
        m.__dict__.update(id=id, message_id=message_id, destination=destination,
                          payload=payload, headers={}, ordering_key=None, run_id=run_id,
                          attempts=0, available_at=None, created_at=None, state="pending",
                          traceparent=traceparent)
        return m

    @classmethod
    def from_row(cls, row: Row[Any] | Mapping[str, Any]) -> OutboxMessage:
        """Build from a result row (a SQLAlchemy ``Row``, a driver statement's named tuple,
        or a mapping) of ``reliable_beat_outbox``."""
        m: Mapping[str, Any] = (row._mapping if isinstance(row, Row)  # type: ignore[assignment]
                                else row._asdict() if hasattr(row, "_asdict") else row)
        return cls(
            id=int(m["id"]),
            message_id=m["message_id"],
            destination=m["destination"],
            payload=m["payload"],
            headers=m.get("headers") or {},
            ordering_key=m.get("ordering_key"),
            run_id=m.get("run_id"),
            attempts=int(m.get("attempts") or 0),
            available_at=m.get("available_at"),
            created_at=m.get("created_at"),
            state=m.get("state") or "pending",
            traceparent=m.get("traceparent"),
        )
