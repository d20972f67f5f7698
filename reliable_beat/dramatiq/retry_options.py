"""Dramatiq's own retry options on an :class:`~reliable_beat.dramatiq.IdempotentActor`.

An IdempotentActor decides its retries itself (classification, ``max_attempts`` counted in
the database) and asks Dramatiq for each one by raising ``dramatiq.Retry(delay=ms)``. Dramatiq's
``Retries`` middleware still gets the last word on that exception, so some of its options
would drop our retry ("Retries exceeded"): the run would stay ``retrying`` with no message to
run it again and no dead letter. What each option becomes (design invariant 10: the default
keeps the guarantee; the unsafe form is refused or warned where the user wrote it):

* actor option ``retry_when``: refused at decoration (Dramatiq asks it about every retry,
  ours included). A ``Retries(retry_when=...)`` given to the broker is not applied to
  idempotent actors (a WARNING at declaration says so).
* actor option ``throws`` matching ``dramatiq.Retry`` (``Exception``, ``DramatiqError``,
  ``Retry``): refused at decoration. Narrower ``throws`` keep Dramatiq's meaning: an
  exception listed there is not retried (a dead letter at once).
* actor option ``max_retries=N`` keeps Dramatiq's meaning: at most ``N + 1`` tries (our
  ``max_attempts``; a different ``max_attempts`` given with it is refused).
* actor options ``min_backoff`` / ``max_backoff`` / ``on_retry_exhausted``: not used (the
  delays are ``reliable_beat_retry_base_seconds`` / ``_cap_seconds``; an exhausted run is a
  dead letter): a WARNING at decoration.
* message options ``max_retries`` / ``throws`` (``send_with_options(max_retries=1)``):
  dropped with a WARNING naming them, when the message is built and again in the worker
  (a message built elsewhere).
* a body raising ``dramatiq.Retry(delay=ms)``: a retry request (:func:`retry_request`),
  with its delay, counted against ``max_attempts``; not an error.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import dramatiq

from reliable_beat.errors import ConfigurationError
from reliable_beat.redaction import get_logger

__all__ = ["IGNORED_ACTOR_OPTIONS", "MESSAGE_OPTIONS", "RetryPlan", "drop_message_options",
           "neutralize_broker_retry_when", "retry_plan", "retry_request"]

log = get_logger("reliable_beat.dramatiq")

#: Message options the Retries middleware reads before the actor's, that would drop our retry.
MESSAGE_OPTIONS = ("max_retries", "throws")
#: Actor options of the Retries middleware an IdempotentActor does not use (warned).
IGNORED_ACTOR_OPTIONS = {
    "min_backoff": "its retry delays are reliable_beat_retry_base_seconds / "
                   "reliable_beat_retry_cap_seconds (full jitter)",
    "max_backoff": "its retry delays are reliable_beat_retry_base_seconds / "
                   "reliable_beat_retry_cap_seconds (full jitter)",
    "on_retry_exhausted": "an exhausted run is a dead letter in reliable_beat_dead_letters "
                          "(`reliable-beat dead-letters list`), and Dramatiq fails its message",
}


@dataclass(frozen=True)
class RetryPlan:
    """What an IdempotentActor takes from Dramatiq's retry options.

    Attributes:
        throws: the user's ``throws`` classes: a body exception among them is a dead letter
            at once (Dramatiq's meaning: never retried).
        max_attempts: ``max_retries + 1`` when ``max_retries`` was given, else None.
    """

    throws: tuple[type[BaseException], ...] = ()
    max_attempts: int | None = None


def _classes(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list, set, frozenset)) else (value,)


def retry_plan(actor_name: str, options: MutableMapping[str, Any]) -> RetryPlan:
    """Check an IdempotentActor's Dramatiq retry options at decoration (see the module).

    Raises:
        ConfigurationError: an option that would drop the actor's retries, or that cannot
            keep its meaning; the message names it and the fix.
    """
    problems: list[str] = []
    if options.get("retry_when") is not None:
        problems.append(
            f"retry_when={options['retry_when']!r}: Dramatiq asks it about every retry, "
            "also the ones reliable_beat asks for, and a False drops the retry (the run "
            "would stay `retrying` with no message and no dead letter). Remove it: an "
            "IdempotentActor decides its retries itself; bound the tries with "
            "max_attempts= (or max_retries=), and raise reliable_beat.PermanentError, or "
            "list the exception in throws=, for an error that must not be retried")
    throws = _classes(options.get("throws"))
    bad = [c for c in throws if not (isinstance(c, type) and issubclass(c, BaseException))]
    wide = [c for c in throws if c not in bad and issubclass(dramatiq.Retry, c)]
    if bad:
        problems.append(f"throws={options['throws']!r}: expected exception classes")
    elif wide:
        names = ", ".join(c.__name__ for c in wide)
        problems.append(
            f"throws={options['throws']!r}: {names} also matches dramatiq.Retry, which an "
            "IdempotentActor raises to retry, so Dramatiq would fail the message instead of "
            "retrying it (the run would stay `retrying` with no message and no dead letter). "
            "List the exceptions you mean (a body exception listed in throws is a dead "
            "letter at once); for all errors but the transient ones, raise "
            "reliable_beat.PermanentError")
    max_attempts: int | None = None
    if options.get("max_retries") is not None:
        value = options["max_retries"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"max_retries={value!r}: expected a whole number >= 0")
        else:
            max_attempts = value + 1
            given = options.get("max_attempts")
            if given is not None and given != max_attempts:
                problems.append(
                    f"max_retries={value} (= {max_attempts} tries) contradicts "
                    f"max_attempts={given!r}; set one of them")
    if problems:
        raise ConfigurationError(f"IdempotentActor {actor_name}: " + "; ".join(problems)
                                 + " (see docs/dramatiq.md, 'Dramatiq's retry options')")
    for name, why in IGNORED_ACTOR_OPTIONS.items():
        if options.get(name) is not None:
            log.warning("IdempotentActor %s: actor option %s=%r is not used: %s", actor_name,
                        name, options[name], why)
    return RetryPlan(throws=tuple(throws), max_attempts=max_attempts)


def neutralize_broker_retry_when(broker: Any, actor: Any) -> None:
    """Make the broker's ``Retries(retry_when=...)`` skip ``actor`` (an IdempotentActor):
    ``retry_when=None`` on the actor wins over the middleware's; a WARNING names it."""
    actor.options["retry_when"] = None
    for m in getattr(broker, "middleware", ()):
        if getattr(m, "retry_when", None) is not None:
            log.warning("IdempotentActor %s: the broker's %s(retry_when=%r) is not applied to "
                        "it (it would drop the retries reliable_beat asks for); its tries are "
                        "bounded by max_attempts", actor.actor_name, type(m).__name__,
                        m.retry_when)


def drop_message_options(actor_name: str, options: MutableMapping[str, Any], *,
                         where: str, message_id: Any = None) -> list[str]:
    """Remove the message options that would drop an IdempotentActor's retries
    (:data:`MESSAGE_OPTIONS`) from ``options``, with a WARNING naming them; ``where`` says
    where they were found. Returns the names removed."""
    found = [name for name in MESSAGE_OPTIONS if name in options]
    if not found:
        return []
    given = ", ".join(f"{name}={options.pop(name)!r}" for name in found)
    log.warning(
        "IdempotentActor %s%s: message option(s) %s ignored (%s): they would make Dramatiq "
        "drop the retries reliable_beat asks for, leaving the run `retrying`. An "
        "IdempotentActor's tries are counted in the database: set max_attempts= (or "
        "max_retries=) on the actor instead", actor_name,
        f"[{message_id}]" if message_id is not None else "", given, where)
    return found


def retry_request(exc: dramatiq.Retry) -> tuple[float | None, str]:
    """A ``dramatiq.Retry`` raised by the body: ``(delay in seconds or None, the text
    recorded for the try)``. None: the body gave no delay (the actor's backoff applies)."""
    delay = getattr(exc, "delay", None)
    seconds = None if delay is None else max(float(delay), 0.0) / 1000.0
    return seconds, (
        "retry requested by the body (dramatiq.Retry"
        + ("" if delay is None else f", delay={delay} ms") + (f": {exc}" if str(exc) else "")
        + "): not an error; counted against max_attempts")
