"""How an ``IdempotentTask`` retries: Celery's retry options, one attempt budget.

* :func:`_retry_plan` maps Celery's retry options of a task class (``max_retries``,
  ``autoretry_for``, ``retry_backoff``, ...) onto the attempt budget and backoff, or refuses
  one that cannot keep its Celery meaning (``docs/task.md``, "Celery's retry options").
* :func:`_transient_defaults`: the exceptions retried by default (connection errors,
  timeouts, the database's and the broker's).
* :class:`_Retries`, a base of :class:`~reliable_beat.celery.task.IdempotentTask`: the
  classification of a body's failure (:meth:`_Retries.classify`), the delay of a retry, and
  the internal retries (another runner holds the lease; the store is unreachable) that send
  the message again without spending the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task
from celery.exceptions import Reject, Retry
from sqlalchemy.exc import DBAPIError, OperationalError

from reliable_beat.celery.headers import WAITS_HEADER, _header
from reliable_beat.errors import ConfigurationError, PermanentError
from reliable_beat.policies import backoff_delay
from reliable_beat.redaction import get_logger, redact_text

if TYPE_CHECKING:
    from reliable_beat.settings import Settings

__all__: list[str] = []

#: The task's logger: its records keep the name users configure.
log = get_logger("reliable_beat.celery.task")


def _transient_defaults() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [
        ConnectionError,  # includes StoreUnavailableError
        TimeoutError,
        OSError,
        OperationalError,
        DBAPIError,
    ]
    try:
        from kombu.exceptions import OperationalError as KombuOperationalError

        found.append(KombuOperationalError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import redis.exceptions

        found += [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


#: Celery's retry options and what an IdempotentTask makes of them (docs/task.md).
_CELERY_RETRY_OPTIONS = (
    "max_retries", "autoretry_for", "dont_autoretry_for", "retry_kwargs", "retry_backoff",
    "retry_backoff_max", "retry_jitter", "default_retry_delay",
)


@dataclass(frozen=True)
class _RetryPlan:
    """The attempt budget and backoff of one IdempotentTask class (None: the setting)."""

    max_attempts: int | None = None
    base_seconds: float | None = None
    cap_seconds: float | None = None
    jitter: bool = True
    fixed_delay: float | None = None
    autoretry_for: tuple[type[BaseException], ...] = ()
    dont_autoretry_for: tuple[type[BaseException], ...] = ()


def _explicit(cls: type, name: str, task_base: type) -> tuple[bool, Any]:
    """``(True, value)`` when ``name`` is set on ``cls`` or a class between it and
    ``task_base``, IdempotentTask (the user's own definition, e.g.
    ``@app.task(max_retries=3)``)."""
    for klass in cls.__mro__:
        if klass is task_base:
            break
        if name in klass.__dict__:
            return True, klass.__dict__[name]
    return False, None


def _retry_plan(cls: type, task_base: type) -> _RetryPlan:
    """Map Celery's retry options of ``cls`` (those set below ``task_base``, IdempotentTask)
    onto the attempt budget and backoff.

    Raises:
        ConfigurationError: an option that cannot mean what it means in Celery, or that
            contradicts the reliable_beat attribute given with it; the message names both.
    """
    name = getattr(cls, "name", None) or cls.__name__
    problems: list[str] = []
    got = {opt: _explicit(cls, opt, task_base) for opt in _CELERY_RETRY_OPTIONS}
    ours = {opt: _explicit(cls, opt, task_base) for opt in (
        "max_attempts", "retry_base_seconds", "retry_cap_seconds")}
    max_attempts: int | None = None
    fixed: float | None = None
    retry_kwargs: dict[str, Any] = {}
    if got["retry_kwargs"][0]:
        retry_kwargs = dict(got["retry_kwargs"][1] or {})
        for k in sorted(set(retry_kwargs) - {"max_retries", "countdown"}):
            problems.append(
                f"retry_kwargs[{k!r}] is not supported on an IdempotentTask (only max_retries "
                "and countdown)")
    for source, given, value in (
        ("max_retries", got["max_retries"][0], got["max_retries"][1]),
        ("retry_kwargs['max_retries']", "max_retries" in retry_kwargs,
         retry_kwargs.get("max_retries")),
    ):
        if not given:
            continue
        if value is None:
            problems.append(
                f"{source}=None (retry for ever) is not supported: an IdempotentTask's "
                "tries end in a dead letter; set max_attempts (or the "
                "reliable_beat_retry_max_attempts setting) to a bound instead")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"{source}={value!r}: expected a whole number >= 0")
        elif max_attempts is not None and max_attempts != value + 1:
            problems.append(f"{source}={value!r} contradicts max_retries={max_attempts - 1}")
        else:
            max_attempts = value + 1
    if max_attempts is not None and ours["max_attempts"][0] and \
            ours["max_attempts"][1] not in (None, max_attempts):
        problems.append(
            f"max_retries={max_attempts - 1} (= {max_attempts} tries) contradicts "
            f"max_attempts={ours['max_attempts'][1]}; set one of them")
    base: float | None = None
    cap: float | None = None
    jitter = True
    backoff_given, backoff = got["retry_backoff"]
    if backoff_given and backoff:
        if isinstance(backoff, bool):
            base = 1.0
        elif isinstance(backoff, (int, float)) and backoff > 0:
            base = float(int(max(1.0, backoff)))  # Celery's factor: int(max(1.0, value))
        else:
            problems.append(f"retry_backoff={backoff!r}: expected True or seconds > 0")
        if ours["retry_base_seconds"][0] and ours["retry_base_seconds"][1] is not None:
            problems.append(
                f"retry_backoff={backoff!r} and retry_base_seconds="
                f"{ours['retry_base_seconds'][1]!r} both set the backoff base; set one")
    if got["retry_backoff_max"][0]:
        value = got["retry_backoff_max"][1]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"retry_backoff_max={value!r}: expected seconds >= 0")
        else:
            cap = float(value)
        if ours["retry_cap_seconds"][0] and ours["retry_cap_seconds"][1] is not None:
            problems.append(
                f"retry_backoff_max={value!r} and retry_cap_seconds="
                f"{ours['retry_cap_seconds'][1]!r} both cap the backoff; set one")
    elif base is not None:
        cap = 600.0  # Celery's default retry_backoff_max
    if got["retry_jitter"][0]:
        jitter = bool(got["retry_jitter"][1])
    if "countdown" in retry_kwargs:
        value = retry_kwargs["countdown"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"retry_kwargs['countdown']={value!r}: expected seconds >= 0")
        else:
            fixed = float(value)
    if fixed is None and base is None and got["default_retry_delay"][0]:
        value = got["default_retry_delay"][1]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"default_retry_delay={value!r}: expected seconds >= 0")
        else:
            fixed = float(value)
    if fixed is not None and base is not None:
        problems.append("retry_kwargs['countdown'] and retry_backoff both set the delay; "
                        "set one")
    autoretry: tuple[type[BaseException], ...] = ()
    dont: tuple[type[BaseException], ...] = ()
    for opt in ("autoretry_for", "dont_autoretry_for"):
        given, value = got[opt]
        if not given or not value:
            continue
        classes = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not all(isinstance(c, type) and issubclass(c, BaseException) for c in classes):
            problems.append(f"{opt}={value!r}: expected exception classes")
        elif opt == "autoretry_for":
            autoretry = classes
        else:
            dont = classes
    if problems:
        raise ConfigurationError(
            f"IdempotentTask {name}: " + "; ".join(problems)
            + " (see docs/task.md, 'Celery's retry options')")
    return _RetryPlan(max_attempts=max_attempts, base_seconds=base, cap_seconds=cap,
                      jitter=jitter, fixed_delay=fixed, autoretry_for=autoretry,
                      dont_autoretry_for=dont)


def _redacted_retry(signal: Retry) -> Retry:
    """Celery's retry signal with its text redacted like the logs, returned.

    Celery hands ``str()`` of the signal, ``Retry in 2s: ConnectionError('...')`` with the
    exception's raw message, to its ``task_retry`` signal: its own log line and
    ``opentelemetry-instrumentation-celery``'s ``celery.retry.reason`` span attribute show it.
    The signal's ``message`` (which ``str()`` prefers) is set to the redacted text; the
    exception itself (``signal.exc``) is kept for the result backend."""
    signal.message = redact_text(str(signal))
    return signal


class _Retries(Task):  # type: ignore[misc]
    """A base class of :class:`~reliable_beat.celery.task.IdempotentTask`: its retry verbs."""

    if TYPE_CHECKING:  # defined by IdempotentTask
        _rb_retry: ClassVar[_RetryPlan]
        permanent_exceptions: ClassVar[tuple[type[BaseException], ...]]
        transient_exceptions: ClassVar[tuple[type[BaseException], ...]]
        retry_unknown_exceptions: ClassVar[bool]
        retry_base_seconds: ClassVar[float | None]
        retry_cap_seconds: ClassVar[float | None]

        @property
        def reliable_beat_settings(self) -> Settings: ...

        def _key_headers(self, key: str) -> dict[str, Any]: ...

    def _unwrap_autoretry(self) -> None:
        """Undo Celery's ``autoretry_for`` wrapper of ``run`` (see :func:`_retry_plan`).

        ``@app.task(autoretry_for=...)`` wraps ``run`` in a second retry loop with its own
        counter; an IdempotentTask retries those exceptions itself, within one budget. The
        ``_orig_run`` attribute stays, so Celery does not wrap again.
        """
        orig = self.__dict__.get("_orig_run")
        if orig is not None and self.__dict__.get("run") is not orig:
            self.run = orig

    def _internal_retry(
        self, key: str, countdown: float, exc: BaseException | None = None
    ) -> Retry:
        """Send this message again in ``countdown`` s without spending the attempt budget.

        Unlike ``self.retry``, Celery's ``request.retries`` is not increased and
        ``max_retries`` is not checked: waiting for another runner's lease, or for the store
        to come back, is not a try of the body. If the message cannot be sent again (the
        broker is down too), it is handed back to the broker (``Reject(requeue=True)``:
        with ``acks_late`` the original message is redelivered), never dropped.

        Returns:
            The ``Retry`` to raise (it tells the worker the task was re-sent).
        """
        request = self.request
        if request.is_eager and exc is not None:
            raise exc  # eager apply(): no broker to wait on; the caller sees the error
        headers = self._key_headers(key)
        headers[WAITS_HEADER] = self._waits() + 1
        sig = self.signature_from_request(
            request, None, None, countdown=countdown, retries=request.retries or 0,
            headers=headers,
        )
        try:
            sig.apply_async()
        except Exception as publish_exc:
            log.error("%s: could not re-send %s (%r); handing the message back to the broker",
                      self.name, key, publish_exc)
            raise Reject(publish_exc, requeue=True) from publish_exc
        return Retry(exc=exc, when=countdown, sig=sig)

    def _waits(self) -> int:
        """How many internal retries led to this message (0 for a first delivery)."""
        try:
            return max(int(_header(self.request, WAITS_HEADER) or 0), 0)
        except (TypeError, ValueError):
            return 0

    def _store_backoff(self) -> float:
        """Full-jitter delay before trying an unreachable store again: the settings' base
        and cap, growing with the internal retries of this message (not the task's retry
        options: waiting for the store is not a try)."""
        s = self.reliable_beat_settings
        return backoff_delay(min(self._waits(), 30), base=s.retry_base_seconds,
                             cap=s.retry_cap_seconds)

    def classify(self, exc: BaseException) -> str:
        """``permanent`` or ``transient`` for an exception raised by the body (overridable)."""
        if isinstance(exc, PermanentError):
            return "permanent"
        plan = self._rb_retry
        if plan.dont_autoretry_for and isinstance(exc, plan.dont_autoretry_for):
            return "permanent"  # Celery: not retried
        if plan.autoretry_for and isinstance(exc, plan.autoretry_for):
            return "transient"  # Celery: retried (within the budget)
        if isinstance(exc, self.permanent_exceptions):
            return "permanent"
        if isinstance(exc, self.transient_exceptions):
            return "transient"
        if plan.autoretry_for:
            return "permanent"  # Celery retries only what autoretry_for lists
        return "transient" if self.retry_unknown_exceptions else "permanent"

    def _backoff(self, retry_number: int) -> float:
        """Delay in seconds before retry ``retry_number`` (0 = first retry).

        Full jitter by default: ``uniform(0, min(cap, base * 2**k))``; without jitter
        (Celery's ``retry_jitter=False``) ``min(cap, base * 2**k)``; a fixed delay when
        Celery's ``default_retry_delay`` or ``retry_kwargs["countdown"]`` sets one.
        """
        plan = self._rb_retry
        if plan.fixed_delay is not None:
            return plan.fixed_delay
        s = self.reliable_beat_settings
        base = plan.base_seconds or self.retry_base_seconds or s.retry_base_seconds
        cap = (plan.cap_seconds if plan.cap_seconds is not None
               else self.retry_cap_seconds if self.retry_cap_seconds is not None
               else s.retry_cap_seconds)
        if not plan.jitter:
            return cap if retry_number >= 1023 else min(cap, base * 2.0**retry_number)
        return backoff_delay(retry_number, base=base, cap=cap)
