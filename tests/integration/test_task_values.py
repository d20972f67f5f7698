"""IdempotentTask and the values Celery accepts (issue 12), in-process on a real store.

Results and arguments Celery's JSON serializer carries (``Decimal``, ``datetime``, ``UUID``)
are stored as kombu encodes them; a committed effect means the run succeeded; the store's
limits are checked where values enter; a call reusing a key with other arguments is
noticed; ``attempts`` counts the tries that ran the body; Celery's retry options keep
their meaning. Real-worker proofs: ``tests/acceptance/test_task_values.py``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from kombu.utils import json as kombu_json

from reliable_beat import runs
from reliable_beat.celery.task import KEY_HEADER, RESULT_NOTE_KEY, IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters
from reliable_beat.db.tables import runs as runs_table
from reliable_beat.errors import ConfigurationError, IdempotencyKeyError
from reliable_beat.values import ValueLimitError

effects = sa.Table(
    "values_effects", sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(400)), sa.Column("run_id", sa.Integer),
)

AT = datetime(2026, 3, 1, 12, 30, tzinfo=timezone.utc)
ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
TYPED = {"amount": Decimal("12.50"), "at": AT, "id": ID, "day": AT.date()}


def kombu_encoded(value: Any) -> Any:
    """``value`` as Celery's JSON serializer puts it on the wire (plain JSON data)."""
    return json.loads(kombu_json.dumps(value))


@pytest.fixture
def app(store: Store) -> Iterator[Celery]:
    effects.create(store.engine)
    app = Celery("values", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False),
        reliable_beat_lease_seconds=5,
        reliable_beat_retry_max_attempts=3,
        reliable_beat_retry_base_seconds=0.01,
        reliable_beat_retry_cap_seconds=0.05,
    )
    yield app


def count(store: Store, table: sa.Table, *where: Any) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(table).where(*where)).scalar_one())


# ------------------------------------------------------------------ results ----

@pytest.mark.parametrize("use_transaction", [True, False])
def test_typed_result_is_stored_as_kombu_encodes_it_and_the_run_succeeds(
    app: Celery, store: Store, use_transaction: bool
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.typed")
    def typed(self: IdempotentTask) -> dict[str, Any]:
        if use_transaction:
            with self.transaction() as tx:
                tx.execute(effects.insert().values(key=self.idempotency_key, run_id=self.run_id))
        return TYPED

    r = typed.apply(headers={KEY_HEADER: "typed:1"})
    assert r.successful(), r.traceback  # main: FAILURE (tx) / dead letter (no tx)
    assert r.get() == TYPED
    run = runs.get_run(store, "typed:1")
    assert run["state"] == "succeeded"
    assert run["result"] == kombu_encoded(TYPED)
    assert count(store, dead_letters) == 0
    # A replay deduplicates and returns the same Python values, decoded as kombu would.
    again = typed.apply(headers={KEY_HEADER: "typed:1"})
    assert again.successful() and again.get() == TYPED
    assert count(store, effects) == (1 if use_transaction else 0)


def test_result_nothing_can_carry_is_replaced_by_a_note(app: Celery, store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.opaque")
    def opaque(self: IdempotentTask) -> Any:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key, run_id=self.run_id))
        return {"obj": object(), "nan": float("nan")}

    r = opaque.apply(headers={KEY_HEADER: "opaque:1"})
    assert r.successful(), r.traceback
    run = runs.get_run(store, "opaque:1")
    assert run["state"] == "succeeded"
    assert "could not be stored as JSON" in run["result"][RESULT_NOTE_KEY]
    assert count(store, dead_letters) == 0


def test_requeue_refuses_a_dead_run_whose_effect_committed(app: Celery, store: Store) -> None:
    """A dead letter whose run had committed its effect (data an older version wrote: the
    run marked dead after its effect committed) must not run the body a second time."""
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.once")
    def once(self: IdempotentTask) -> str:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key, run_id=self.run_id))
        return "ok"

    once.apply(headers={KEY_HEADER: "once:1"}).get()
    run = runs.get_run(store, "once:1")
    with store.begin() as conn:
        conn.execute(sa.update(runs_table).where(runs_table.c.id == run["id"])
                     .values(state="dead", reason="exhausted"))
        dl_id = conn.execute(dead_letters.insert().values(
            kind="run", run_id=run["id"], key="once:1", task="v.once",
            payload={"task": "v.once", "args": [], "kwargs": {}, "key": "once:1"},
            reason="exhausted", attempts=1, created_at=AT,
        ).returning(dead_letters.c.id)).scalar_one()
    for force in (False, True):
        with pytest.raises(ValueError, match="effect committed"):
            runs.requeue_dead_letter(store, dl_id, by="test", force=force)
    assert runs.get_run(store, "once:1")["state"] == "dead"


# ---------------------------------------------------------------- arguments ----

def test_typed_arguments_are_stored_as_kombu_encodes_them(app: Celery, store: Store) -> None:
    seen: list[Any] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.args")
    def typed_args(self: IdempotentTask, when: datetime, amount: Decimal, ref: uuid.UUID) -> str:
        seen.append((when, amount, ref))
        return "ok"

    r = typed_args.apply((AT, Decimal("1.10")), {"ref": ID}, headers={KEY_HEADER: "args:1"})
    assert r.successful(), r.traceback  # main: TypeError at the claim, no run row
    assert seen == [(AT, Decimal("1.10"), ID)]
    run = runs.get_run(store, "args:1")
    assert run["state"] == "succeeded"
    assert run["args"] == kombu_encoded([AT, Decimal("1.10")])
    assert run["kwargs"] == kombu_encoded({"ref": ID})


def test_argument_json_cannot_carry_is_refused_visibly(app: Celery, store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.badarg")
    def badarg(self: IdempotentTask, thing: Any) -> str:
        raise AssertionError("must not run")

    r = badarg.apply((object(),), headers={KEY_HEADER: "badarg:1"})
    assert isinstance(r.result, ValueError) and "args[0]" in str(r.result)
    with store.engine.connect() as conn:
        dl = conn.execute(sa.select(dead_letters)).mappings().one()
    assert dl["kind"] == "message" and dl["key"] == "badarg:1" and "args[0]" in dl["error"]


# ------------------------------------------------------------------- limits ----

def test_limits_are_checked_at_the_call(app: Celery, store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.limits")
    def limits(self: IdempotentTask) -> str:
        return "ok"

    with pytest.raises(ValueLimitError, match="401 characters long; the limit is 400"):
        limits.apply_async(headers={KEY_HEADER: "k" * 401})
    with pytest.raises(ValueLimitError, match=r"task_id .* the limit is 64"):
        limits.apply_async(headers={KEY_HEADER: "k:1"}, task_id="t" * 65)


def test_arguments_that_cannot_be_stored_are_refused_at_the_call(
        app: Celery, store: Store) -> None:
    """Celery's JSON sends NaN; the run's arguments are stored as JSON, which has none: the
    call is refused where the caller can see it, not dead-lettered at the worker."""
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.unstorable")
    def unstorable(self: IdempotentTask, *args: Any, **kwargs: Any) -> str:
        raise AssertionError("must not run")

    with pytest.raises(ValueLimitError, match=r"v.unstorable: args\[0\]=nan: not a finite"):
        unstorable.delay_with_key("nan:1", float("nan"))
    with pytest.raises(ValueLimitError, match=r"kwargs\['x'\]=inf"):
        unstorable.delay_with_key("nan:2", x=float("inf"))
    with pytest.raises(ValueLimitError, match=r"args\[0\]: .* is not something Celery's JSON"):
        unstorable.apply_async((object(),), headers={KEY_HEADER: "obj:1"})
    unstorable.delay_with_key("ok:1", 1.5, when=datetime(2026, 1, 1, tzinfo=timezone.utc))
    assert count(store, dead_letters) == 0


def test_too_long_key_reaching_a_worker_is_a_permanent_visible_refusal(
    app: Celery, store: Store
) -> None:
    ran: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.longkey")
    def longkey(self: IdempotentTask) -> str:
        ran.append(1)
        return "ok"

    key = "long:" + "x" * 500
    r = longkey.apply(headers={KEY_HEADER: key})  # a message sent by name, not through us
    assert isinstance(r.result, ValueLimitError), r.result
    assert "the limit is 400" in str(r.result)
    assert ran == []
    assert count(store, runs_table) == 0
    with store.engine.connect() as conn:
        dl = conn.execute(sa.select(dead_letters)).mappings().one()
    assert dl["kind"] == "message" and dl["reason"] == "invalid"
    assert dl["payload"]["key"] == key and len(dl["key"]) <= 400


def test_too_long_task_id_reaching_a_worker_is_refused(app: Celery, store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.longid")
    def longid(self: IdempotentTask) -> str:
        return "ok"

    r = longid.apply(headers={KEY_HEADER: "longid:1"}, task_id="i" * 80)
    assert isinstance(r.result, ValueLimitError) and "task_id" in str(r.result)
    assert count(store, dead_letters, dead_letters.c.kind == "message") == 1


# ---------------------------------------------------------------- key reuse ----

def test_key_reused_with_other_arguments_warns(
    app: Celery, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.reuse")
    def reuse(self: IdempotentTask, amount: int) -> int:
        return amount

    assert reuse.apply((1,), headers={KEY_HEADER: "reuse:1"}).get() == 1
    with caplog.at_level(logging.WARNING, logger="reliable_beat.celery.task"):
        assert reuse.apply((1,), headers={KEY_HEADER: "reuse:1"}).get() == 1
        assert "used for another call" not in caplog.text
        assert reuse.apply((2,), headers={KEY_HEADER: "reuse:1"}).get() == 1
    assert "idempotency key 'reuse:1' was used for another call" in caplog.text


def test_key_reused_with_other_arguments_refused_by_setting(app: Celery, store: Store) -> None:
    app.conf.reliable_beat_key_reuse = "refuse"

    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.reuse2")
    def reuse2(self: IdempotentTask, amount: int) -> int:
        return amount

    assert reuse2.apply((1,), headers={KEY_HEADER: "reuse:2"}).get() == 1
    r = reuse2.apply((2,), headers={KEY_HEADER: "reuse:2"})
    assert isinstance(r.result, IdempotencyKeyError)
    assert runs.get_run(store, "reuse:2")["result"] == 1


# ----------------------------------------------------------------- attempts ----

def test_attempts_count_the_tries_that_ran_the_body(app: Celery, store: Store) -> None:
    """Three tries died mid-body (their leases expired); the fourth claim only finds the
    budget (3) spent: the run and its dead letter say 3 tries, not 4."""
    ran: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.poison")
    def poison(self: IdempotentTask) -> str:
        ran.append(1)
        return "ok"

    for _ in range(3):  # three workers that claimed, ran and died
        claim = runs.claim_run(store, "poison:1", owner="dead-worker", lease=timedelta(0),
                               task="v.poison")
        assert claim.acquired
    poison.apply(headers={KEY_HEADER: "poison:1"})
    assert ran == []
    run = runs.get_run(store, "poison:1")
    assert run["state"] == "dead" and run["attempts"] == 3  # main: 4
    with store.engine.connect() as conn:
        dl = conn.execute(sa.select(dead_letters)).mappings().one()
        numbers = conn.execute(sa.select(attempts.c.attempt).order_by(attempts.c.id)).scalars()
        assert list(numbers) == [1, 2, 3, 3]
    assert dl["attempts"] == 3  # main: 4


def test_attempts_after_transient_failures_equal_the_tries(app: Celery, store: Store) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.fails")
    def fails(self: IdempotentTask) -> str:
        raise ConnectionError(f"try {self.attempt}")

    fails.apply(headers={KEY_HEADER: "fails:1"})
    run = runs.get_run(store, "fails:1")
    assert run["state"] == "dead" and run["attempts"] == 3
    assert count(store, attempts, attempts.c.outcome.in_(["retrying", "dead"])) == 3


# ------------------------------------------------------ Celery retry options ----

def test_max_retries_sets_the_budget(app: Celery, store: Store) -> None:
    tries: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.maxr", max_retries=1)
    def maxr(self: IdempotentTask) -> str:
        tries.append(self.attempt)
        raise ConnectionError("down")

    maxr.apply(headers={KEY_HEADER: "maxr:1"})
    assert tries == [1, 2]  # max_retries=1: one retry after the first try (setting: 3)
    run = runs.get_run(store, "maxr:1")
    # main: Celery's MaxRetriesExceeded read as "retry not sent": left `retrying`
    assert run["state"] == "dead" and run["attempts"] == 2
    assert count(store, dead_letters, dead_letters.c.attempts == 2) == 1


def test_autoretry_for_retries_what_celery_would_and_nothing_else(
    app: Celery, store: Store
) -> None:
    tries: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.auto",
              autoretry_for=(ValueError,), max_retries=2)
    def auto(self: IdempotentTask, exc: str) -> str:
        tries.append(self.attempt)
        raise {"value": ValueError, "lookup": LookupError}[exc]("x")

    # ValueError is permanent by default; listed in autoretry_for, Celery retries it
    auto.apply(("value",), headers={KEY_HEADER: "auto:1"})
    assert tries == [1, 2, 3]
    assert runs.get_run(store, "auto:1")["attempts"] == 3
    tries.clear()
    auto.apply(("lookup",), headers={KEY_HEADER: "auto:2"})  # not listed: Celery fails it
    assert tries == [1]
    assert runs.get_run(store, "auto:2")["reason"] == "permanent"


def test_backoff_options_shape_the_delays(app: Celery) -> None:
    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.bo",
              retry_backoff=2, retry_backoff_max=5, retry_jitter=False)
    def bo(self: IdempotentTask) -> None:
        return None

    assert [bo._backoff(k) for k in range(4)] == [2.0, 4.0, 5.0, 5.0]

    @app.task(shared=False, base=IdempotentTask, bind=True, name="v.fixed",
              default_retry_delay=7)
    def fixed(self: IdempotentTask) -> None:
        return None

    assert [fixed._backoff(k) for k in range(3)] == [7.0, 7.0, 7.0]


@pytest.mark.parametrize(("options", "message"), [
    ({"max_retries": None}, "max_retries=None"),
    ({"max_retries": 2, "max_attempts": 5}, "contradicts max_attempts=5"),
    ({"retry_backoff": True, "retry_base_seconds": 3.0}, "retry_base_seconds"),
    ({"retry_backoff_max": 30, "retry_cap_seconds": 9.0}, "retry_cap_seconds"),
    ({"retry_kwargs": {"exc": 1}}, "retry_kwargs"),
])
def test_retry_options_that_cannot_keep_their_meaning_are_refused_at_definition(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        type("T", (IdempotentTask,), {"name": "v.refused", **options})


def test_retry_options_validation_over_real_app_definition(app: Celery) -> None:
    def body(self: IdempotentTask) -> None:
        return None

    task = app.task(shared=False, base=IdempotentTask, bind=True, name="v.def",
                    max_retries=None)(body)
    with pytest.raises(ConfigurationError, match=r"IdempotentTask v\.def: max_retries=None"):
        _ = task.name  # the task class is made here (Celery defines tasks lazily)


# ------------------------------------------------------- entry names (edges) ----

@pytest.mark.parametrize("name", ["n" * 201, "forged\n[ERROR] line", "ansi\x1b[2J"])
def test_entry_names_are_checked_at_the_cli_and_the_api_on_every_dialect(
    store: Store, name: str
) -> None:
    """Main: a 201-character name was accepted on SQLite and crashed the beat on PostgreSQL;
    control characters were accepted everywhere (forged log lines)."""
    from dataclasses import replace

    from click.testing import CliRunner

    from reliable_beat.celery.commands import reliable_beat
    from reliable_beat.db.tables import entries
    from reliable_beat.entries import definition_from_celery, save_runtime_entry
    from reliable_beat.settings import Settings

    result = CliRunner().invoke(reliable_beat, [
        "--database-url", store.url, "entries", "add", name, "--task", "t", "--every", "5"])
    assert result.exit_code != 0, result.output
    assert "entry name" in result.output
    good = definition_from_celery("good", {"task": "t", "schedule": 5}, default_timezone="UTC",
                                  settings=Settings(), now=AT, origin="runtime")
    with pytest.raises(ConfigurationError, match="entry name"):
        save_runtime_entry(store, replace(good, name=name), create=True)
    assert count(store, entries) == 0
