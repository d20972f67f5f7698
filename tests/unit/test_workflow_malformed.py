"""A workflow row or history event corrupted by SQL (garbage JSON, a JSON value of the wrong
shape, an unknown kind or state, a digest that is no digest) parks that workflow ``blocked``
with a reason naming the table, column and what was expected, and the way out; it is not
called non-determinism, and the other workflows, the sweep, ``workflows show`` and
``workflows list`` keep working (issue 16, review).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.db.dialects import Store
from reliable_beat.workflows import WorkflowContext, engine, signal, workflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
from wf_driver import Driver

WF = "reliable_beat_workflows"
EV = "reliable_beat_workflow_events"


def make_app(store: Store) -> Celery:
    app = Celery("wfbad", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False),
        reliable_beat_lease_seconds=30,
        reliable_beat_retry_max_attempts=2,
        reliable_beat_retry_base_seconds=0.01,
        reliable_beat_retry_cap_seconds=0.02,
    )

    @app.task(shared=False, base=IdempotentTask, bind=True, name="bad.double")
    def double(self: IdempotentTask, x: int) -> int:
        return x * 2

    return app


def flow(ctx: WorkflowContext, x: int) -> list[int]:
    a = ctx.activity("bad.double", x)
    ctx.wait_signal("go")
    return [a, ctx.activity("bad.double", a)]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """SQLite (JSON is text there: anything can be written) and PostgreSQL (jsonb refuses
    text that is not JSON, so only the wrong-shape cases run there)."""
    workflow(name="t.bad")(flow)
    yield request.getfixturevalue("sqlite_store" if request.param == "sqlite"
                                  else "pg_store")
    engine.crash_hook = None


#: (what is corrupted, SQL, what the reason must say)
CASES = [
    ("workflow args not JSON", f"UPDATE {WF} SET args = 'garbage{{' WHERE workflow_id = 'bad'",
     ["reliable_beat_workflows.args", "not valid JSON", "a JSON list"]),
    ("workflow args wrong shape", f"UPDATE {WF} SET args = '{{\"x\": 1}}' "
     "WHERE workflow_id = 'bad'",
     ["reliable_beat_workflows.args", "a JSON list", "object"]),
    ("workflow kwargs wrong shape", f"UPDATE {WF} SET kwargs = '[1]' WHERE workflow_id = 'bad'",
     ["reliable_beat_workflows.kwargs", "a JSON object", "array"]),
    # the fresh user's case: a JSON string (it was reported as non-determinism)
    ("workflow args a string", f"UPDATE {WF} SET args = '\"notalist\"' "
     "WHERE workflow_id = 'bad'",
     ["reliable_beat_workflows.args", "a JSON list", "string", "notalist"]),
    ("workflow kwargs a string", f"UPDATE {WF} SET kwargs = '\"notadict\"' "
     "WHERE workflow_id = 'bad'",
     ["reliable_beat_workflows.kwargs", "a JSON object", "string"]),
    ("event result not JSON", f"UPDATE {EV} SET result = 'garbage{{' WHERE seq = 1 AND "
     f"workflow_pk = (SELECT id FROM {WF} WHERE workflow_id = 'bad')",
     ["reliable_beat_workflow_events.result", "seq 1", "not valid JSON"]),
    ("event error wrong shape", f"UPDATE {EV} SET error = '42' WHERE seq = 1 AND "
     f"workflow_pk = (SELECT id FROM {WF} WHERE workflow_id = 'bad')",
     ["reliable_beat_workflow_events.error", "seq 1", "a JSON object"]),
    ("event digest garbage", f"UPDATE {EV} SET args_digest = 'garbage!' WHERE seq = 1 AND "
     f"workflow_pk = (SELECT id FROM {WF} WHERE workflow_id = 'bad')",
     ["reliable_beat_workflow_events.args_digest", "seq 1", "16 hex"]),
    ("event kind unknown", f"UPDATE {EV} SET kind = 'zzz' WHERE seq = 1 AND "
     f"workflow_pk = (SELECT id FROM {WF} WHERE workflow_id = 'bad')",
     ["reliable_beat_workflow_events.kind", "seq 1", "'zzz'"]),
    ("event state unknown", f"UPDATE {EV} SET state = 'zzz' WHERE seq = 1 AND "
     f"workflow_pk = (SELECT id FROM {WF} WHERE workflow_id = 'bad')",
     ["reliable_beat_workflow_events.state", "seq 1", "'zzz'"]),
]


@pytest.mark.parametrize(("what", "sql", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_corrupted_row_blocks_that_workflow_naming_the_column_and_the_fix(
    store: Store, what: str, sql: str, says: list[str]
) -> None:
    if store.dialect == "postgresql" and "not JSON" in what:
        pytest.skip("jsonb refuses text that is not JSON")
    app = make_app(store)
    bad = engine.start(store, "t.bad", "bad", [1])
    good = engine.start(store, "t.bad", "good", [5])
    driver = Driver(store, app)
    driver.run()
    assert bad.status()["state"] == good.status()["state"] == "waiting"
    with store.begin() as conn:
        conn.execute(sa.text(sql))
    signal(store, "bad", "go", None)
    signal(store, "good", "go", None)
    driver.run()
    assert driver.failures == [], driver.failures  # the advance itself did not crash
    assert engine.get_workflow(store, "good")["state"] == "completed"  # the others run on
    row = engine.get_workflow(store, "bad")  # `workflows show` reads a malformed row
    assert row["state"] == "blocked", (what, row)
    reason = row["block_reason"]
    assert reason.startswith("malformed row: "), reason
    assert "non-determinism" not in reason
    for text in says:
        assert text in reason, (text, reason)
    for fix in ("workflows show bad", "workflows resume bad", "workflows cancel bad "
                "--no-compensate"):
        assert fix in reason, (fix, reason)
    # the sweep, `workflows list` and `workflows show --events` still work
    engine.redispatch_workflows(store, older_than=timedelta(0))
    assert {w["workflow_id"] for w in engine.list_workflows(store)} == {"bad", "good"}
    engine.get_workflow(store, "bad", events=True)
    # a second advance finds it blocked and leaves it so
    assert engine.advance(store, "bad", owner="t") == "blocked"
