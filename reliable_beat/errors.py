"""The whole exception tree of reliable_beat.

Every error the library raises on purpose derives from :class:`ReliableBeatError`,
and also from the builtin that fits, so ``except ValueError`` keeps working::

    ReliableBeatError
    ├── ConfigurationError (ValueError)      bad settings, bad entry definitions
    │   ├── InvalidScheduleError              cron string / interval / one-off that cannot be read
    │   ├── UnknownTimezoneError              not an IANA zone name zoneinfo knows
    │   └── EntryValidationError              one or more entries are invalid (lists all problems)
    ├── EntryNotFoundError (LookupError)     no entry with that name
    ├── RunNotFound (LookupError)            no run with that idempotency key
    ├── DeadLetterNotFound (LookupError)     no dead letter with that id
    ├── SchemaError (RuntimeError)           the database schema is missing or behind
    ├── StoreUnavailableError (ConnectionError)  the database cannot be reached
    ├── IdempotencyKeyError (ValueError)     an ad-hoc call has no derivable idempotency key
    ├── OutboxPayloadError (ValueError)      outbox.add: a row its handler can never deliver
    ├── StaleFenceToken (RuntimeError)       a newer claim superseded this runner
    ├── LeaseHeldError (RuntimeError)        another runner holds a live lease on the run
    ├── PermanentError                       raise from a task body: no retry, dead letter at once
    └── DeliveryError                        an outbox handler failed to deliver
        └── PermanentDeliveryError           ... and retrying cannot help (dead letter at once)

Original exceptions are kept as ``__cause__``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ConfigurationError",
    "DeadLetterNotFound",
    "DeliveryError",
    "EntryNotFoundError",
    "EntryValidationError",
    "IdempotencyKeyError",
    "InvalidScheduleError",
    "LeaseHeldError",
    "OutboxPayloadError",
    "PermanentDeliveryError",
    "PermanentError",
    "ReliableBeatError",
    "RunNotFound",
    "SchemaError",
    "StaleFenceToken",
    "StoreUnavailableError",
    "UnknownTimezoneError",
]


class ReliableBeatError(Exception):
    """Base class of every error raised on purpose by reliable_beat."""


class ConfigurationError(ReliableBeatError, ValueError):
    """A setting or an entry definition is invalid. The message names it and the fix."""


class InvalidScheduleError(ConfigurationError):
    """A schedule (cron string, interval, one-off instant) cannot be read."""


class UnknownTimezoneError(ConfigurationError):
    """A time zone name is not an IANA zone known to :mod:`zoneinfo`."""


class EntryValidationError(ConfigurationError):
    """One or more entries are invalid.

    Attributes:
        problems: one ``"entry 'name': what is wrong; how to fix"`` string per problem,
            all of them, not just the first.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        names = {m.group(1) for p in self.problems if (m := _ENTRY_NAME.match(p))}
        count = len(names) or len(self.problems)
        noun = "entry" if count == 1 else "entries"
        extra = f" ({len(self.problems)} problems)" if len(self.problems) > count else ""
        super().__init__(f"{count} invalid {noun}{extra}:\n{lines}")


#: The entry a problem string names (``"entry 'name': ..."``).
_ENTRY_NAME = re.compile(r"entry ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"):")


class EntryNotFoundError(ReliableBeatError, LookupError):
    """No entry with the given name exists."""


class RunNotFound(ReliableBeatError, LookupError):
    """No run has the given idempotency key."""


class DeadLetterNotFound(ReliableBeatError, LookupError):
    """No dead letter has the given id."""


class SchemaError(ReliableBeatError, RuntimeError):
    """The reliable_beat tables are missing or behind the package's migrations.

    Fix: run ``reliable-beat db upgrade`` (or set ``reliable_beat_run_migrations = True``).
    """


class StoreUnavailableError(ReliableBeatError, ConnectionError):
    """The database cannot be reached; the operation can be retried later."""


class IdempotencyKeyError(ReliableBeatError, ValueError):
    """An ad-hoc call of an ``IdempotentTask`` has no derivable idempotency key.

    Fix: pass ``headers={"reliable_beat_key": ...}`` in the call, or override
    ``IdempotentTask.idempotency_key_for(*args, **kwargs)``.
    """


class OutboxPayloadError(ReliableBeatError, ValueError):
    """``outbox.add`` refused a row its destination's handler can never deliver (a
    ``webhook`` row with a ``url``, an ``smtp`` row without ``to``, ...): nothing was written,
    and the caller's transaction is still usable. The message names the message, the field
    and the fix. See :mod:`reliable_beat.payloads`.

    Attributes:
        field: the payload key at fault, or None (the payload as a whole, or unknown).
        destination: the destination the row was for, or None (raised by a validator).
    """

    def __init__(self, message: str, *, field: str | None = None,
                 destination: str | None = None) -> None:
        self.problem = message
        self.field = field
        self.destination = destination
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_outbox_payload_error, (self.problem, self.field, self.destination))


def _outbox_payload_error(message: str, field: str | None,
                          destination: str | None) -> OutboxPayloadError:
    return OutboxPayloadError(message, field=field, destination=destination)


class StaleFenceToken(ReliableBeatError, RuntimeError):
    """The run's fence token moved on: another runner claimed it after us.

    Everything the stale runner wrote in its transaction was rolled back.

    Attributes:
        idempotency_key: the run's key.
        fence_token: the token this runner held.
    """

    def __init__(self, idempotency_key: str, fence_token: int) -> None:
        self.idempotency_key = idempotency_key
        self.fence_token = fence_token
        super().__init__(
            f"run {idempotency_key!r}: fence token {fence_token} is stale (another runner "
            "claimed the run after this one); this runner's writes were rolled back"
        )

    def __reduce__(self) -> tuple[type[StaleFenceToken], tuple[str, int]]:
        # Picklable with its own class (Celery result backends and prefork pipes pickle it).
        return (type(self), (self.idempotency_key, self.fence_token))


class LeaseHeldError(ReliableBeatError, RuntimeError):
    """Another runner holds a live lease on the run; try again after it expires."""


class PermanentError(ReliableBeatError):
    """Raise from a task body to fail permanently: no retry, the run is dead-lettered."""


class DeliveryError(ReliableBeatError):
    """An outbox handler could not deliver a message; it will be retried with backoff."""


class PermanentDeliveryError(DeliveryError):
    """An outbox handler failed in a way retrying cannot fix; dead-letter at once."""
