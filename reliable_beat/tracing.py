"""OpenTelemetry traces of slots and workflows, through ``opentelemetry-api`` only.

One trace per **slot**: the beat's firing of the slot is its root span (``fire <entry>``,
linked to the tick that claimed it); the trigger message carries the W3C ``traceparent`` of
that span (a Celery message header; a Dramatiq message option), so the worker's spans join it:
one ``process <task>`` span per execution, its claim and fenced completion recorded as events
of that span (``reliable_beat.claim``, ``reliable_beat.complete``: an event costs the SDK a
tenth of a span), a failure as a child span (``reliable_beat.retry`` /
``reliable_beat.dead_letter``);
an outbox row keeps the ``traceparent`` of the span that wrote it, so the relay's delivery
span (``deliver <destination>``) joins too, and a webhook request sends the ``traceparent``
of its HTTP client span to the far end.

One trace per **workflow**: its start span's ``traceparent`` is stored with the workflow; every
advance, activity, timer wake, signal and compensation is a span of that trace. Continue-as-new
starts a new trace linked to the previous run's.

Attributes share one namespace (``reliable_beat.entry``, ``.slot``, ``.key``,
``.fence_token``, ``.attempt``, ``.outcome``, ``.workflow.id``, ``.workflow.run``, ``.seq``)
beside the messaging and HTTP semantic conventions. Errors are recorded with the redaction of
the logs (:func:`reliable_beat.redaction.redact_text`): no secret of an error message, a URL or
a key reaches a span; arguments and payloads are never recorded.

Without ``opentelemetry-api`` installed, or while no tracer provider is set (the API's proxy),
every function here is a no-op that costs a function call: :func:`tracer` returns None and the
callers skip their spans. The provider is looked up until one is set (a Celery worker sets it
in ``worker_process_init``, after this module is imported), then kept.

This module imports no framework; the adapters pass what their framework holds.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
import time
import traceback
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from reliable_beat._version import __version__
from reliable_beat.errors import StaleFenceToken
from reliable_beat.redaction import redact_text, redact_url

try:  # the optional API (the ``reliable-beat[otel]`` extra)
    from opentelemetry import context as _context
    from opentelemetry import trace as _trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised by the no-op test in a venv without it
    _trace = None  # type: ignore[assignment]

__all__ = [
    "ATTEMPT",
    "ENTRY",
    "FENCE_TOKEN",
    "KEY",
    "OUTCOME",
    "SEQ",
    "SLOT",
    "TRACEPARENT",
    "WORKFLOW_ID",
    "WORKFLOW_RUN",
    "BeatTrace",
    "DeliverySpans",
    "PublishSpans",
    "add_link",
    "annotate",
    "attached",
    "carrier",
    "claimed",
    "completion",
    "completion_span",
    "current_traceparent",
    "inject",
    "linked_root",
    "process_span",
    "record_error",
    "span",
    "tracer",
]

ENTRY = "reliable_beat.entry"
SLOT = "reliable_beat.slot"
KEY = "reliable_beat.key"
FENCE_TOKEN = "reliable_beat.fence_token"
ATTEMPT = "reliable_beat.attempt"
OUTCOME = "reliable_beat.outcome"
WORKFLOW_ID = "reliable_beat.workflow.id"
WORKFLOW_RUN = "reliable_beat.workflow.run"
SEQ = "reliable_beat.seq"
#: The W3C header / message option / column that carries a span context.
TRACEPARENT = "traceparent"

_tracer: Any = None
#: No provider set and none named by ``OTEL_PYTHON_TRACER_PROVIDER``: off. Read from the API's
#: global directly (``get_tracer_provider()`` reads the environment on every call: 30 times
#: slower, per hook); the public lookup is used when the variable is set or a future API
#: moves the global.
_UNSET_IS_OFF = (_trace is not None and hasattr(_trace, "_TRACER_PROVIDER")
                 and "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ)
_W3C: Any = TraceContextTextMapPropagator() if _trace is not None else None


def tracer() -> Any:
    """The package's tracer, or None when tracing is off (no API, or no provider set)."""
    global _tracer
    if _tracer is not None:
        return _tracer
    if _trace is None or (_UNSET_IS_OFF and _trace._TRACER_PROVIDER is None):
        return None
    provider = _trace.get_tracer_provider()
    if isinstance(provider, (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider)):
        return None
    _tracer = provider.get_tracer("reliable_beat", __version__)
    return _tracer


def _reset() -> None:
    """Forget the cached tracer (tests that swap providers)."""
    global _tracer
    _tracer = None


def _text(value: Any) -> str:
    """:func:`redact_text`, remembered for the strings seen lately (entry and task names, the
    key an execution's spans repeat): the redaction runs once per new string."""
    out = _redacted.get(value)
    if out is None:
        out = redact_text(value)
        if len(_redacted) >= _REDACTED_MAX:
            _redacted.clear()
        _redacted[value] = out
    return out


_redacted: dict[Any, str] = {}
_REDACTED_MAX = 1024


def attributes(**values: Any) -> dict[str, Any]:
    """Span attributes from keyword names (``entry`` -> ``reliable_beat.entry``; ``workflow_id``
    -> ``reliable_beat.workflow.id``), None dropped, strings redacted like logs."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        attr = "reliable_beat." + name.replace("workflow_", "workflow.")
        out[attr] = _text(value) if isinstance(value, str) else value
    return out


def record_error(span: Any, exc: BaseException, *, status: bool = True) -> None:
    """Record ``exc`` on ``span`` as an ``exception`` event, redacted like the logs (message and
    stack trace through :func:`~reliable_beat.redaction.redact_text`); ``status``: also set
    the span's status to ERROR."""
    if span is None:
        return
    name = type(exc).__qualname__
    module = type(exc).__module__
    qualified = name if module in ("builtins", None) else f"{module}.{name}"
    message = _text(str(exc))
    stack = _text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    span.add_event("exception", {"exception.type": qualified, "exception.message": message,
                                 "exception.stacktrace": stack})
    if status:
        span.set_status(Status(StatusCode.ERROR, f"{name}: {message}"[:1000]))


def _parent(parent: Any) -> Any:
    """A parent context from a traceparent string / carrier mapping; None: the current one."""
    if parent is None or _trace is None:
        return None
    if not isinstance(parent, str):  # (a str first: no ABC check on every execution)
        if isinstance(parent, _context.Context):
            return parent
        if isinstance(parent, Mapping):
            parent = parent.get(TRACEPARENT)
        if not isinstance(parent, str):
            return None
    if _TRACEPARENT_00.fullmatch(parent) is None:  # another version, or invalid: the W3C
        return _W3C.extract({TRACEPARENT: parent})  # propagator's rules
    flags = _FLAGS.get(parent[53:])
    if flags is None:
        flags = _trace.TraceFlags(int(parent[53:], 16))
    return _trace.set_span_in_context(_trace.NonRecordingSpan(_trace.SpanContext(
        int(parent[3:35], 16), int(parent[36:52], 16), True, flags)), _ROOT)


#: a version-00 traceparent (W3C Trace Context), read without the propagator (a third of its
#: cost, on every execution): the fields sliced from it once it matched
_TRACEPARENT_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
#: the flags of nearly every traceparent, made once
_FLAGS: dict[str, Any] = ({"00": _trace.TraceFlags(0), "01": _trace.TraceFlags(1)}
                          if _trace is not None else {})
#: the empty context: the parent of a new trace
_ROOT: Any = _context.Context() if _trace is not None else None


@contextlib.contextmanager
def span(name: str, *, parent: Any = None, root: bool = False, kind: str = "internal",
         attributes: Mapping[str, Any] | None = None, links: Sequence[str | None] = (),
         expected: tuple[type[BaseException], ...] = ()) -> Iterator[Any]:
    """A span made current for the block, or None when tracing is off.

    Args:
        parent: a ``traceparent`` string, a carrier mapping holding one, or an OpenTelemetry
            ``Context``; None (or a missing / invalid traceparent): the current context
            (``root``: a new trace instead).
        kind: ``internal``, ``producer``, ``consumer``, ``client`` or ``server``.
        links: traceparents of spans to link to (None and invalid ones skipped).
        expected: exceptions that end the block without being errors of the span (a
            framework's retry signal); recorded as an event only.

    An exception leaving the block is recorded redacted (:func:`record_error`) and re-raised.
    """
    t = tracer()
    if t is None:
        yield None
        return
    ctx = _parent(parent)
    if ctx is None and root:
        ctx = _context.Context()
    with t.start_as_current_span(
        name, context=ctx, kind=_KINDS[kind], attributes=attributes,
        links=_links(links), record_exception=False, set_status_on_exception=False,
    ) as s:
        try:
            yield s
        except expected as exc:
            record_error(s, exc, status=False)
            raise
        except BaseException as exc:
            record_error(s, exc)
            raise


def attached(traceparent: str | None) -> contextlib.AbstractContextManager[Any]:
    """Make ``traceparent``'s span context current for the block, no span made (a publish
    that the framework's own instrumentation traces: its producer span, e.g. Celery's
    ``apply_async/<task>``, and the ``traceparent`` it writes into the message then stay in
    this trace instead of starting one). A no-op when off or without a traceparent."""
    if not traceparent or tracer() is None:
        return contextlib.nullcontext()
    return _attached(_parent(traceparent))


@contextlib.contextmanager
def _attached(ctx: Any) -> Iterator[None]:
    if ctx is None:
        yield
        return
    token = _context.attach(ctx)
    try:
        yield
    finally:
        _context.detach(token)


def _links(traceparents: Sequence[str | None]) -> list[Any]:
    out = []
    for tp in traceparents:
        ctx = _parent(tp)
        if ctx is None:
            continue
        sc = _trace.get_current_span(ctx).get_span_context()
        if sc.is_valid:
            out.append(Link(sc))
    return out


def add_link(s: Any, traceparent: str | None) -> None:
    """Link span ``s`` (still open) to the span of ``traceparent``: a context learnt after the
    span started (the signal a ``receive signal`` span consumed). A no-op when off, without a
    traceparent (or an invalid one, e.g. a column edited by SQL), or on an API before 1.23
    (no ``Span.add_link``)."""
    if s is None or not isinstance(traceparent, str) or not traceparent:
        return
    found = _links([traceparent])
    add = getattr(s, "add_link", None)
    if found and add is not None:
        add(found[0].context)


def current_traceparent() -> str | None:
    """The ``traceparent`` of the current span, or None (tracing off, no span)."""
    if tracer() is None:
        return None
    return traceparent_of(_trace.get_current_span())


def traceparent_of(s: Any) -> str | None:
    """The W3C ``traceparent`` of span ``s`` (None: no span, or an invalid context)."""
    if s is None:
        return None
    sc = s.get_span_context()
    if not sc.is_valid:
        return None
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def inject(carrier: MutableMapping[str, Any]) -> None:
    """Put the current span's ``traceparent`` into ``carrier`` (headers); no-op when off."""
    tp = current_traceparent()
    if tp is not None:
        carrier[TRACEPARENT] = tp


def carrier() -> dict[str, str]:
    """``{"traceparent": ...}`` of the current span for a message's headers; ``{}`` when off
    (a workflow's activity and compensation messages: the activity joins the workflow's
    trace)."""
    tp = current_traceparent()
    return {} if tp is None else {TRACEPARENT: tp}


def in_span() -> bool:
    """Whether a valid span is current (another instrumentation's, e.g. Celery's task span)."""
    if tracer() is None:
        return False
    return bool(_trace.get_current_span().get_span_context().is_valid)


_KINDS: dict[str, Any] = (
    {"internal": SpanKind.INTERNAL, "producer": SpanKind.PRODUCER,
     "consumer": SpanKind.CONSUMER, "client": SpanKind.CLIENT, "server": SpanKind.SERVER}
    if _trace is not None else {}
)


class BeatTrace:
    """The spans of one beat tick: a ``reliable_beat.tick`` span (started when the first slot
    fires, at the tick's start) and one root span per fired slot, ``fire <entry>``, each in
    its own trace and linked to the tick (a batch claim fires many slots)."""

    def __init__(self, t: Any, start_ns: int, destination: str) -> None:
        self._t = t
        self._start_ns = start_ns
        self._destination = destination
        self._tick: Any = None
        self._spans: list[Any] = []

    @classmethod
    def start(cls, destination: str) -> BeatTrace | None:
        t = tracer()
        if t is None:
            return None
        return cls(t, _time_ns(), destination)

    def fire(self, *, entry: str | None, slot: str, key: str, task: str, trigger: str,
             task_id: str | None = None) -> str | None:
        """Start the span of one slot's firing; returns its ``traceparent`` for the trigger."""
        if self._tick is None:
            self._tick = self._t.start_span("reliable_beat.tick", context=_context.Context(),
                                            start_time=self._start_ns)
        attrs = attributes(entry=entry, slot=slot, key=key)
        attrs.update({"messaging.system": self._destination,
                      "messaging.operation.type": "create", "messaging.operation.name": "fire",
                      "messaging.destination.name": task, "reliable_beat.trigger": trigger})
        if task_id is not None:
            attrs["messaging.message.id"] = task_id
        s = self._t.start_span(f"fire {entry or task}", context=_context.Context(),
                               kind=SpanKind.PRODUCER, attributes=attrs,
                               links=[Link(self._tick.get_span_context())])
        self._spans.append(s)
        return traceparent_of(s)

    def end(self, exc: BaseException | None = None) -> None:
        """End the spans (after the commit; ``exc``: the tick failed, nothing was fired)."""
        for s in (*self._spans, *(() if self._tick is None else (self._tick,))):
            if exc is not None:
                record_error(s, exc)
            s.end()
        self._spans.clear()
        self._tick = None


def _time_ns() -> int:
    return time.time_ns()


class PublishSpans:
    """One ``send <task>`` producer span per trigger a beat publishes, child of its slot's
    ``fire`` span (the payload's ``traceparent``). Started right before the batch can reach the
    broker (after a held batch's wait), ended with each message's outcome."""

    def __init__(self, t: Any, messages: Sequence[Any], system: str) -> None:
        self._t = t
        self._messages = messages
        self._system = system
        self._spans: dict[int, Any] = {}

    @classmethod
    def of(cls, messages: Sequence[Any], system: str) -> PublishSpans | None:
        t = tracer()
        return None if t is None or not messages else cls(t, messages, system)

    def start(self) -> None:
        for m in self._messages:
            payload = m.payload if isinstance(m.payload, Mapping) else {}
            tp = getattr(m, "traceparent", None) or _payload_traceparent(payload)
            ctx = _parent(tp)
            if ctx is None:
                continue
            attrs = {"messaging.system": self._system, "messaging.operation.type": "send",
                     "messaging.operation.name": "send",
                     "messaging.destination.name": str(payload.get("task") or ""),
                     "messaging.message.id": str(payload.get("task_id")
                                                 or payload.get("message_id") or "")}
            self._spans[m.id] = self._t.start_span(
                f"send {payload.get('task') or m.destination}", context=ctx,
                kind=SpanKind.PRODUCER, attributes=attrs)

    def after(self, wait: Any) -> Any:
        def waited() -> None:
            wait()
            self.start()
        return waited

    def end(self, outcomes: Sequence[tuple[int, BaseException | None]]) -> None:
        for oid, err in outcomes:
            s = self._spans.pop(oid, None)
            if s is None:
                continue
            if err is not None:
                record_error(s, err)
            s.end()
        for s in self._spans.values():
            s.end()
        self._spans.clear()


def _payload_traceparent(payload: Mapping[str, Any]) -> str | None:
    """The ``traceparent`` a trigger payload carries (either shape), or None."""
    block = payload.get("reliable_beat")
    if isinstance(block, Mapping) and isinstance(block.get(TRACEPARENT), str):
        return str(block[TRACEPARENT])
    headers = payload.get("headers")
    if isinstance(headers, Mapping) and isinstance(headers.get(TRACEPARENT), str):
        return str(headers[TRACEPARENT])
    return None


def message_traceparent(message: Any) -> str | None:
    """The ``traceparent`` an outbox row was written under: its column, else its payload's."""
    tp = getattr(message, "traceparent", None)
    if tp:
        return str(tp)
    payload = getattr(message, "payload", None)
    return _payload_traceparent(payload) if isinstance(payload, Mapping) else None


def http_attributes(method: str, url: str) -> dict[str, Any]:
    """HTTP client span attributes of a request (``url.full`` redacted like logs)."""
    attrs: dict[str, Any] = {"http.request.method": method, "url.full": redact_url(url)}
    try:
        parts = urlsplit(url)
        if parts.hostname:
            attrs["server.address"] = parts.hostname
        if parts.port:
            attrs["server.port"] = parts.port
    except ValueError:
        pass
    return attrs



class DeliverySpans:
    """The relay's ``deliver <destination>`` span of each outbox row of a batch, in the trace of
    the span that wrote the row (:func:`message_traceparent`; a row written untraced starts a
    trace). :attr:`messages` are the rows with ``traceparent`` set to their delivery span, for
    the handler: the webhook's request span nests under it and sends it on."""

    def __init__(self, t: Any, group: Sequence[Any]) -> None:
        self._spans: list[Any] = []
        self.messages: list[Any] = []
        for m in group:
            ctx = _parent(message_traceparent(m)) or _context.Context()
            attrs = attributes(key=m.message_id, attempt=m.attempts)
            attrs["reliable_beat.outbox.destination"] = m.destination
            s = t.start_span(f"deliver {m.destination}", context=ctx, kind=SpanKind.PRODUCER,
                             attributes=attrs)
            self._spans.append(s)
            self.messages.append(dataclasses.replace(m, traceparent=traceparent_of(s)))

    @classmethod
    def of(cls, group: Sequence[Any]) -> DeliverySpans | None:
        t = tracer()
        return None if t is None or not group else cls(t, group)

    def end(self, results: Sequence[Any]) -> None:
        """End each span with its row's result (None: sent; an exception: failed)."""
        for s, err in zip(self._spans, results, strict=False):
            if isinstance(err, BaseException):
                s.set_attribute(OUTCOME, "failed")
                record_error(s, err)
            else:
                s.set_attribute(OUTCOME, "sent")
            s.end()
        self._spans.clear()


def annotate(attrs: Mapping[str, Any]) -> None:
    """Set ``attrs`` on the execution's span (:func:`process_span`'s, or the framework
    instrumentation's task span; else the current span); no-op when off."""
    if tracer() is None or not attrs:
        return
    found = _EXECUTION.get()
    if found is not None:
        found.attrs.update(attrs)
    else:
        _trace.get_current_span().set_attributes(attrs)


#: the names of the events of an execution's steps on its span
CLAIM_EVENT = "reliable_beat.claim"
COMPLETE_EVENT = "reliable_beat.complete"


class _Execution:
    """The span of the execution in progress, the exception already recorded on it, and the
    ``reliable_beat.*`` attributes its steps found (set on the span in one call as the
    execution ends: the SDK's cost of setting attributes is mostly per call)."""

    __slots__ = ("attrs", "recorded", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.recorded: BaseException | None = None
        self.attrs: dict[str, Any] = {}

    def flush(self) -> None:
        if self.attrs:
            self.span.set_attributes(self.attrs)
            self.attrs = {}


class process_span:  # lower case: used as a function, ``with tracing.process_span(...)``
    """The consumer span of one execution, ``process <task>``, child of the message's
    ``traceparent`` (none or invalid: a new trace), made current for the block; None when off.

    The execution's steps are recorded on this one span, not as spans of their own (a span
    costs the SDK five times an event): the claim as a ``reliable_beat.claim`` event
    (:func:`claimed`), the fenced completion as a ``reliable_beat.complete`` event
    (:class:`completion`), both bare (a timestamp: the outcome is the span's
    ``reliable_beat.outcome``); the messaging attributes are set as the span starts, the
    ``reliable_beat.*`` ones as it ends. What happens elsewhere (a retry, a dead letter, the
    relay's delivery of an outbox row) keeps its own span. When a span is already current (the
    framework's own instrumentation, e.g. ``opentelemetry-instrumentation-celery``, started
    one from the same ``traceparent``), no second one is made: the events and attributes go to
    that span. ``expected``: the framework's retry signals (recorded as an event, not an
    error).
    """

    __slots__ = ("_attrs", "_ctx_token", "_execution", "_expected", "_name", "_span", "_token",
                 "_traceparent")

    def __init__(self, task: str, *, traceparent: Any, system: str,
                 message_id: str | None = None, queue: str | None = None,
                 expected: tuple[type[BaseException], ...] = ()) -> None:
        self._name = task
        self._traceparent = traceparent
        self._attrs = _messaging(system, queue, message_id)
        self._expected = expected
        self._span: Any = None
        self._token: Any = None

    def __enter__(self) -> Any:
        t = tracer()
        if t is None:
            return None
        current = _trace.get_current_span()
        if current.get_span_context().is_valid:  # the framework's task span
            self._execution = _Execution(current)
            self._token = _EXECUTION.set(self._execution)
            return None
        s = self._span = t.start_span(
            f"process {self._name}", context=_parent(self._traceparent) or _ROOT,
            kind=SpanKind.CONSUMER, attributes=self._attrs)
        self._ctx_token = _context.attach(_trace.set_span_in_context(s))
        self._execution = _Execution(s)
        self._token = _EXECUTION.set(self._execution)
        return s

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._token is None:
            return
        _EXECUTION.reset(self._token)
        execution = self._execution
        s = self._span
        if s is None:  # the framework's span: it ends after this block
            execution.flush()
            return
        try:
            execution.flush()
            if exc is not None and exc is not execution.recorded:
                record_error(s, exc, status=not isinstance(exc, self._expected))
        finally:
            _context.detach(self._ctx_token)
            s.end()


def _messaging(system: str, queue: str | None, message_id: str | None) -> dict[str, Any]:
    """The messaging attributes of a ``process`` span (those of a system and queue made once)."""
    base = _MESSAGING.get((system, queue))
    if base is None:
        base = {"messaging.system": system, "messaging.operation.type": "process",
                "messaging.operation.name": "process"}
        if queue:
            base["messaging.destination.name"] = queue
        if len(_MESSAGING) >= _REDACTED_MAX:
            _MESSAGING.clear()
        _MESSAGING[(system, queue)] = base
    return {**base, "messaging.message.id": message_id} if message_id else base


_MESSAGING: dict[tuple[str, str | None], dict[str, Any]] = {}


def claimed(claim: Any, *, key: str, entry: str | None, slot: str | None) -> None:
    """Record a claim on the execution's span: its key, entry, slot, fence token and attempt
    as attributes (and its outcome, unless the run was acquired: the execution's outcome comes
    later), a bare ``reliable_beat.claim`` event (when the claim was made). ``claim`` None:
    the claim failed (the error is recorded where it is handled)."""
    found = _EXECUTION.get()
    attrs: dict[str, Any] = {} if found is None else found.attrs
    attrs[KEY] = _text(key)
    if entry is not None:
        attrs[ENTRY] = _text(entry)
    if slot is not None:
        attrs[SLOT] = slot  # ISO 8601 of the package's making: nothing to redact
    if claim is not None:
        attrs[FENCE_TOKEN] = claim.fence_token
        attrs[ATTEMPT] = claim.attempt
        if claim.outcome != "acquired":
            attrs[OUTCOME] = claim.outcome
    if found is None:
        s = _trace.get_current_span()
        s.set_attributes(attrs)
    else:
        s = found.span
    if claim is not None:
        s.add_event(CLAIM_EVENT)


class completion:  # lower case: used as a function, ``with tracing.completion():``
    """Around the fenced completion: a bare ``reliable_beat.complete`` event on the execution's
    span and its ``reliable_beat.outcome``: ``succeeded``, or ``fenced_out`` (a newer runner
    owns the run: this attempt's writes were refused; the span's status is then ERROR, the
    error recorded redacted). A no-op when off."""

    __slots__ = ("_execution",)

    def __enter__(self) -> None:
        self._execution = _EXECUTION.get() if tracer() is not None else _OFF

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        execution = self._execution
        if execution is _OFF:
            return
        if exc is None:
            outcome = "succeeded"
        elif isinstance(exc, StaleFenceToken):
            outcome = "fenced_out"
        else:
            return
        if execution is None:
            s = _trace.get_current_span()
            s.set_attribute(OUTCOME, outcome)
        else:
            s = execution.span
            execution.attrs[OUTCOME] = outcome
        s.add_event(COMPLETE_EVENT)
        if exc is not None:
            record_error(s, exc)
            if execution is not None:
                execution.recorded = exc


def completion_span(key: str, fence_token: int, attempt: int) -> completion:
    """The former name of :class:`completion` (the key, fence token and attempt are attributes
    of the execution's span, set at its claim)."""
    return completion()


_OFF = _Execution(None)


#: the execution in progress while :func:`process_span` runs
_EXECUTION: contextvars.ContextVar[_Execution | None] = contextvars.ContextVar(
    "reliable_beat_execution", default=None)


def linked_root(name: str, **attrs: Any) -> str | None:
    """Start and end a span ``name`` in a new trace, linked to the current span; its
    ``traceparent`` (None when off). Continue-as-new: the next run's trace."""
    t = tracer()
    if t is None:
        return None
    links = _links([current_traceparent()])
    s = t.start_span(name, context=_context.Context(), links=links,
                     attributes=attributes(**attrs))
    s.end()
    return traceparent_of(s)
