"""``workflows show`` (text, ``--events``, ``--json``) never shows a credential that a
workflow's arguments or an activity's error carry as ``key=...`` / ``api_key``, and still
shows the idempotency keys (``run_key``) and the project's own words in full."""

from __future__ import annotations

import json

import sqlalchemy as sa
from click.testing import CliRunner, Result

from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import workflow_events, workflows
from reliable_beat.workflows import WorkflowContext, engine, workflow

SECRETS = ("WfKeyArg7c1e90", "WfApiArg2b8d44", "WfErrKey5a0c13", "WfErrApi9e7f21")


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def _flow(ctx: WorkflowContext, customer: str, *, key: str, api_key: str) -> None:
    ctx.activity("billing.charge", customer, key=key, api_key=api_key)


def test_workflows_show_masks_keys_in_arguments_and_errors(sqlite_store: Store) -> None:
    """Fails on the old code: ``key`` in the arguments and ``key=`` in an error were shown."""
    workflow(name="t.secrets.charge")(_flow)
    engine.start(sqlite_store, "t.secrets.charge", "wf-secrets-1", ["c-1"],
                 {"key": SECRETS[0], "api_key": SECRETS[1]})
    error = {"type": "PermanentError",
             "message": f"billing refused: key={SECRETS[2]} api_key={SECRETS[3]} "
                        "(idempotency key: wf:wf-secrets-1:1)"}
    with sqlite_store.begin() as conn:
        wf_id = conn.execute(sa.select(workflows.c.id).where(
            workflows.c.workflow_id == "wf-secrets-1")).scalar_one()
        conn.execute(workflows.update().where(workflows.c.id == wf_id).values(
            state="failed", error=error))
        conn.execute(workflow_events.insert().values(
            workflow_pk=wf_id, run_no=1, seq=1, kind="activity", name="billing.charge",
            args_digest="0" * 16, args={"args": ["c-1"], "kwargs": {"key": SECRETS[0]}},
            state="failed", error=error, run_key="wf:wf-secrets-1:1", fence_token=1,
            created_at=sa.func.now()))
    text = cli(sqlite_store, "workflows", "show", "wf-secrets-1", "--events")
    as_json = cli(sqlite_store, "workflows", "show", "wf-secrets-1", "--events", "--json")
    assert text.exit_code == 0 and as_json.exit_code == 0, text.output + as_json.output
    for output in (text.output, as_json.output):
        assert not [s for s in SECRETS if s in output], output
    assert "key=*** api_key=***" in text.output and "wf:wf-secrets-1:1" in text.output
    assert "(idempotency key: wf:wf-secrets-1:1)" in text.output
    shown = json.loads(as_json.output)
    assert shown["kwargs"] == {"key": "***", "api_key": "***"}
    assert shown["events"][0]["run_key"] == "wf:wf-secrets-1:1"
