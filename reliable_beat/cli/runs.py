"""``reliable-beat runs``, ``runs show KEY``, ``dead-letters list|show|requeue``, ``lease clear``.

Read commands print a table, or JSON with ``--json``. ``dead-letters requeue`` is a
person's decision (:mod:`reliable_beat.ops.requeue`): it asks for confirmation unless
``--yes``, records who requeued (``--by``, default ``$USER``), resets the run and sends the
task again under the **same** idempotency key through the app (``-A`` is required for it), or
sends a dropped message again, or puts a dead outbox row back to pending. ``lease clear`` fences a
stuck holder out and re-sends the run's trigger through the outbox
(:func:`reliable_beat.runs.release_lease`); exit 2 when it needs a confirmation no TTY can give.
"""

from __future__ import annotations

import getpass
import json
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import click

from reliable_beat import runs
from reliable_beat.cli import CliContext, fail, pass_cli
from reliable_beat.db.types import infinity_text
from reliable_beat.ops import requeue as ops_requeue
from reliable_beat.ops.actions import RequeueSendError
from reliable_beat.redaction import (
    IDENTIFIER_FIELDS,
    USER_DATA_FIELDS,
    redact_text,
    redact_value,
)

__all__ = ["register"]


def _parse_since(value: str) -> datetime:
    """``2026-01-10T12:00:00Z`` (ISO 8601 with offset) or a relative ``15m``/``2h``/``3d``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if value and value[-1] in units and value[:-1].replace(".", "", 1).isdigit():
        return datetime.now(timezone.utc) - timedelta(seconds=float(value[:-1]) * units[value[-1]])
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: expected ISO 8601 with offset or 15m/2h/3d") from exc
    if parsed.tzinfo is None:
        raise click.BadParameter(f"{value!r} has no time zone; add Z or +HH:MM")
    return parsed.astimezone(timezone.utc)


def _fmt(value: Any, column: str | None = None) -> str:
    """One cell of ``column``, redacted as :func:`reliable_beat.redaction.redact_value` does:
    an identifier (an idempotency key) as it is, a task's ``args`` / ``kwargs`` as an
    application's data (a bare ``key`` there names a credential)."""
    if infinity_text(value) is not None:  # PostgreSQL 'infinity' (a malformed row)
        return f"malformed: {infinity_text(value)}"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    if value is None:
        return "-"
    if isinstance(value, str) and column in IDENTIFIER_FIELDS:
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(redact_value(value, user_data=column in USER_DATA_FIELDS), default=str)
    return redact_text(value)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    cells = [[_fmt(r.get(c), c) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


@click.group("runs", invoke_without_command=True)
@click.option("--entry", default=None, help="Only runs of this entry.")
@click.option("--state", default=None,
              type=click.Choice(["scheduled", "dispatched", "running", "succeeded", "retrying",
                                 "dead", "skipped", "buffered"]))
@click.option("--since", default=None, help="Created at/after: ISO 8601 (UTC offset) or 15m/2h/3d.")
@click.option("--limit", default=50, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def runs_group(ctx: click.Context, entry: str | None, state: str | None, since: str | None,
               limit: int, as_json: bool) -> None:
    """List runs, newest first (one row per slot or ad-hoc key)."""
    if ctx.invoked_subcommand is not None:
        return
    cli = ctx.find_object(CliContext)
    assert cli is not None
    rows = runs.list_runs(cli.store, entry=entry, state=state,
                          since=_parse_since(since) if since else None, limit=limit)
    if as_json:
        cli.echo_json(rows)
        return
    _table(rows, ["idempotency_key", "state", "trigger", "attempts", "fence_token", "leased_by",
                  "lease_expires_at", "created_at", "finished_at"])


@runs_group.command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True)
@pass_cli
def runs_show(cli: CliContext, key: str, as_json: bool) -> None:
    """One run and its attempts (with fence tokens), by idempotency KEY."""
    try:
        run = runs.get_run(cli.store, key)
    except runs.RunNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    tries = runs.list_attempts(cli.store, run["id"])
    if as_json:
        cli.echo_json({"run": run, "attempts": tries})
        return
    for name in ("idempotency_key", "id", "entry_name", "fire_at", "trigger", "task", "state",
                 "fence_token", "leased_by", "lease_expires_at", "attempts", "result", "reason",
                 "created_at", "started_at", "finished_at"):
        click.echo(f"{name:17} {_fmt(run.get(name), name)}")
    if run.get("error"):
        click.echo("error:\n  " + redact_text(run["error"]).strip().replace("\n", "\n  "))
    click.echo("")
    _table(tries, ["attempt", "fence_token", "outcome", "worker", "task_id", "started_at",
                   "finished_at", "retry_in_seconds"])


@click.group("dead-letters")
def dead_letters_group() -> None:
    """Runs and outbox rows that failed for good; nothing here is deleted automatically."""


@dead_letters_group.command("list")
@click.option("--pending", is_flag=True, help="Only those not requeued yet.")
@click.option("--handled/--unhandled", default=None,
              help="Only failures the application handled by design (a saga's step whose "
                   "compensations completed: no alarm), or only the others (what `status "
                   "--check` counts). Default: both.")
@click.option("--limit", default=100, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_cli
def dl_list(cli: CliContext, pending: bool, handled: bool | None, limit: int,
            as_json: bool) -> None:
    """List dead letters, newest first."""
    rows = runs.list_dead_letters(cli.store, include_requeued=not pending, limit=limit,
                                  handled=handled)
    if as_json:
        cli.echo_json(rows)
        return
    _table(rows, ["id", "kind", "key", "task", "reason", "attempts", "created_at",
                  "requeued_at", "requeued_by", "handled_by"])


@dead_letters_group.command("show")
@click.argument("dead_letter_id", type=int)
@pass_cli
def dl_show(cli: CliContext, dead_letter_id: int) -> None:
    """One dead letter as JSON (payload, error, attempts)."""
    try:
        cli.echo_json(runs.get_dead_letter(cli.store, dead_letter_id))
    except runs.DeadLetterNotFound as exc:
        fail(str(exc), 1, kind="not_found")


def _a(kind: str) -> str:
    """``a run`` / ``an outbox``: the article for a dead letter's kind."""
    return ("an " if kind[:1] in "aeiou" else "a ") + kind


@dead_letters_group.command("requeue")
@click.argument("dead_letter_id", type=int)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Requeue even if it was requeued before.")
@click.option("--by", default=None, help="Who decided (default: the current user).")
@click.option("--queue", default=None,
              help="Send to this queue (default: the queue the task died on, else the app's).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
def dl_requeue(cli: CliContext, dead_letter_id: int, yes: bool, force: bool,
               by: str | None, queue: str | None, as_json: bool) -> None:
    """Run a dead run again under the SAME idempotency key (needs -A APP), send a dropped
    message again (needs -A APP), or deliver a dead outbox row again (same message id)."""
    try:
        plan = ops_requeue.plan_requeue(cli.store, dead_letter_id)
    except runs.DeadLetterNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    except ops_requeue.RequeueRefused as exc:
        raise click.ClickException(str(exc)) from exc
    problem = ops_requeue.app_problem(plan, cli.app)
    if problem is not None:
        if cli.app is None and plan.needs == ops_requeue.CELERY:
            raise click.UsageError(f"{problem}: pass -A APP")
        raise click.ClickException(problem)
    if not yes:
        click.confirm(plan.question, abort=True)
    who = by or getpass.getuser()
    try:
        done = ops_requeue.requeue(cli.store, plan, app=cli.app, by=who, force=force,
                                   queue=queue)
    except (ValueError, LookupError, RequeueSendError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        dl, payload = plan.dead_letter, plan.payload
        out: dict[str, Any] = {"outcome": "requeued", "dead_letter": dead_letter_id, "by": who}
        if plan.what == "outbox":
            out.update(message_id=dl["key"], destination=dl["destination"])
        elif plan.what == "message":
            out.update(task=payload.get("task"), task_id=payload.get("task_id"))
        else:
            out.update(task=payload.get("task") or payload.get("actor"), key=payload.get("key"))
        cli.echo_json(out)
        return
    click.echo(done)


@click.group("lease")
def lease_group() -> None:
    """Run leases."""


@lease_group.command("clear")
@click.argument("key")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed without a TTY).")
@click.option("--no-resend", "no_resend", is_flag=True,
              help="Only fence the holder out and free the lease; do not re-send the run's "
                   "trigger (the next delivery or the re-dispatch sweep runs it).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
def lease_clear(cli: CliContext, key: str, yes: bool, no_resend: bool, as_json: bool) -> None:
    """Free the lease on KEY, fencing its holder out, and re-send the run's task.

    The holder's commit will be rejected (StaleFenceToken; its writes roll back). A
    `running` run becomes `retrying` and its trigger is re-sent through the outbox (a relay
    or beat publishes it at once) unless --no-resend. Exit codes: 0 done; 1 no run has KEY
    (or the prompt was declined); 2 refused: confirmation needed and no TTY to ask on
    (pass --yes).
    """
    try:
        run = runs.get_run(cli.store, key)
    except runs.RunNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    if not yes:
        if not _interactive():
            fail(f"refused: clearing the lease on {key!r} needs confirmation and there is "
                 "no TTY to ask on: pass --yes", 2, kind="usage")
        held = (f"held by {run['leased_by']} until {_fmt(run['lease_expires_at'])}"
                if run.get("leased_by") else "held by nobody")
        click.confirm(f"Clear the lease on {key!r} (state {run['state']}, {held})? Its "
                      "current holder's work will be rolled back when it tries to commit"
                      + ("" if no_resend else ", and the run's task is sent again") + ".",
                      abort=True)
    try:
        done = runs.release_lease(cli.store, key, resend=not no_resend)
    except runs.RunNotFound as exc:  # removed since (runs purge)
        fail(str(exc), 1, kind="not_found")
    if as_json:
        cli.echo_json({"outcome": "cleared", **done.as_dict()})
        return
    click.echo(f"lease on {key!r} cleared; fence token is now {done.fence_token}")
    if done.holder:
        click.echo(f"  fenced out: {done.holder} (its commit will be rejected; "
                   f"{done.fenced_out_attempts} running attempt(s) closed fenced_out)")
    state = (f"{done.previous_state} -> {done.state}" if done.state != done.previous_state
             else done.state)
    click.echo(f"  run: {state}")
    click.echo(f"  message: {done.note}")


def _interactive() -> bool:
    """True when a person can answer a prompt (stdin is a terminal)."""
    try:
        return bool(sys.stdin.isatty())
    except (AttributeError, ValueError):  # closed or replaced stdin
        return False


def register(group: click.Group) -> None:
    """Add ``runs``, ``dead-letters`` and ``lease`` to the ``reliable-beat`` group."""
    group.add_command(runs_group)
    group.add_command(dead_letters_group)
    group.add_command(lease_group)


@dead_letters_group.command("dismiss")
@click.argument("dead_letter_id", type=int)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--by", default=None, help="Who decided (default: the current user).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_cli
def dl_dismiss(cli: CliContext, dead_letter_id: int, yes: bool, by: str | None,
               as_json: bool) -> None:
    """Decide not to replay a dead letter: it stays listed, marked handled by you, and no
    longer makes `status --check` fail."""
    try:
        dl = runs.get_dead_letter(cli.store, dead_letter_id)
    except runs.DeadLetterNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    if not yes:
        click.confirm(f"Dismiss {_a(dl['kind'])} dead letter {dead_letter_id} ({dl['key']!r}, "
                      f"died: {dl['reason']}) without replaying it?", abort=True)
    who = by or getpass.getuser()
    try:
        runs.dismiss_dead_letter(cli.store, dead_letter_id, by=who)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        cli.echo_json({"outcome": "dismissed", "dead_letter": dead_letter_id, "by": who})
        return
    click.echo(f"dismissed dead letter {dead_letter_id} (by {who})")
