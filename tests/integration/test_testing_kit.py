"""The testing kit tests itself (issue 19): each five-question helper fails, naming its
question, on deliberately broken tasks, and passes on the correct versions.

Broken tasks:

* ``outside``: the effect is written in a transaction of its own, outside
  ``self.transaction()``;
* ``time_key``: the idempotency key is derived from the attempt time;
* ``no_outbox``: an external call (a fake mail server) is made in the body, no outbox.

Correct versions: ``correct`` (effect in ``self.transaction()``) and ``outbox`` (the external
call recorded with ``self.outbox.add`` in the same transaction).

The full matrix runs on SQLite (one store per case) and once on PostgreSQL (one throwaway
database made by :func:`reliable_beat.testing.throwaway_store` from a server URL).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat import testing as rbt
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox as outbox_table
from reliable_beat.errors import IdempotencyKeyError

effects = sa.Table(
    "kit_payouts", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("merchant", sa.String(100), nullable=False),
)

KINDS = ("correct", "outbox", "outside", "time_key", "no_outbox")
HELPERS: dict[str, tuple[Callable[..., rbt.Evidence], dict[str, Any], rbt.Question]] = {
    "run_twice": (rbt.run_twice, {}, rbt.Question.RUN_TWICE),
    "run_concurrently": (rbt.run_concurrently, {"n": 4}, rbt.Question.OVERLAP),
    "die_before_commit": (rbt.die_mid_run, {"at": "before_commit"}, rbt.Question.DIES_MID_RUN),
    "die_after_commit": (rbt.die_mid_run, {"at": "after_commit"}, rbt.Question.DIES_MID_RUN),
    "fail_then_retry": (rbt.fail_then_retry, {}, rbt.Question.RETRY),
    "stale_runner": (rbt.stale_runner, {}, rbt.Question.STALE_RUNNER),
}
#: Which helper catches which broken task (every broken task is caught by at least one).
CAUGHT = {
    "correct": set(),
    "outbox": set(),
    "outside": {"die_before_commit", "fail_then_retry", "stale_runner"},
    "time_key": {"run_twice", "run_concurrently", "die_before_commit", "die_after_commit"},
    "no_outbox": {"die_before_commit", "fail_then_retry", "stale_runner"},
}


class Tasks:
    """The five tasks on one app, and the probe of each."""

    def __init__(self, app: Celery, store: Store) -> None:
        effects.create(store.engine, checkfirst=True)
        self.store = store
        self.mailbox: list[str] = []  # the fake mail server of no_outbox
        mailbox = self.mailbox

        @app.task(shared=False, base=IdempotentTask, bind=True, name="kit.correct")
        def correct(self: IdempotentTask, merchant: str) -> str:
            with self.transaction() as tx:
                tx.execute(effects.insert().values(merchant=merchant))
            return merchant

        @app.task(shared=False, base=IdempotentTask, bind=True, name="kit.outbox")
        def outbox(self: IdempotentTask, merchant: str) -> None:
            with self.transaction() as tx:
                self.outbox.add(tx, "email", {"merchant": merchant})

        @app.task(shared=False, base=IdempotentTask, bind=True, name="kit.outside")
        def outside(self: IdempotentTask, merchant: str) -> None:
            with self.store.engine.begin() as conn:  # BROKEN: its own transaction
                conn.execute(effects.insert().values(merchant=merchant))
            with self.transaction():
                pass

        class TimeKeyed(IdempotentTask):  # type: ignore[misc]
            def idempotency_key_for(self, merchant: str) -> str:
                return f"payout:{merchant}:{time.time()}"  # BROKEN: from the attempt time

        @app.task(shared=False, base=TimeKeyed, bind=True, name="kit.time_key")
        def time_key(self: IdempotentTask, merchant: str) -> None:
            with self.transaction() as tx:
                tx.execute(effects.insert().values(merchant=merchant))

        @app.task(shared=False, base=IdempotentTask, bind=True, name="kit.no_outbox")
        def no_outbox(self: IdempotentTask, merchant: str) -> None:
            with self.transaction() as tx:
                mailbox.append(merchant)  # BROKEN: an external call in the body
                tx.execute(effects.insert().values(merchant=merchant))

        self.tasks = {"correct": correct, "outbox": outbox, "outside": outside,
                      "time_key": time_key, "no_outbox": no_outbox}

    def probe(self, kind: str, merchant: str) -> rbt.Probe:
        if kind == "outbox":
            # outbox message ids are "<idempotency key>#<n>"
            return sa.select(sa.func.count()).select_from(outbox_table).where(
                outbox_table.c.destination == "email",
                outbox_table.c.message_id.like(f"payout:{merchant}:%"))
        if kind == "no_outbox":
            return lambda: self.mailbox.count(merchant)
        return sa.select(sa.func.count()).select_from(effects).where(
            effects.c.merchant == merchant)


def check(tasks: Tasks, kind: str, helper: str, merchant: str) -> str | None:
    """Run one helper on one task; None when the verdict is the expected one, else why not."""
    fn, options, question = HELPERS[helper]
    key = None if kind == "time_key" else f"payout:{merchant}:2026-01"
    try:
        evidence = fn(tasks.tasks[kind], (merchant,), effects=tasks.probe(kind, merchant),
                      key=key, **options)
    except rbt.QuestionFailed as exc:
        if helper not in CAUGHT[kind]:
            return f"{kind}/{helper}: failed but should pass: {exc}"
        if exc.question is not question or not str(exc).startswith(f"[{question.value}]"):
            return f"{kind}/{helper}: failed naming the wrong question: {exc}"
        return None
    if helper in CAUGHT[kind]:
        return f"{kind}/{helper}: passed but must fail: {evidence.summary()}"
    return None


@pytest.fixture
def sqlite_tasks() -> Iterator[Tasks]:
    with rbt.throwaway_store() as store:
        yield Tasks(rbt.make_app(store), store)


@pytest.mark.parametrize("helper", list(HELPERS))
@pytest.mark.parametrize("kind", KINDS)
def test_helper_verdict_sqlite(sqlite_tasks: Tasks, kind: str, helper: str) -> None:
    assert check(sqlite_tasks, kind, helper, "m1") is None


@pytest.mark.postgres
def test_helper_verdicts_postgresql(postgres_server: str) -> None:
    with rbt.throwaway_store(postgres_server) as store:
        assert store.dialect == "postgresql"
        name = store.engine.url.database
        assert name is not None and name.startswith("rb_test_")
        tasks = Tasks(rbt.make_app(store), store)
        merchants = (f"m{i}" for i in itertools.count())
        problems = [p for kind in KINDS for helper in HELPERS
                    if (p := check(tasks, kind, helper, next(merchants))) is not None]
    assert problems == []
    # the throwaway database is gone
    admin = sa.create_engine(postgres_server)
    with admin.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM pg_database WHERE datname = :n"),
                            {"n": name}).scalar() == 0
    admin.dispose()


def test_every_broken_task_is_caught_and_messages_name_the_question(
    sqlite_tasks: Tasks,
) -> None:
    assert all(CAUGHT[k] for k in ("outside", "time_key", "no_outbox"))
    with pytest.raises(AssertionError, match=r"^\[can it run twice\?\] .*different "
                       r"idempotency keys"):
        rbt.run_twice(sqlite_tasks.tasks["time_key"], ("m9",),
                      effects=sqlite_tasks.probe("time_key", "m9"))


def test_probe_that_sees_nothing_fails_visibly(sqlite_tasks: Tasks) -> None:
    with pytest.raises(rbt.QuestionFailed, match="the probe saw nothing"):
        rbt.run_twice(sqlite_tasks.tasks["correct"], ("m1",), key="k:1",
                      effects=sqlite_tasks.probe("correct", "someone-else"))
    with pytest.raises(TypeError, match="must count effects"):
        rbt.run_twice(sqlite_tasks.tasks["correct"], ("m2",), key="k:2",
                      effects=lambda: "two")  # type: ignore[arg-type,return-value]


def test_run_twice_headline_names_the_error_every_call_raised(sqlite_tasks: Tasks) -> None:
    """A task with no idempotency key (no ``key=``, no ``idempotency_key_for``): both calls
    raise IdempotencyKeyError; the headline says so instead of "the probe saw nothing"."""
    with pytest.raises(rbt.QuestionFailed) as caught:
        rbt.run_twice(sqlite_tasks.tasks["correct"], ("m7",),
                      effects=sqlite_tasks.probe("correct", "m7"))
    headline = str(caught.value).splitlines()[0]
    assert headline.startswith("[can it run twice?] "), headline
    assert "IdempotencyKeyError" in headline, headline
    assert "every call raised" in headline, headline
    assert "probe saw nothing" not in headline, headline
    assert caught.value.evidence.outcomes == ["IdempotencyKeyError"] * 2


def test_call_with_explicit_key_and_eager_delay(sqlite_tasks: Tasks) -> None:
    task = sqlite_tasks.tasks["correct"]
    with pytest.raises(IdempotencyKeyError):
        task("m1")  # a direct call has no key: refused, as documented
    assert rbt.call(task, "m1", key="payout:m1:2026-01") == "m1"
    assert rbt.call(task, "m1", key="payout:m1:2026-01") == "m1"  # deduplicated
    # eager (task_always_eager): delay_with_key runs inline, through the same protocol
    assert task.delay_with_key("payout:m2:2026-01", "m2").get() == "m2"
    with sqlite_tasks.store.engine.connect() as conn:
        got = conn.execute(sa.select(effects.c.merchant).order_by(effects.c.id)).scalars().all()
    assert got == ["m1", "m2"]


def test_use_store_points_an_existing_app_and_restores_it(sqlite_tasks: Tasks) -> None:
    app = Celery("user-app", set_as_current=False)
    app.conf.reliable_beat_database_url = "sqlite:////nonexistent/never-used.sqlite3"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="user.t")
    def t(self: IdempotentTask) -> str:
        return self.store.url

    with rbt.use_store(app, sqlite_tasks.store) as same:
        assert same is app and app.conf.task_always_eager is True
        assert rbt.call(t, key="u:1") == sqlite_tasks.store.url
    assert app.conf.reliable_beat_database_url == "sqlite:////nonexistent/never-used.sqlite3"
    assert "task_always_eager" not in app.conf or not app.conf.task_always_eager


def test_fail_then_retry_names_an_injected_error_that_is_not_retried(sqlite_tasks: Tasks) -> None:
    with pytest.raises(rbt.QuestionFailed, match=r"^\[can it retry safely\?\] the injected "
                       r"ValueError was not retried"):
        rbt.fail_then_retry(sqlite_tasks.tasks["correct"], ("m1",), key="k:1",
                            effects=sqlite_tasks.probe("correct", "m1"),
                            error=ValueError("permanent by default"))


def test_plugin_refuses_a_bad_app_spec_naming_the_fix() -> None:
    from reliable_beat.testing.pytest import _load_app

    with pytest.raises(pytest.UsageError, match="expected 'module:attribute'"):
        _load_app("proj.celery")
    with pytest.raises(pytest.UsageError, match="no_such_module_xyz"):
        _load_app("no_such_module_xyz:app")
    assert _load_app("examples.payouts.app:app").main == "payouts"


def test_call_derives_the_key_from_idempotency_key_for(sqlite_tasks: Tasks) -> None:
    """`rbt.call` without `key=` uses the task's own `idempotency_key_for`, as `delay()`
    does; a task that derives none is refused naming `key=`."""
    from reliable_beat import runs

    app = sqlite_tasks.tasks["correct"].app

    class Keyed(IdempotentTask):  # type: ignore[misc]
        def idempotency_key_for(self, merchant: str) -> str:
            return f"payout:{merchant}:2026-02"

    @app.task(shared=False, base=Keyed, bind=True, name="kit.keyed")
    def keyed(self: IdempotentTask, merchant: str) -> str:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(merchant=merchant))
        return merchant

    assert rbt.call(keyed, "m7") == "m7"
    assert rbt.call(keyed, "m7") == "m7"  # deduplicated under the derived key
    assert runs.get_run(sqlite_tasks.store, "payout:m7:2026-02")["state"] == "succeeded"
    assert count_of(sqlite_tasks, "m7") == 1
    with pytest.raises(IdempotencyKeyError, match=r"no key: pass key=\.\.\."):
        rbt.call(sqlite_tasks.tasks["correct"], "m8")


def count_of(tasks: Tasks, merchant: str) -> int:
    return rbt.count_effects(tasks.probe("correct", merchant), tasks.store)


def test_a_passing_overlap_scenario_logs_no_error(
    sqlite_tasks: Tasks, caplog: pytest.LogCaptureFixture
) -> None:
    """The busy calls of `run_concurrently` (LeaseHeldError: another runner holds the lease)
    are the expected answer: logged at INFO, never Celery's ERROR "raised unexpected"."""
    import logging

    caplog.set_level(logging.INFO)
    ev = rbt.run_concurrently(sqlite_tasks.tasks["correct"], ("m9",), key="payout:m9:2026-01",
                              effects=sqlite_tasks.probe("correct", "m9"), n=3)
    assert "busy" in ev.outcomes, ev.outcomes
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    assert any("is busy (leased by another runner" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
