"""Stores, apps and the five-question helpers of :mod:`reliable_beat.testing`.

Every helper runs the user's ``IdempotentTask`` in-process through Celery's ``apply`` (the
eager path: same claim, lease, fenced completion and failure classification as a worker),
against a real store, and counts effects with a *probe* the user supplies. Faults are
injected at two seams of the task protocol, never by patching the clock or the database:

* the completion (:func:`reliable_beat.runs.complete`, the fenced ``UPDATE`` that makes the
  run ``succeeded`` inside the body's transaction): a :class:`SimulatedCrash` or a
  transient error raised just before it leaves the body's transaction uncommitted;
* the body (the task's ``run``): the fence is moved (``runs.clear_lease``, what a takeover
  does) just before the body starts, so its commit must be refused.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.expression import Executable

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import attempts as attempts_table
from reliable_beat.db.tables import runs as runs_table
from reliable_beat.errors import IdempotencyKeyError, LeaseHeldError, StaleFenceToken

__all__ = [
    "Evidence",
    "Probe",
    "Question",
    "QuestionFailed",
    "SimulatedCrash",
    "call",
    "count_effects",
    "die_mid_run",
    "fail_then_retry",
    "make_app",
    "run_concurrently",
    "run_twice",
    "stale_runner",
    "throwaway_store",
    "use_store",
]

#: What counts the effects of one work unit: a callable returning a number, or a SQL query
#: (text or a SQLAlchemy selectable) returning one number, run on the store's database.
Probe = Callable[[], int] | str | Executable


class Question(str, Enum):
    """The five questions (the reliability write-up behind this project), as named in
    failure messages."""

    RUN_TWICE = "can it run twice?"
    OVERLAP = "can it overlap?"
    DIES_MID_RUN = "what if the machine dies mid-run?"
    RETRY = "can it retry safely?"
    STALE_RUNNER = "is a stale runner fenced out?"


class QuestionFailed(AssertionError):
    """A helper's assertion failed. The message starts with the question, in brackets.

    Attributes:
        question: the :class:`Question`.
        evidence: what the helper saw (:class:`Evidence`).
    """

    def __init__(self, evidence: Evidence, problem: str) -> None:
        self.question = evidence.question
        self.evidence = evidence
        super().__init__(f"[{evidence.question.value}] {problem}\n  saw: {evidence.summary()}")


class SimulatedCrash(BaseException):
    """Raised by the kit where a process would die (a ``BaseException``, like ``SystemExit``:
    the task's failure handling does not catch it, as it would not run in a dead process)."""


@dataclass
class Evidence:
    """What one helper saw.

    Attributes:
        question: the question asked.
        keys: the idempotency keys the calls ran under (in call order).
        effects_before / effects_after: the probe's value before the first call and after
            the last one; ``effects`` is the difference.
        per_run: the effects one run of the work unit is expected to produce.
        outcomes: one line per call: ``succeeded``, ``deduplicated``, ``busy``, ``crashed``,
            ``fenced_out`` or the exception's type name.
        attempts: ``reliable_beat_attempts`` rows of the runs touched, oldest first, each
            ``{"key", "attempt", "outcome", "fence_token", "retry_in_seconds", "error"}``.
        run_states: key -> ``reliable_beat_runs.state`` after the last call.
    """

    question: Question
    keys: list[str] = field(default_factory=list)
    effects_before: int = 0
    effects_after: int = 0
    per_run: int = 1
    outcomes: list[str] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    run_states: dict[str, str] = field(default_factory=dict)

    @property
    def effects(self) -> int:
        """Effects the calls produced (probe after - probe before)."""
        return self.effects_after - self.effects_before

    def summary(self) -> str:
        """One line: keys, effects, outcomes, attempt outcomes, run states."""
        tries = [f"{a['key']}#{a['attempt']}:{a['outcome']}" for a in self.attempts]
        return (
            f"keys={sorted(set(self.keys))} effects={self.effects} (expected {self.per_run}) "
            f"outcomes={self.outcomes} attempts={tries} runs={self.run_states}"
        )


# ---------------------------------------------------------------------- stores and apps ----


@contextlib.contextmanager
def throwaway_store(url: str | None = None) -> Iterator[Store]:
    """A migrated store that exists for the ``with`` block only.

    Args:
        url: None (default): a SQLite file in a temporary directory. A PostgreSQL URL
            (``postgresql+psycopg://user:pass@host/db``): a fresh database named
            ``rb_test_<hex>`` is created on that server (the user needs ``CREATEDB``) and
            dropped afterwards; ``db`` itself is only used to connect. A ``sqlite:///path``
            URL is used as given (and not deleted).

    Yields:
        A :class:`~reliable_beat.db.dialects.Store` (role ``cli``) with the schema at head.
        Create your own tables on ``store.engine``: effect and key must share a database.

    Raises:
        ConfigurationError: the URL is not a supported SQLAlchemy URL.
    """
    if url is None:
        with TemporaryDirectory(prefix="rb-test-") as tmp, \
                _migrated(f"sqlite:///{Path(tmp) / 'rb.sqlite3'}") as store:
            yield store
        return
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() != "postgresql":
        with _migrated(url) as store:
            yield store
        return
    name = f"rb_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(parsed, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            with _migrated(parsed.set(database=name).render_as_string(False)) as store:
                yield store
        finally:
            with admin.connect() as conn:
                conn.execute(
                    sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = :n AND pid <> pg_backend_pid()"),
                    {"n": name},
                )
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    finally:
        admin.dispose()


@contextlib.contextmanager
def _migrated(url: str) -> Iterator[Store]:
    store = Store.from_url(url, role="cli")
    try:
        upgrade(store)
        yield store
    finally:
        store.dispose()


def _forget_settings(app: Any) -> None:
    """Make every IdempotentTask of ``app`` read the app's settings again, and drop the app's
    cached broker connections and result backend (Celery keeps both once made, even an
    eager ``delay()`` makes the producer pool), so a changed broker or backend is used."""
    for task in list(app.tasks.values()):
        if isinstance(task, IdempotentTask):
            task._rb_settings = None
    # Celery keeps them in private attributes (5.3 - 5.7); each is reset only if present.
    pool = getattr(app, "_pool", None)
    if pool is not None:
        pool.force_close_all()
        app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    if getattr(app, "_backend_cache", None) is not None:
        app._backend_cache = None
    local = getattr(app, "_local", None)
    if local is not None:
        local.__dict__.pop("backend", None)


#: The settings :func:`use_store` sets besides the URL (quick retries: a test never waits).
TEST_SETTINGS: Mapping[str, Any] = {
    "reliable_beat_retry_base_seconds": 0.01,
    "reliable_beat_retry_cap_seconds": 0.05,
}


@contextlib.contextmanager
def use_store(app: Any, store: Store, *, eager: bool = True, **conf: Any) -> Iterator[Any]:
    """Point ``app`` (your Celery app) at ``store`` for the ``with`` block, then restore it.

    Sets ``reliable_beat_database_url``, ``task_always_eager`` (``eager``), quick retry
    backoff (:data:`TEST_SETTINGS`, base 0.01 s, cap 0.05 s) and any ``conf`` you pass
    (``reliable_beat_*`` or Celery settings), and makes the app's IdempotentTasks read their
    settings again (they cache them per process).

    Yields:
        ``app``.
    """
    updates = dict(TEST_SETTINGS)
    updates.update(
        reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False),
        task_always_eager=eager,
    )
    updates.update(conf)
    missing = object()
    saved = {k: app.conf.get(k, missing) for k in updates}
    app.conf.update(updates)
    _forget_settings(app)
    try:
        yield app
    finally:
        for k, v in saved.items():
            if v is missing:
                app.conf.pop(k, None)
            else:
                app.conf[k] = v
        _forget_settings(app)


def make_app(store: Store, *, name: str = "rb-test", eager: bool = True, **conf: Any) -> Any:
    """A fresh Celery app on ``store``: in-memory broker and result backend, no worker.

    Args:
        store: the store (e.g. from :func:`throwaway_store`).
        eager: ``task_always_eager`` (``delay()`` runs the task inline).
        conf: more settings.

    Returns:
        A ``celery.Celery`` (``set_as_current=False``) with :data:`TEST_SETTINGS`.
    """
    from celery import Celery

    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False),
        task_always_eager=eager,
        **TEST_SETTINGS,
    )
    app.conf.update(conf)
    return app


def call(task: Any, *args: Any, key: str | None = None, **kwargs: Any) -> Any:
    """Call an ``IdempotentTask`` directly, as a test would call a function, under ``key``.

    Runs the real protocol (claim, body, fenced completion) in this thread through
    ``task.apply`` and returns the body's result, or the stored one when ``key`` already
    succeeded (deduplicated). Without ``key`` the task's ``idempotency_key_for(*args,
    **kwargs)`` derives it, as ``delay()`` does.

    Raises:
        IdempotencyKeyError: no ``key`` given and ``idempotency_key_for`` derives none.
        Whatever the body raised (after the task's own classification: a permanent error
        is dead-lettered first); :class:`~reliable_beat.errors.LeaseHeldError` when another
        runner holds the key's lease.
    """
    if key is None:
        _store_of(task)  # a plain task: refused naming the fix
        key = task.idempotency_key_for(*args, **kwargs)
        if not key:
            raise IdempotencyKeyError(
                f"rbt.call({task.name}, ...): no key: pass key=..., or let the task derive "
                "one by overriding idempotency_key_for() (it returned None for "
                f"args={args!r} kwargs={kwargs!r})")
    result = task.apply(args, kwargs, headers={KEY_HEADER: key})
    return result.get(disable_sync_subtasks=False, propagate=True)


def count_effects(probe: Probe, store: Store) -> int:
    """The probe's value: ``probe()``, or the probe query's single number on ``store``.

    Raises:
        TypeError: the probe returned something that is not a whole number.
    """
    if callable(probe):
        value: Any = probe()
    else:
        stmt = sa.text(probe) if isinstance(probe, str) else probe
        with store.engine.connect() as conn:
            value = conn.execute(stmt).scalar()  # type: ignore[call-overload]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"the effects probe returned {value!r}; it must count effects (an int)")
    return value


# ---------------------------------------------------------------------------- internals ----


def _store_of(task: Any) -> Store:
    if not isinstance(task, IdempotentTask):
        raise TypeError(
            f"{getattr(task, 'name', task)!r} is not an IdempotentTask; define it with "
            "@app.task(base=IdempotentTask, bind=True)"
        )
    return task.store


def _headers(key: str | None) -> dict[str, Any]:
    return {KEY_HEADER: key} if key is not None else {}


class _Calls:
    """Runs ``task.apply`` calls and records outcome and key of each."""

    def __init__(self, task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.task = task
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.lock = threading.Lock()
        self.outcomes: list[str] = []
        self.keys: list[str] = []
        self.errors: list[BaseException] = []

    def apply(self, key: str | None, *, task_id: str | None = None) -> str:
        store = self.task.store
        before = _max_attempt_id(store)
        try:
            result = self.task.apply(self.args, self.kwargs, headers=_headers(key),
                                     task_id=task_id)
            value: Any = result.result if result.failed() else None
            outcome = "succeeded" if not result.failed() else type(value).__name__
            if isinstance(value, LeaseHeldError):
                outcome = "busy"
            elif isinstance(value, StaleFenceToken):
                outcome = "fenced_out"
            if isinstance(value, BaseException):
                with self.lock:
                    self.errors.append(value)
        except SimulatedCrash:
            outcome = "crashed"
        seen = _attempts_after(store, before)
        if outcome == "succeeded" and seen and all(a["outcome"] == "deduplicated" for a in seen):
            outcome = "deduplicated"
        with self.lock:
            self.outcomes.append(outcome)
            for a in seen:
                if a["key"] not in self.keys:
                    self.keys.append(a["key"])
        return outcome


def _max_attempt_id(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.max(attempts_table.c.id))).scalar() or 0)


def _attempts_after(store: Store, after_id: int) -> list[dict[str, Any]]:
    stmt = (
        sa.select(runs_table.c.idempotency_key, attempts_table.c.attempt,
                  attempts_table.c.outcome, attempts_table.c.fence_token,
                  attempts_table.c.retry_in_seconds, attempts_table.c.error)
        .join(runs_table, runs_table.c.id == attempts_table.c.run_id)
        .where(attempts_table.c.id > after_id)
        .order_by(attempts_table.c.id)
    )
    with store.engine.connect() as conn:
        return [
            {"key": r.idempotency_key, "attempt": r.attempt, "outcome": r.outcome,
             "fence_token": r.fence_token, "retry_in_seconds": r.retry_in_seconds,
             "error": r.error}
            for r in conn.execute(stmt)
        ]


def _run_states(store: Store, keys: Sequence[str]) -> dict[str, str]:
    if not keys:
        return {}
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(runs_table.c.idempotency_key, runs_table.c.state)
            .where(runs_table.c.idempotency_key.in_(list(keys)))
        ).all()
    return {r.idempotency_key: r.state for r in rows}


class _Session:
    """One helper's evidence gathering: probe before, calls, probe after, attempts."""

    def __init__(self, question: Question, task: Any, args: Sequence[Any],
                 kwargs: Mapping[str, Any] | None, effects: Probe, per_run: int) -> None:
        self.store = _store_of(task)
        self.probe = effects
        self.calls = _Calls(task, args, kwargs or {})
        self.evidence = Evidence(question=question, per_run=per_run)
        self.first_attempt = _max_attempt_id(self.store)
        self.evidence.effects_before = count_effects(effects, self.store)

    def finish(self) -> Evidence:
        ev = self.evidence
        ev.effects_after = count_effects(self.probe, self.store)
        ev.outcomes = list(self.calls.outcomes)
        ev.keys = list(self.calls.keys)
        ev.attempts = _attempts_after(self.store, self.first_attempt)
        ev.run_states = _run_states(self.store, ev.keys)
        return ev

    def fail(self, problem: str) -> QuestionFailed:
        return QuestionFailed(self.evidence, problem)

    def check_one_set(self, what: str) -> None:
        ev = self.evidence
        errors = self.calls.errors
        if (ev.effects != ev.per_run and ev.outcomes and len(errors) == len(ev.outcomes)
                and not any(o in ("succeeded", "deduplicated") for o in ev.outcomes)):
            # every call raised: that error, not the probe, is the news (the headline used
            # to say "the probe saw nothing" and hide e.g. an IdempotencyKeyError)
            last = errors[-1]
            raise self.fail(
                f"{what}: every call raised, none ran the body to its commit: "
                f"{type(last).__name__}: {last}"
                + (" (pass key=... to the helper, or give the task idempotency_key_for)"
                   if isinstance(last, IdempotencyKeyError) else "")
            )
        if ev.effects != ev.per_run:
            raise self.fail(
                f"{what} produced {ev.effects} effects; one set is {ev.per_run}"
                + (" (the probe saw nothing: does it count this work unit's effects?)"
                   if ev.effects == 0 else "")
            )

    def check_single_key(self, what: str) -> None:
        keys = set(self.evidence.keys)
        if len(keys) > 1:
            raise self.fail(
                f"{what} ran under {len(keys)} different idempotency keys {sorted(keys)}: the "
                "key must be derived from the work (entity, period, operation), never from the "
                "attempt, the clock or a random id"
            )


@contextlib.contextmanager
def _at_completion(action: Callable[[runs.Claim], None]) -> Iterator[list[runs.Claim]]:
    """Call ``action(claim)`` once, at the next completion (just before the fenced UPDATE
    that marks the run succeeded, inside the body's transaction). Yields the claims seen."""
    original = runs.complete
    seen: list[runs.Claim] = []
    lock = threading.Lock()

    def complete(conn: sa.Connection, claim: runs.Claim, result: Any) -> None:
        with lock:
            first = not seen
            seen.append(claim)
        if first:
            action(claim)
        original(conn, claim, result)

    runs.complete = complete  # type: ignore[assignment]
    try:
        yield seen
    finally:
        runs.complete = original  # type: ignore[assignment]


@contextlib.contextmanager
def _before_body(task: Any, action: Callable[[], None]) -> Iterator[None]:
    """Call ``action()`` in the task's execution, just before its body runs."""
    bound = task.run
    had_own = "run" in task.__dict__

    def run(*args: Any, **kwargs: Any) -> Any:
        action()
        return bound(*args, **kwargs)

    task.run = run
    orig_run = task.__dict__.get("_orig_run")
    if orig_run is not None:  # autoretry_for: IdempotentTask puts _orig_run back as run
        task._orig_run = run
    try:
        yield
    finally:
        if had_own:
            task.run = bound
        else:
            del task.run
        if orig_run is not None:
            task._orig_run = orig_run


# ------------------------------------------------------------------------------ helpers ----


def run_twice(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    effects: Probe,
    key: str | None = None,
    per_run: int = 1,
) -> Evidence:
    """Question 1, *can it run twice?*: run the same work unit twice, one after the other.

    Expects one set of effects, and the second call recorded as a ``deduplicated`` no-op
    under the same key.

    Args:
        task: your ``IdempotentTask``.
        args / kwargs: the call.
        effects: the probe counting this work unit's effects (:data:`Probe`).
        key: the idempotency key (the ``reliable_beat_key`` header); None: the task derives
            it (``idempotency_key_for``), as for a message sent without one.
        per_run: effects one run produces.

    Returns:
        The :class:`Evidence`.

    Raises:
        QuestionFailed: naming the question, with what was seen.
    """
    s = _Session(Question.RUN_TWICE, task, args, kwargs, effects, per_run)
    s.calls.apply(key)
    s.calls.apply(key)
    ev = s.finish()
    s.check_single_key("the same work unit, run twice,")
    s.check_one_set("two runs of one work unit")
    if ev.outcomes != ["succeeded", "deduplicated"]:
        raise s.fail(
            f"expected the first run to succeed and the second to be a recorded deduplicated "
            f"no-op, got {ev.outcomes}"
        )
    return ev


def run_concurrently(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    effects: Probe,
    key: str | None = None,
    n: int = 4,
    per_run: int = 1,
    timeout: float = 30.0,
) -> Evidence:
    """Question 2, *can it overlap?*: ``n`` threads run the same work unit at once.

    Each thread has its own connection, so the claims really race in the database. The body
    that acquires the run is held until every other call has been answered (or is itself
    inside a body), so they all overlap it. Expects one set of effects, one ``succeeded``,
    the others ``busy`` (the lease is held) or ``deduplicated``.

    Args: as :func:`run_twice`, and ``n`` (>= 2) threads, ``timeout`` seconds for them all.

    Raises:
        QuestionFailed: naming the question, with what was seen.
        ValueError: ``n`` < 2.
    """
    if n < 2:
        raise ValueError(f"run_concurrently needs n >= 2 threads, got {n}")
    s = _Session(Question.OVERLAP, task, args, kwargs, effects, per_run)
    cond = threading.Condition()
    state = {"answered": 0, "in_body": 0}

    def hold() -> None:
        with cond:
            state["in_body"] += 1
            cond.notify_all()
            cond.wait_for(lambda: state["answered"] + state["in_body"] >= n, timeout=timeout)

    start = threading.Barrier(n)

    def one() -> None:
        start.wait(timeout)
        try:
            s.calls.apply(key)
        finally:
            with cond:
                state["answered"] += 1
                cond.notify_all()

    with _before_body(task, hold):
        threads = [threading.Thread(target=one, name=f"rb-overlap-{i}") for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    ev = s.finish()
    s.check_single_key(f"{n} concurrent runs of one work unit")
    s.check_one_set(f"{n} concurrent runs of one work unit")
    ran = ev.outcomes.count("succeeded")
    others = [o for o in ev.outcomes if o != "succeeded"]
    if ran != 1 or any(o not in ("busy", "deduplicated") for o in others):
        raise s.fail(
            f"expected one run to succeed and the others to be busy or deduplicated, got "
            f"{ev.outcomes}"
        )
    return ev


def die_mid_run(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    effects: Probe,
    key: str | None = None,
    at: str = "before_commit",
    per_run: int = 1,
) -> Evidence:
    """Question 3, *what if the machine dies mid-run?*: crash, recover, check the end state.

    ``at="before_commit"``: the process dies after the body wrote its effect but before the
    body's transaction commits (a :class:`SimulatedCrash` just before the fenced completion);
    the run is left ``running`` with its lease, as a dead worker leaves it. Recovery: the
    lease is released as if it had expired (``runs.clear_lease``, which bumps the fence as
    any takeover does) and the same message is delivered again.

    ``at="after_commit"``: the process dies after the commit but before the broker got its
    acknowledgement; recovery is the redelivery of the same message, which must be a
    ``deduplicated`` no-op.

    Expects one set of effects and the crashed run ``succeeded`` after recovery (under the
    same key: a redelivered message must map to the same run).

    Raises:
        QuestionFailed: naming the question, with what was seen.
        ValueError: ``at`` is not one of the two points.
    """
    if at not in ("before_commit", "after_commit"):
        raise ValueError(f"die_mid_run(at={at!r}): expected 'before_commit' or 'after_commit'")
    s = _Session(Question.DIES_MID_RUN, task, args, kwargs, effects, per_run)
    task_id = str(uuid.uuid4())  # one message, delivered twice

    def crash(claim: runs.Claim) -> None:
        raise SimulatedCrash(f"reliable_beat.testing: simulated crash of {claim.key!r} "
                             "before the commit")

    if at == "before_commit":
        with _at_completion(crash) as seen:
            s.calls.apply(key, task_id=task_id)
        if not seen:
            raise s.fail("the task never reached its completion (did the body raise?): "
                         f"outcomes {s.calls.outcomes}")
        crashed = seen[0].key
        runs.clear_lease(s.store, crashed)  # the dead worker's lease expires
    else:
        s.calls.apply(key, task_id=task_id)
        crashed = s.calls.keys[0] if s.calls.keys else ""
    s.calls.apply(key, task_id=task_id)  # redelivery
    ev = s.finish()
    state = _run_states(s.store, [crashed]).get(crashed)
    s.check_single_key("the crashed message and its redelivery")
    s.check_one_set(f"a crash {at.replace('_', ' ')} and the recovery")
    if state != "succeeded":
        raise s.fail(f"after recovery the crashed run {crashed!r} is {state!r}, not succeeded")
    expected_last = "succeeded" if at == "before_commit" else "deduplicated"
    if ev.outcomes[-1] != expected_last:
        raise s.fail(f"the redelivery was {ev.outcomes[-1]!r}, expected {expected_last!r}")
    return ev


def fail_then_retry(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    effects: Probe,
    key: str | None = None,
    error: BaseException | None = None,
    per_run: int = 1,
) -> Evidence:
    """Question 4, *can it retry safely?*: a transient failure just before the commit.

    ``error`` (default ``ConnectionError``, transient for every IdempotentTask) is raised
    once after the body wrote its effect, before the body's transaction commits; the task
    classifies it and retries (in-process: Celery's eager retry). Expects one set of
    effects, the run ``succeeded``, the first attempt recorded ``retrying`` with a backoff
    between 0 and the task's bound (``min(cap, base * 2**0)``, or its fixed delay), then a
    ``succeeded`` attempt under the same key.

    Raises:
        QuestionFailed: naming the question, with what was seen.
    """
    s = _Session(Question.RETRY, task, args, kwargs, effects, per_run)
    injected = error or ConnectionError("reliable_beat.testing: injected transient failure")

    def fail(claim: runs.Claim) -> None:
        raise injected

    with _at_completion(fail):
        s.calls.apply(key)
    ev = s.finish()
    s.check_single_key("the failed attempt and its retry")
    outcomes = [a["outcome"] for a in ev.attempts]
    if outcomes[:1] != ["retrying"]:
        raise s.fail(f"the injected {type(injected).__name__} was not retried: attempts "
                     f"{outcomes} (is it classified transient? see IdempotentTask.classify)")
    if outcomes[-1:] != ["succeeded"]:
        last = next((a["error"] for a in reversed(ev.attempts) if a["error"]), None)
        raise s.fail(f"the retry after the injected failure did not succeed: attempts "
                     f"{outcomes}; last error: {(last or '?').splitlines()[0][:300]}")
    s.check_one_set("a failed attempt and its retry")
    delay = ev.attempts[0]["retry_in_seconds"]
    bound = _first_backoff_bound(task)
    if delay is None or not 0 <= delay <= bound:
        raise s.fail(f"the retry's backoff {delay!r} s is outside [0, {bound}] s")
    if set(ev.run_states.values()) != {"succeeded"}:
        raise s.fail(f"the run ended {ev.run_states}, not succeeded")
    return ev


def _first_backoff_bound(task: Any) -> float:
    plan = task._rb_retry
    if plan.fixed_delay is not None:
        return float(plan.fixed_delay)
    s = task.reliable_beat_settings
    base = plan.base_seconds or task.retry_base_seconds or s.retry_base_seconds
    cap = (plan.cap_seconds if plan.cap_seconds is not None
           else task.retry_cap_seconds if task.retry_cap_seconds is not None
           else s.retry_cap_seconds)
    return float(min(cap, base))


def stale_runner(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    effects: Probe,
    key: str | None = None,
) -> Evidence:
    """*Is a stale runner fenced out?*: the fence moves while the body runs.

    Just before the body starts, the run's fence is moved as a takeover moves it
    (``runs.clear_lease``: another runner may now claim it), so this runner is stale. Expects
    its commit refused with :class:`~reliable_beat.errors.StaleFenceToken`, the attempt
    recorded ``fenced_out``, and **no** effect left behind (everything it wrote rolled back).

    Raises:
        QuestionFailed: naming the question, with what was seen.
    """
    s = _Session(Question.STALE_RUNNER, task, args, kwargs, effects, 0)

    def move_fence() -> None:
        runs.clear_lease(s.store, task.idempotency_key)

    with _before_body(task, move_fence):
        s.calls.apply(key)
    ev = s.finish()
    if ev.effects != 0:
        raise s.fail(f"the stale runner left {ev.effects} effects behind; its writes must roll "
                     "back with its refused commit (write them in self.transaction(), and "
                     "external calls through self.outbox)")
    if ev.outcomes != ["fenced_out"]:
        raise s.fail(f"expected the stale runner's commit refused with StaleFenceToken, got "
                     f"{ev.outcomes}")
    if "fenced_out" not in [a["outcome"] for a in ev.attempts]:
        raise s.fail("the stale attempt was not recorded fenced_out")
    return ev
