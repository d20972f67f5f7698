"""What every outbox handler shares: the delivery result and the errors that steer the relay.

A handler raises (or a batch handler returns) :class:`DestinationUnavailableError` for a
destination that is down as a whole, :class:`MessageExpiredError` for a trigger past its
``expires_at``; see :mod:`reliable_beat.handlers`.
"""

from __future__ import annotations

from typing import Any

from reliable_beat.errors import DeliveryError, PermanentDeliveryError

__all__ = [
    "DestinationUnavailableError",
    "MessageExpiredError",
    "Result",
]

Result = BaseException | None


class DestinationUnavailableError(DeliveryError):
    """The destination as a whole cannot be reached (e.g. the broker refused the connection).

    The relay releases the batch with a backoff and does not count the attempt against the
    rows, so an outage never dead-letters messages. (Belongs in :mod:`reliable_beat.errors`.)
    """


class MessageExpiredError(PermanentDeliveryError):
    """A Celery trigger's ``expires_at`` passed before it could be published.

    The relay marks the row ``sent`` with ``last_error = "expired before publish"`` and the
    linked run ``skipped`` with reason ``expired``; it is not dead-lettered.
    """


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _chain(error: DeliveryError, cause: BaseException) -> DeliveryError:
    error.__cause__ = cause
    return error
