"""Edges of the workflow API on SQLite, PostgreSQL and MariaDB: every call that takes a
duration or a value refuses a bad one at the call, with a ``WorkflowValueError`` (a
``ValueError``) naming the argument and the limit, and writes nothing.

Durations (``ctx.sleep``, ``ctx.wait_signal(timeout=)``) are ``timedelta`` from 0 to
``MAX_TIMER``; values the engine stores and replays (a workflow's arguments at ``start`` and
``continue_as_new``, a signal's payload, an activity's, a compensation's, a child's or a
step's arguments, a step's result) are at most ``DEFAULT_MAX_PAYLOAD_BYTES`` as JSON, the
limit activity messages always had. A refused durable call takes no position in the history:
code that catches the error goes on and replays the same way.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox, workflow_signals, workflows
from reliable_beat.outbox import DEFAULT_MAX_PAYLOAD_BYTES
from reliable_beat.workflows import WorkflowContext, engine, signal, workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver

BIG = "x" * DEFAULT_MAX_PAYLOAD_BYTES  # over the limit once inside a JSON list
LIMIT = f"{DEFAULT_MAX_PAYLOAD_BYTES} bytes"


def _noop(*args: Any) -> str:
    return "ok"


def _big() -> str:
    return BIG


def edges(ctx: WorkflowContext, case: str, *rest: Any) -> Any:
    """Makes the call ``case`` names, catches what it raises, then goes on: one step, a
    wait for a signal (the test sends it: the next advance replays all of this)."""
    caught: dict[str, str] | str = "no error"
    try:
        if case == "timeout_negative":
            ctx.wait_signal("x", timeout=timedelta(seconds=-3))
        elif case == "timeout_far":
            ctx.wait_signal("x", timeout=timedelta.max)
        elif case == "timeout_number":
            ctx.wait_signal("x", timeout=5)  # type: ignore[arg-type]
        elif case == "sleep_far":  # past year 9999
            ctx.sleep(timedelta(days=3_000_000))
        elif case == "sleep_until_naive":
            ctx.sleep_until(datetime(2030, 1, 1))  # naive: the point of the case
        elif case == "activity":
            ctx.activity("t.limits.task", BIG)
        elif case == "compensation":
            with ctx.saga() as saga:
                saga.compensate("t.limits.task", BIG)
        elif case == "child":
            ctx.start_child("t.limits", "noop", BIG)
        elif case == "step_args":
            ctx.step(_noop, BIG)
        elif case == "step_result":
            ctx.step(_big)
        elif case == "continue_as_new":
            ctx.continue_as_new("continued", BIG)
        elif case == "continued":
            return "continued with the big arguments"
    except Exception as exc:
        caught = {"type": type(exc).__name__, "message": str(exc)}
    ctx.step(_noop)
    ctx.wait_signal("go")
    return caught


workflow(name="t.limits")(edges)


def _run(store: Store, wid: str, *args: Any) -> Any:
    app = Celery("wflimits", set_as_current=False)
    app.conf.update(broker_url="memory://")
    handle = engine.start(store, "t.limits", wid, list(args))
    driver = Driver(store, app)
    driver.run()
    if engine.get_workflow(store, wid)["state"] == "waiting":
        assert signal(store, wid, "go", 1)
        driver.run()  # the replay: the refused call again, then the step, then the signal
    assert not driver.failures, driver.failures
    return handle.result(timeout=5)


REFUSED = {
    "timeout_negative": ["ctx.wait_signal timeout", "from 0 to 36500 days", "-3 s"],
    "timeout_far": ["ctx.wait_signal timeout", "from 0 to 36500 days (100 years)"],
    "timeout_number": ["ctx.wait_signal timeout", "timedelta", "5 (int)"],
    "sleep_far": ["ctx.sleep duration", "from 0 to 36500 days", "259200000000 s"],
    "sleep_until_naive": ["ctx.sleep_until instant", "tz-aware"],
    "activity": ["activity 't.limits.task' arguments", LIMIT],
    "compensation": ["compensation 't.limits.task' arguments", LIMIT],
    "child": ["child 't.limits' arguments", LIMIT],
    "step_args": ["step", "_noop", "arguments", LIMIT],
    "continue_as_new": ["continue_as_new arguments", LIMIT],
}


def test_each_durable_call_refuses_a_bad_duration_or_a_value_over_the_limit(
        store: Store) -> None:
    for case, words in REFUSED.items():
        got = _run(store, f"edge:{case}", case)
        assert isinstance(got, dict), (case, got)
        assert got["type"] == "WorkflowValueError", (case, got)
        for word in words:
            assert word in got["message"], (case, word, got["message"])
    step = _run(store, "edge:step_result", "step_result")  # the step ran: its failure recorded
    assert step["type"] == "ActivityError", step
    assert "WorkflowValueError" in step["message"] and LIMIT in step["message"], step
    with store.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(workflows)).scalar() == \
            len(REFUSED) + 1  # no child was started
        assert conn.execute(sa.select(sa.func.max(workflows.c.run_no))).scalar() == 1
        assert conn.execute(sa.select(sa.func.count()).select_from(outbox).where(
            outbox.c.message_id.like("act:%"))).scalar() == 0  # no activity message


def test_start_and_signal_refuse_values_over_the_limit(store: Store) -> None:
    with pytest.raises(ValueError) as err:
        engine.start(store, "t.limits", "edge:start", ["step_args"], {"blob": BIG})
    assert type(err.value).__name__ == "WorkflowValueError"
    assert "workflow 't.limits' arguments" in str(err.value) and LIMIT in str(err.value)
    engine.start(store, "t.limits", "edge:signal", ["step_args"])
    with pytest.raises(ValueError) as err:
        signal(store, "edge:signal", "go", BIG, key="big")
    assert type(err.value).__name__ == "WorkflowValueError"
    assert "signal 'go' payload" in str(err.value) and LIMIT in str(err.value)
    with store.connect() as conn:
        assert conn.execute(sa.select(workflows.c.workflow_id)).scalars().all() == [
            "edge:signal"]
        assert conn.execute(sa.select(sa.func.count()).select_from(workflow_signals)
                            ).scalar() == 0
    assert signal(store, "edge:signal", "go", "x" * 1000, key="big")  # the key is still free


def test_a_call_the_history_recorded_over_the_limit_replays_as_it_was(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A workflow in flight across the upgrade that brought the limit: its recorded step
    with large arguments replays (refusing it now would stop the workflow half-way)."""
    from reliable_beat.workflows import limits

    app = Celery("wflimits", set_as_current=False)
    app.conf.update(broker_url="memory://")
    monkeypatch.setattr(limits, "DEFAULT_MAX_PAYLOAD_BYTES", 4 * DEFAULT_MAX_PAYLOAD_BYTES)
    handle = engine.start(store, "t.limits", "edge:recorded", ["step_args"])
    driver = Driver(store, app)
    driver.run()
    assert engine.get_workflow(store, "edge:recorded")["state"] == "waiting"
    monkeypatch.undo()
    assert signal(store, "edge:recorded", "go", 1)
    driver.run()  # replays the recorded step with its large arguments
    assert handle.result(timeout=5) == "no error"
