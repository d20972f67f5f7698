"""``reliable-beat status``: what an operator needs at 02:00, in one screen (or ``--json``).

What is collected and which alarms exist is the operations layer's
(:mod:`reliable_beat.ops.status`, whose docstring lists them, and
:mod:`reliable_beat.ops.checks`); this module renders them, gives ``--check`` its exit code
(1 when something needs a person) and keeps their names importable from here. All instants
are UTC on the store's clock; the store URL is shown with its password hidden.
"""

from __future__ import annotations

from typing import Any

import click

from reliable_beat.cli import CliContext, fail, jsonable, pass_cli
from reliable_beat.errors import StoreUnavailableError
from reliable_beat.ops import checks, reads
from reliable_beat.ops import status as ops_status
from reliable_beat.ops.checks import fmt_instant, shown_name
from reliable_beat.ops.reads import (
    expired_leases,
    malformed_entries,
    name_conflicts,
    outbox_backlog,
    undelivered_outbox,
    waiting_retries,
)
from reliable_beat.ops.status import (
    DEFAULT_DISABLED_WITHIN_MINUTES,
    DEFAULT_MARGIN_SECONDS,
    DEFAULT_OUTBOX_STUCK_MINUTES,
    DEFAULT_UNSERVED_SECONDS,
    collect_status,
    framework_name,
    queue_depth_probe,
    stalled_queue_depths,
)
from reliable_beat.rows import entry_checker, quarantine_counts

__all__ = [
    "DEFAULT_MARGIN_SECONDS",
    "collect_status",
    "entry_checker",
    "expired_leases",
    "framework_name",
    "jsonable",
    "malformed_entries",
    "name_conflicts",
    "outbox_backlog",
    "quarantine_counts",
    "register",
    "stalled_queue_depths",
    "status",
    "undelivered_outbox",
    "waiting_retries",
]

#: The text output of ``status`` lists at most this many entries (``--rows``), then a count.
DEFAULT_ENTRY_ROWS = 50

# names this module had before the operations layer, still importable from here
BEAT_ALIVE_SECONDS = ops_status.BEAT_ALIVE_SECONDS
DEFAULT_LEASE_EXPIRED_SECONDS = ops_status.DEFAULT_LEASE_EXPIRED_SECONDS
MAX_SHOWN = checks.MAX_SHOWN
MAX_DEPTH_ENTRIES = reads.MAX_DEPTH_ENTRIES
UNSTARTED_WINDOW_HOURS = reads.UNSTARTED_WINDOW_HOURS
_depth_note = checks.depth_note


def _depth_text(d: dict[str, Any]) -> str:
    """One queue of ``status``'s ``queues:`` line."""
    names = ", ".join(d["entries"][:5]) + (", ..." if len(d["entries"]) > 5 else "")
    if d["error"] is not None:
        return f"depth unknown ({d['error']}) for {names}"
    ready = "unknown" if d["ready"] is None else f"{d['ready']:,} ready"
    return f"{shown_name(d['queue'])}: {ready} (waiting triggers of {names})"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _bounded_entries(info: dict[str, Any], limit: int | None
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(shown, rest)``: at most ``limit`` entries (None: all), those needing attention
    (missed, never started, failing, dead, quarantined, malformed, recently disabled)
    first, each part in name order. Linear in the number of entries."""
    rows = info["entries"]
    if limit is None or len(rows) <= limit:
        return rows, []
    unstarted = info["unstarted"]
    recent = set(info["recently_disabled"])

    def urgent(e: dict[str, Any]) -> bool:
        return bool(e["missed"] or e["failing"] or e["dead"] or e["name"] in unstarted
                    or e["status"] in ("quarantined", "malformed") or e["name"] in recent)

    first = [e for e in rows if urgent(e)]
    ordered = first + [e for e in rows if not urgent(e)]
    return ordered[:limit], ordered[limit:]


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--check", is_flag=True,
              help="Exit 1 when something needs a person (missed slots, dead letters, "
                   "undelivered outbox rows, a group's rows no live relay or beat serves, "
                   "malformed entries, entry names owned by another group, blocked "
                   "workflows, workflow advances that keep expiring, workflows pending "
                   "too long).")
@click.option("--margin", type=click.FloatRange(min=0), default=DEFAULT_MARGIN_SECONDS,
              show_default=True,
              help="Seconds beyond an entry's misfire_grace before an overdue slot is 'missed'.")
@click.option("--disabled-within", type=click.FloatRange(min=0),
              default=DEFAULT_DISABLED_WITHIN_MINUTES, show_default=True,
              help="Minutes: config entries disabled by a sync this recently are an alarm.")
@click.option("--outbox-stuck", type=click.FloatRange(min=0),
              default=DEFAULT_OUTBOX_STUCK_MINUTES, show_default=True,
              help="Minutes: pending outbox rows due this long and claimed by no relay are an "
                   "alarm (per destination).")
@click.option("--unserved-after", type=click.FloatRange(min=0),
              default=DEFAULT_UNSERVED_SECONDS, show_default=True,
              help="Seconds: a schedule group's pending outbox rows due this long while no "
                   "live relay or beat of the group runs are an alarm.")
@click.option("--all", "show_all", is_flag=True,
              help="Include disabled entries, and list every entry in the text output (not "
                   f"only the first {DEFAULT_ENTRY_ROWS} and a summary).")
@click.option("--rows", "max_rows", type=click.IntRange(min=0), default=DEFAULT_ENTRY_ROWS,
              show_default=True,
              help="Text output: list at most this many entries (those needing attention "
                   "first), then a count of the rest by status. --all lifts the bound.")
@pass_cli
def status(cli: CliContext, as_json: bool, check: bool, margin: float, show_all: bool,
           disabled_within: float, outbox_stuck: float, unserved_after: float,
           max_rows: int) -> None:
    """Entries (next fire, last slot, state, lag, failing/dead), outbox backlog, alarms.

    The text output lists at most ``--rows`` entries, those needing attention first
    (missed, never started, failing, dead, quarantined, malformed, recently disabled), then
    a count of the others by status; ``--all`` lists every one. ``--json`` always carries
    every entry (and ``entry_counts``: entries per status)."""
    try:
        info = collect_status(cli.store, margin_seconds=margin,
                              disabled_within_minutes=disabled_within,
                              redispatch_seconds=cli.settings.redispatch_seconds,
                              outbox_stuck_minutes=outbox_stuck,
                              unserved_seconds=unserved_after,
                              framework=framework_name(cli.app),
                              retry_cap_seconds=cli.settings.retry_cap_seconds,
                              queue_depths=queue_depth_probe(cli.app),
                              workflow_pending_alarm_seconds=(
                                  cli.settings.workflow_pending_alarm_seconds),
                              workflow_max_takeovers=cli.settings.workflow_max_takeovers)
    except StoreUnavailableError as exc:
        fail(str(exc), 1, kind="store_unavailable")
    info["store_from"] = cli.settings.database_url_origin  # e.g. Django DATABASES['default']
    if not show_all:
        # Disabled config entries stay visible: a vanished entry is news.
        info["entries"] = [e for e in info["entries"]
                           if e["status"] != "disabled" or e["origin"] == "config"]
    if as_json:
        cli.echo_json(jsonable(info))
    else:
        click.echo(f"store {info['store']} (from {info['store_from']}; id "
                   f"{info['store_id'] or '-'})  now "
                   f"{fmt_instant(info['now'])} (store clock, UTC)")
        for problem in info["problems"]:
            click.secho(f"!! {problem}", fg="red", bold=True)
        for warning in info["warnings"]:
            click.secho(f"!  {warning}", fg="yellow")
        shown, rest = _bounded_entries(info, None if show_all else max_rows)
        header = ("ENTRY", "GROUP", "STATUS", "NEXT", "LAST SLOT", "STATE", "LAG", "FAILING",
                  "DEAD")
        table = [header] + [
            (e["name"] + (" (MISSED)" if e["missed"] else "")
             + ((" (UNSTARTED)" if e["name"] in info["unstarted_between"]
                 else " (STALLED)" if e["name"] in info["unstarted_stalled"]
                 else " (NEVER STARTED)") if e["name"] in info["unstarted"] else ""),
             e["schedule_group"] or "-",
             e["status"] + (f" {fmt_instant(e['disabled_at'])}" if e["disabled_at"] else ""),
             # a disabled entry never fires: no NEXT (its stored value is its last plan)
             "-" if e["status"] == "disabled" else fmt_instant(e["next_fire_at"]),
             fmt_instant(e["last_fire_at"]), e["last_state"] or "-",
             _secs(e["lag_seconds"]), str(e["failing"]), str(e["dead"]))
            for e in shown
        ]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        for line in table:
            click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
        counts = ", ".join(f"{n} {k}" for k, n in sorted(info["entry_counts"].items()))
        if rest:
            by_status: dict[str, int] = {}
            for e in rest:
                by_status[e["status"]] = by_status.get(e["status"], 0) + 1
            click.echo(f"... and {len(rest)} more entries ("
                       + ", ".join(f"{n} {k}" for k, n in sorted(by_status.items()))
                       + "): `reliable-beat status --all` lists every one, "
                       "`reliable-beat status --json` gives them all as data")
        click.echo(f"entries: {len(shown)} shown of {sum(info['entry_counts'].values())}"
                   f" ({counts or 'none'})")
        if info["outbox"]:
            click.echo("\noutbox:")
            for o in info["outbox"]:
                # every pending row is counted once: backlog (due, or waiting for its
                # retry), scheduled (not yet due), or claimed (in a relay's hands, or held
                # by a beat for its slot: claimed ahead)
                backlog, scheduled = o.get("backlog", 0), o.get("scheduled", 0)
                claimed = max(0, o["pending"] - backlog - scheduled)
                click.echo(f"  {o['destination']}: {o['pending']} pending = {backlog} backlog "
                           f"({o['due']} due, oldest "
                           f"{_secs(o['oldest_pending_age_seconds'])}) + {scheduled} scheduled "
                           f"(not yet due) + {claimed} claimed (being published, or held for "
                           f"their slot); {o['dead']} dead")
        else:
            click.echo("\noutbox: empty")
        handled = info["dead_letters_handled"]
        click.echo(f"dead letters: {info['dead_letters']}"
                   + (f" (+ {handled} handled by design, no alarm: `reliable-beat "
                      "dead-letters list --handled`)" if handled else ""))
        wf_counts = info["workflows"]["counts"]
        if wf_counts:
            click.echo("workflows: " + ", ".join(f"{n} {k}" for k, n in sorted(
                wf_counts.items())))
        if info["queue_depths"]:
            click.echo("queues: " + "; ".join(_depth_text(d) for d in info["queue_depths"]))
        for g in info["groups"]:
            published = (f" (publishing to {', '.join(g['beat_destinations'])})"
                         if g.get("beat_destinations") else "")
            click.echo(f"schedule group {g['group']}: {g['beats_alive']} live beats"
                       f"{published}, {g.get('relays_alive', 0)} live relays, "
                       f"{g['enabled_entries']} enabled config entries, config synced "
                       f"{fmt_instant(g['config_synced_at'])}, last beat seen "
                       f"{fmt_instant(g['last_seen_at'])}")
    if check and not info["ok"]:
        raise SystemExit(1)


def register(group: click.Group) -> None:
    """Add ``status`` to the ``reliable-beat`` group."""
    group.add_command(status)
