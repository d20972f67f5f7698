"""A malformed workflows row (``args`` not a JSON array, ``kwargs`` not a JSON object: a row
written by hand, by a bad migration or by another tool) parks only that workflow ``blocked``,
with a reason naming the row, the column and the fix; the other workflows go on, and after
the row is fixed ``workflows resume`` completes it. Found by the fault harness's workflow
poison row (docs/reliability.md): before, the advance raised ``TypeError`` in its claim on
every wake, the row stayed ``pending`` and nothing said why."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflows
from reliable_beat.workflows import WorkflowContext, engine, resume, workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver


@pytest.fixture(params=["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)])
def wf_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    store: Store = request.getfixturevalue(f"{request.param}_store")
    yield store
    engine.crash_hook = None


def _add(ctx: WorkflowContext, a: int, b: int = 0) -> int:
    return a + b


@pytest.mark.parametrize(("column", "value"), [
    ("args", 5),
    ("args", {"a": 1}),  # list() of it would silently pass its keys as arguments
    ("args", "12"),
    ("kwargs", [1, 2]),
])
def test_a_malformed_row_blocks_only_its_workflow(wf_store: Store, column: str,
                                                   value: Any) -> None:
    app = Celery("wfm", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_database_url=wf_store.engine.url
                    .render_as_string(hide_password=False))
    workflow(name="t.add")(_add)
    engine.start(wf_store, "t.add", "bad", args=[1, 2])
    engine.start(wf_store, "t.add", "good", args=[3, 4])
    with wf_store.begin() as conn:
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id == "bad")
                     .values({column: value}))
    driver = Driver(wf_store, app)
    driver.run()
    good = engine.get_workflow(wf_store, "good")
    assert (good["state"], good["result"]) == ("completed", 7)
    bad = engine.get_workflow(wf_store, "bad")
    assert bad["state"] == "blocked", bad
    reason = bad["block_reason"]
    assert "malformed" in reason and f".{column} of workflow 'bad'" in reason, reason
    assert "workflows resume" in reason, reason
    assert driver.failures == []  # parked, not an exception on every wake
    # fix the row, resume: it runs from where it stopped (nothing recorded yet)
    with wf_store.begin() as conn:
        conn.execute(sa.update(workflows).where(workflows.c.workflow_id == "bad")
                     .values(args=[1, 2], kwargs={}))
    resume(wf_store, "bad")
    driver.run()
    bad = engine.get_workflow(wf_store, "bad")
    assert (bad["state"], bad["result"]) == ("completed", 3)
