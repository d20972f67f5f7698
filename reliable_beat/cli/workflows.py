"""``reliable-beat workflows list|show|signal|resume|replay|purge|cancel|compensate``
(docs/cli.md,
docs/workflows.md).

``replay`` imports the current code (``-A APP``: the module that registers the workflows)
and runs it against stored histories, writing nothing; it exits 1 if any workflow's history
does not match the code: a deploy gate.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import click
from sqlalchemy import func, select

from reliable_beat.cli import CliContext, fail, pass_cli
from reliable_beat.cli.runs import _fmt, _table
from reliable_beat.db.tables import workflows as workflows_table
from reliable_beat.workflows import engine, saga
from reliable_beat.workflows.errors import (
    WorkflowConflict,
    WorkflowNotFound,
    WorkflowValueError,
)
from reliable_beat.workflows.retention import purge_workflows

__all__ = ["register"]

STATES = ["pending", "running", "waiting", "completed", "failed", "cancelled", "blocked"]


@click.group("workflows")
def workflows_group() -> None:
    """Durable workflows: list, show, signal, resume, replay, purge, cancel, compensate."""


@workflows_group.command("list")
@click.option("--state", default=None, type=click.Choice(STATES))
@click.option("--name", default=None, help="Only workflows of this registered name.")
@click.option("--limit", default=50, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_list(cli: CliContext, state: str | None, name: str | None, limit: int,
            as_json: bool) -> None:
    """Workflows, newest first: state, run, history length, fence token."""
    rows = engine.list_workflows(cli.store, state=state, name=name, limit=limit)
    if as_json:
        cli.echo_json(rows)
        return
    _table(rows, ["workflow_id", "name", "state", "run_no", "history_len", "fence_token",
                  "advances", "updated_at", "block_reason"])
    if len(rows) >= limit:
        click.echo(_more_line(cli, state, name, len(rows)))


def _more_line(cli: CliContext, state: str | None, name: str | None, shown: int) -> str:
    """The footer of a listing cut at ``--limit``: how many match in all, and the workflows
    that need a person (blocked) when they may be among those not shown."""
    stmt = select(workflows_table.c.state, func.count()).group_by(workflows_table.c.state)
    if name is not None:
        stmt = stmt.where(workflows_table.c.name == name)
    with cli.store.engine.connect() as conn:
        counts = {str(k): int(n) for k, n in conn.execute(stmt).all()}
    total = counts.get(state, 0) if state is not None else sum(counts.values())
    line = f"showing {shown:,} of {total:,} (newest first; --limit N for more)"
    blocked = counts.get("blocked", 0)
    if state is None and blocked:
        line += f"; {blocked:,} blocked: `workflows list --state blocked`"
    return line


@workflows_group.command("show")
@click.argument("workflow_id")
@click.option("--events", "with_events", is_flag=True, help="Also the history and signals.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_show(cli: CliContext, workflow_id: str, with_events: bool, as_json: bool) -> None:
    """One workflow (and with --events its history: seq, kind, name, state, result)."""
    try:
        row = engine.get_workflow(cli.store, workflow_id, events=with_events)
    except WorkflowNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    if as_json:
        cli.echo_json(row)
        return
    for key in ("workflow_id", "name", "version", "state", "run_no", "args", "kwargs", "result",
                "error", "entry_name", "slot_fire_at", "schedule_group",
                "block_reason", "queue", "fence_token", "leased_by", "lease_expires_at",
                "wake_seq", "claimed_wake_seq", "history_len", "advances", "takeovers",
                "created_at", "updated_at", "finished_at", "cancel_requested"):
        value = row.get(key)
        if key == "error" and value:
            value = f"{value.get('type')}: {value.get('message')}"
        click.echo(f"{key:17} {_fmt(value, key)}")
    if with_events:
        click.echo("")
        _table(row["events"], ["seq", "kind", "name", "state", "result", "error", "fire_at",
                               "run_key", "fence_token"])
        if row["signals"]:
            click.echo("")
            _table(row["signals"], ["id", "name", "payload", "dedup_key", "consumed_seq",
                                    "created_at"])


@workflows_group.command("signal")
@click.argument("workflow_id")
@click.argument("name")
@click.argument("payload", required=False)
@click.option("--key", default=None,
              help="Dedup key: a second signal with it to this workflow is a no-op.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_signal(cli: CliContext, workflow_id: str, name: str, payload: str | None,
              key: str | None, as_json: bool) -> None:
    """Send signal NAME with a JSON PAYLOAD (required, e.g. true or '{"ok": 1}') to
    WORKFLOW_ID."""
    if payload is None:
        # no default: a null payload reads as a timeout in wait_signal(..., timeout=...)
        fail(f"PAYLOAD is required: pass a JSON value, e.g. `reliable-beat workflows signal "
             f"{workflow_id} {name} true` (a null payload is indistinguishable from a "
             "timeout in the workflow's wait_signal)", 2, kind="usage")
    try:
        data = json.loads(payload, parse_constant=_refuse_constant)
    except ValueError as exc:
        fail(f"PAYLOAD is not JSON: {exc}", 2, kind="usage")
    if data is None:
        click.echo(f"warning: signal {name!r} with a null payload: a workflow waiting with a "
                   "timeout cannot tell it from the timeout; send a value such as true",
                   err=True)
    try:
        stored = engine.signal(cli.store, workflow_id, name, data, key=key)
    except WorkflowNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    except WorkflowConflict as exc:
        fail(str(exc), 1, kind="conflict")
    except WorkflowValueError as exc:  # a payload over the size limit
        fail(str(exc), 2, kind="usage")
    if as_json:
        cli.echo_json({"workflow_id": workflow_id, "name": name, "stored": stored})
    else:
        click.echo("signal stored" if stored
                   else f"signal with key {key!r} already stored for {workflow_id!r}")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (JSON has no NaN or infinity)")


@workflows_group.command("resume")
@click.argument("workflow_ids", nargs=-1, required=True, metavar="ID...")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_resume(cli: CliContext, workflow_ids: tuple[str, ...], as_json: bool) -> None:
    """Unblock blocked workflows after the code was fixed (waiting + a wake); also kick
    a waiting workflow that is overdue (a timer past due whose wake was lost: one wake).

    Each ID is resumed on its own; an unknown or unblocked one is reported and the others
    are still resumed (exit 1 if any was refused).
    """
    rows: list[dict[str, Any]] = []
    refused: list[dict[str, str]] = []
    for workflow_id in workflow_ids:
        try:
            rows.append(engine.resume(cli.store, workflow_id))
        except WorkflowNotFound as exc:
            refused.append({"workflow_id": workflow_id, "kind": "not_found", "error": str(exc)})
        except WorkflowConflict as exc:
            refused.append({"workflow_id": workflow_id, "kind": "conflict", "error": str(exc)})
    if len(workflow_ids) == 1 and refused:
        fail(refused[0]["error"], 1, kind=refused[0]["kind"])
    if as_json:
        cli.echo_json(rows[0] if len(workflow_ids) == 1 else
                      {"resumed": rows, "refused": refused})
    else:
        for row in rows:
            click.echo(f"{row['workflow_id']}: {row['state']}")
        for r in refused:
            click.echo(f"{r['workflow_id']}: NOT RESUMED: {r['error']}", err=True)
    if refused:
        raise SystemExit(1)


@workflows_group.command("replay")
@click.option("--state", "states", multiple=True, type=click.Choice(STATES),
              help="States to check (repeatable; default: pending, running, waiting, blocked).")
@click.option("--name", default=None, help="Only workflows of this registered name.")
@click.option("--limit", default=1000, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_replay(cli: CliContext, states: tuple[str, ...], name: str | None, limit: int,
              as_json: bool) -> None:
    """Replay stored histories against the current code; exit 1 on any mismatch.

    Needs -A APP (the code that registers the workflows). Writes nothing.
    """
    wanted = list(states) or ["pending", "running", "waiting", "blocked"]
    checked: list[dict[str, Any]] = []
    for state in wanted:
        for row in engine.list_workflows(cli.store, state=state, name=name, limit=limit):
            problem = engine.replay_check(cli.store, row["workflow_id"])
            checked.append({"workflow_id": row["workflow_id"], "name": row["name"],
                            "state": row["state"], "mismatch": problem})
    bad = [c for c in checked if c["mismatch"]]
    if as_json:
        cli.echo_json({"checked": len(checked), "mismatches": bad})
    else:
        for c in bad:
            click.echo(f"MISMATCH {c['workflow_id']} ({c['name']}, {c['state']}): "
                       f"{c['mismatch']}")
        click.echo(f"{len(checked)} workflows replayed, {len(bad)} mismatches")
    if bad:
        raise SystemExit(1)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> timedelta:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"`` or plain seconds -> timedelta.

    Raises:
        click.BadParameter: anything else, or a negative age (names the option and the fix).
    """
    raw = text.strip().lower()
    unit = raw[-1:] if raw[-1:] in _UNITS else "s"
    number = raw[:-1] if raw[-1:] in _UNITS else raw
    try:
        value = float(number)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not an age: a number with a unit s, m, h, d or w (e.g. 30d)",
            param_hint="--older-than") from None
    if value < 0:
        raise click.BadParameter(f"{text!r}: an age cannot be negative",
                                 param_hint="--older-than")
    return timedelta(seconds=value * _UNITS[unit])


@workflows_group.command("purge")
@click.option("--older-than", "older_than", required=True, metavar="AGE",
              help="Ended workflows finished, and continued runs written, longer ago than "
                   "this: 30d, 12h, 90m, 45s, 2w.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--batch-size", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Workflows (or old-run events) per transaction.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_purge(cli: CliContext, older_than: str, dry_run: bool, batch_size: int,
             as_json: bool) -> None:
    """Delete ended workflows (completed, failed, cancelled) and continued runs' histories
    older than --older-than, in batches. Never touches pending, running, waiting or blocked
    workflows, a current run's history, or an unconsumed signal. Relays and beats also do
    this on their own (reliable_beat_workflow_retention_seconds, default 30 days).
    """
    age = parse_age(older_than)
    with cli.store.connect() as conn:
        cutoff = cli.store.now(conn) - age
    started = time.monotonic()
    out = purge_workflows(cli.store, before=cutoff, batch_size=batch_size, dry_run=dry_run)
    data = {**out.as_dict(), "cutoff": cutoff.isoformat(), "dry_run": dry_run,
            "seconds": round(time.monotonic() - started, 3)}
    if as_json:
        cli.echo_json(data)
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb}: {out.workflows} ended workflows, {out.events} events, {out.signals} "
               f"consumed signals (older than {cutoff.isoformat()})")
@workflows_group.command("cancel")
@click.argument("workflow_id")
@click.option("--no-compensate", "terminate", is_flag=True,
              help="Terminate: cancelled at once, no code and no compensation runs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_cancel(cli: CliContext, workflow_id: str, terminate: bool, as_json: bool) -> None:
    """Cancel WORKFLOW_ID: cooperative (its sagas unwind, it ends cancelled) or, with
    --no-compensate, terminate. A workflow that already ended is left alone (exit 0)."""
    try:
        out = saga.cancel(cli.store, workflow_id, compensate=not terminate)
    except WorkflowNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    if as_json:
        cli.echo_json(out)
    else:
        click.echo(f"{workflow_id}: {out['message']}")


@workflows_group.command("compensate")
@click.argument("workflow_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@pass_cli
def wf_compensate(cli: CliContext, workflow_id: str, as_json: bool) -> None:
    """Run a blocked workflow's recorded, not yet completed compensations from data.

    Newest first, as activities run by the workers (no workflow code runs); a dead-lettered
    compensation is requeued first. The workflow then ends failed with its original error.
    """
    try:
        out = saga.compensate(cli.store, workflow_id)
    except WorkflowNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    except (WorkflowConflict, ValueError) as exc:
        fail(str(exc), 1, kind="conflict")
    if as_json:
        cli.echo_json(out)
        return
    names = ", ".join(f"{p['name']} (seq {p['seq']}, {p['state']})" for p in out["pending"])
    click.echo(f"{workflow_id}: {len(out['pending'])} compensations to run, newest first: "
               f"{names or 'none'}; requeued {len(out['requeued'])}; the workers run them, "
               "then it ends failed (`workflows show ID --events` to follow)")


def register(group: click.Group) -> None:
    """Add ``workflows`` to the ``reliable-beat`` group."""
    group.add_command(workflows_group)
