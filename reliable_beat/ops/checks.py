"""The verdicts of ``reliable-beat status``: which findings need a person (``--check`` exits 1
on any problem), in words that name the cause and the fix.

Pure functions of the data :func:`reliable_beat.ops.status.collect_status` read (the dict
it returns, before ``workflows``, ``problems``, ``warnings`` and ``ok`` are added): no I/O.
The problems, in this order: MISSED SLOTS, QUARANTINED, MALFORMED ENTRY, NEXT FIRE
INCONSISTENT, NAME CONFLICT,
UNDELIVERED OUTBOX, UNSERVED OUTBOX, BROKER NOT TAKING TRIGGERS, UNPUBLISHED SLOTS, dead
letters, RECENTLY DISABLED, NO BEAT, MALFORMED RUN ROWS, NEVER STARTED, STALLED, RETRY
OVERDUE, LEASE EXPIRED,
UNSTARTED BETWEEN STARTED (the workflow alarms follow, from
:func:`reliable_beat.workflows.engine.workflow_health`).
Warnings (no exit code): no recorded start, beats on another config, UNREGISTERED TASKS.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from reliable_beat.db.types import infinity_text
from reliable_beat.ops.reads import UNPUBLISHED_SLOT_SECONDS, UNSTARTED_WINDOW_HOURS

__all__ = ["MAX_SHOWN", "depth_note", "fmt_instant", "problems_of", "shown_name", "warnings_of"]

#: MALFORMED ENTRY / NAME CONFLICT: at most this many names (with their problems) are shown.
MAX_SHOWN = 10


def problems_of(
    info: Mapping[str, Any], *, margin_seconds: float, outbox_stuck_minutes: float,
    unserved_seconds: float, disabled_within_minutes: float, redispatch_seconds: float,
    lease_expired_seconds: float, framework: str | None,
) -> list[str]:
    """The problems of the status data ``info`` (see :func:`reliable_beat.ops.status.collect_status`
    for the keys and for the thresholds, which the messages name), in the order above."""
    return [
        *_entry_problems(info, margin_seconds=margin_seconds),
        *_outbox_problems(info, outbox_stuck_minutes=outbox_stuck_minutes,
                          unserved_seconds=unserved_seconds),
        *_dead_letter_problems(info),
        *_schedule_problems(info, disabled_within_minutes=disabled_within_minutes),
        *_run_problems(info, redispatch_seconds=redispatch_seconds,
                       lease_expired_seconds=lease_expired_seconds, framework=framework),
    ]


def _entry_problems(info: Mapping[str, Any], *, margin_seconds: float) -> list[str]:
    """MISSED SLOTS, QUARANTINED, MALFORMED ENTRY, NEXT FIRE INCONSISTENT, NAME CONFLICT."""
    missed, quarantined = info["missed"], info["quarantined"]
    malformed, conflicts = info["malformed_entries"], info["name_conflicts"]
    problems: list[str] = []
    if missed:
        problems.append(
            f"MISSED SLOTS: {len(missed)} enabled entries are overdue by more than their "
            f"misfire_grace + {margin_seconds:.0f} s ({', '.join(missed[:10])}"
            f"{', ...' if len(missed) > 10 else ''}): no beat is claiming entries. Start "
            "`celery -A APP beat` (any number may run) or check the beats' logs."
        )
    if quarantined:
        problems.append(
            f"QUARANTINED: {len(quarantined)} malformed "
            f"{'entry is' if len(quarantined) == 1 else 'entries are'} disabled and "
            f"do{'es' if len(quarantined) == 1 else ''} not fire "
            f"({', '.join(q['name'] for q in quarantined[:10])}"
            f"{', ...' if len(quarantined) > 10 else ''}): see the reason with `reliable-beat "
            "entries show NAME`, then fix the row (`entries update`, the beat_schedule, or SQL "
            "and `entries resume NAME`)"
        )
    if malformed:
        problems.append(_malformed_problem(malformed))
    inconsistent = info.get("inconsistent_next_fire") or []
    for e in inconsistent[:MAX_SHOWN]:
        problems.append(
            f"NEXT FIRE INCONSISTENT: entry {e['name']!r} will not fire: {e['problem']}. "
            f"Fix: {e['fix']} (a beat quarantines it at its next check)")
    if len(inconsistent) > MAX_SHOWN:
        problems.append(f"NEXT FIRE INCONSISTENT: ... and {len(inconsistent) - MAX_SHOWN} more "
                        "(`reliable-beat status --json` lists every one under "
                        "inconsistent_next_fire)")
    for c in conflicts[:MAX_SHOWN]:
        problems.append(
            f"NAME CONFLICT: entry {c['entry']!r} of group {c['group']!r} (beat "
            f"{c['synced_by'] or '?'}) is owned by group {c['owner_group']!r}; rename it in "
            f"one app's beat_schedule (group {c['group']!r}'s beats never fire it: its sync "
            "leaves it to the group that owns it)" if c["owner_enabled"] else
            f"NAME CONFLICT: entry {c['entry']!r} of group {c['group']!r} (beat "
            f"{c['synced_by'] or '?'}) is a config entry of group {c['owner_group']!r}, "
            f"which disabled it: it does not fire for either. Restart a beat of group "
            f"{c['group']!r} or run `reliable-beat -A APP schedule sync` with its app: the "
            "sync adopts it"
        )
    if len(conflicts) > MAX_SHOWN:
        problems.append(f"NAME CONFLICT: ... and {len(conflicts) - MAX_SHOWN} more (`reliable-"
                        "beat status --json` lists every one under name_conflicts)")
    return problems


def _outbox_problems(info: Mapping[str, Any], *, outbox_stuck_minutes: float,
                     unserved_seconds: float) -> list[str]:
    """UNDELIVERED OUTBOX, UNSERVED OUTBOX, BROKER NOT TAKING TRIGGERS, UNPUBLISHED SLOTS."""
    undelivered, unserved = info["undelivered_outbox"], info["unserved_outbox"]
    unpublished = info["unpublished_triggers"]
    problems: list[str] = []
    for u in undelivered:
        problems.append(
            f"UNDELIVERED OUTBOX: {u['rows']} pending rows for destination "
            f"{u['destination']!r} have been due for more than {outbox_stuck_minutes:g} min "
            f"(since {fmt_instant(u['due_since'])}) and no relay claims them: no running "
            "relay has a "
            f"handler for {u['destination']!r} (a typo in `outbox.add(..., destination)`?), "
            "no relay runs, or an earlier row of their ordering key is stuck. Fix the name "
            "(`reliable-beat outbox status`) or start a relay with that handler."
        )
    for u in unserved:
        seen = fmt_instant(u["last_seen_at"]) if u["last_seen_at"] else "never"
        served = ", ".join(repr(g) if g != "*" else "any (a relay without an app)"
                           for g in u["served_groups"]) or "none"
        problems.append(
            f"UNSERVED OUTBOX: group {u['group']!r}: {u['rows']} outbox rows "
            f"({', '.join(u['destinations'])}) due for more than {unserved_seconds:g} s "
            f"(since {fmt_instant(u['due_since'])}) and no live relay or beat of group "
            f"{u['group']!r} (last seen {seen}); only that group's relays and beats publish "
            f"them (live ones serve groups: {served}). Start `reliable-beat -A <app> relay` "
            f"for it, with the app whose schedule group is {u['group']!r} (the name in "
            "Celery('...') or reliable_beat_schedule_group; an app module run as __main__ "
            "is group 'default')."
        )
    for u in unpublished:
        problems.append(
            f"BROKER NOT TAKING TRIGGERS: group {u['group']!r}: {u['rows']} triggers are "
            f"still pending more than {unserved_seconds:g} s after they were written (oldest "
            f"since {fmt_instant(u['since'])}) although {u['publishers']} beats / relays of "
            "the group "
            "are alive: the Celery broker of that app refuses or hangs (each publish times "
            "out after reliable_beat_publish_timeout_seconds). Their logs name it: `celery "
            "broker URL did not answer within N s` or `N triggers not published (celery "
            "broker unavailable: ...)`. Fix the broker; nothing is lost: the triggers go "
            "out, under the same task ids, once it takes them."
        )
    slots = info.get("unpublished_slots") or {}
    if slots.get("count"):
        problems.append(
            f"UNPUBLISHED SLOTS: {slots['count']} due slots were committed by a beat but never "
            f"published, for more than {UNPUBLISHED_SLOT_SECONDS:g} s (oldest "
            f"{slots['oldest_key']} at {fmt_instant(slots['oldest_fire_at'])}): the beat died "
            "between its claim and its publish, and no beat or relay of a version that "
            "publishes them runs. Start a beat of this version (or `reliable-beat -A APP "
            "relay`): its sweep publishes them, once each, under their idempotency keys "
            "(`reliable-beat runs --state scheduled` lists them)."
        )
    return problems


def _dead_letter_problems(info: Mapping[str, Any]) -> list[str]:
    """Dead letters waiting for a person (not those handled by design)."""
    dead_total = info["dead_letters"]
    problems: list[str] = []
    if dead_total:
        problems.append(
            f"{dead_total} dead letters wait for a person: `reliable-beat dead-letters list "
            "--pending --unhandled`"
        )
    return problems


def _schedule_problems(info: Mapping[str, Any], *, disabled_within_minutes: float) -> list[str]:
    """RECENTLY DISABLED, NO BEAT."""
    recent, groups = info["recently_disabled"], info["groups"]
    problems: list[str] = []
    if recent:
        problems.append(
            f"RECENTLY DISABLED: {len(recent)} config entries vanished from their group's "
            f"beat_schedule within the last {disabled_within_minutes:g} min and were disabled "
            f"({', '.join(recent[:10])}{', ...' if len(recent) > 10 else ''}). If that was not "
            "meant, deploy the config that has them (`reliable-beat status --all` shows them)."
        )
    for g in groups:
        if g["enabled_entries"] and not g["beats_alive"]:
            seen = fmt_instant(g["last_seen_at"]) if g["last_seen_at"] else "never"
            problems.append(
                f"NO BEAT: schedule group {g['group']!r} has {g['enabled_entries']} enabled "
                f"config entries but no live beat (last seen {seen}): nothing syncs its "
                "beat_schedule and nothing fires its entries (beats of other groups do not: "
                "they publish into their own app's broker). Start its beat, "
                f"or retire the group: `reliable-beat schedule retire {g['group']}`."
            )
        elif g.get("runtime_entries") and not g["beats_alive"]:
            seen = fmt_instant(g["last_seen_at"]) if g["last_seen_at"] else "never"
            problems.append(
                f"NO BEAT: schedule group {g['group']!r} has {g['runtime_entries']} enabled "
                f"runtime entries but no live beat (last seen {seen}): nothing fires them "
                "(beats of other groups do not: they publish into their own app's broker). "
                "Start a beat of the app, or move them to a group that has one: "
                "`reliable-beat entries update NAME --group GROUP`."
            )
    return problems


def _run_problems(info: Mapping[str, Any], *, redispatch_seconds: float,
                  lease_expired_seconds: float, framework: str | None) -> list[str]:
    """MALFORMED RUN ROWS, NEVER STARTED, STALLED, RETRY OVERDUE, LEASE EXPIRED, UNSTARTED
    BETWEEN STARTED."""
    n_bad_runs, bad_runs = (info["malformed_run_states"]["count"],
                            info["malformed_run_states"]["keys"])
    unstarted, between = info["unstarted"], set(info["unstarted_between"])
    stalled, last_started = info["unstarted_stalled"], info["last_started_at"]
    depths, now = info["queue_depths"], info["now"]
    n_waiting, waiting_runs = info["waiting_retries"]["count"], info["waiting_retries"]["runs"]
    n_expired, expired_runs = info["expired_leases"]["count"], info["expired_leases"]["runs"]
    problems: list[str] = []
    if n_bad_runs:
        problems.append(
            f"MALFORMED RUN ROWS: {n_bad_runs} runs have a state the library never writes "
            f"({', '.join(bad_runs)}{', ...' if n_bad_runs > len(bad_runs) else ''}): "
            "changed by SQL; nothing claims, sweeps or counts them. `reliable-beat runs show "
            "KEY` shows each: one with finished_at and a result completed (set state "
            "'succeeded' by SQL); otherwise check the task's effects, then set 'retrying' "
            "(it runs again, its key deduplicates) or 'dead'"
        )
    never = sorted(n for n in unstarted if n not in between and n not in last_started)
    if never:
        problems.append(
            f"NEVER STARTED: the triggers of {len(never)} entries were not started by any "
            f"worker within {redispatch_seconds:g} s, and no trigger of theirs ever started "
            f"({', '.join(never[:10])}{', ...' if len(never) > 10 else ''}): no worker "
            "registers the task (a typo? a removed task?) or none consumes its queue. "
            "`reliable-beat entries describe NAME` shows the task; "
            f"{_worker_advice(framework, registered=True)}.{depth_note(depths, never)}"
        )
    if stalled:
        waiting = sum(unstarted[n] for n in stalled)
        ran = ", ".join(f"{n} last ran {fmt_instant(last_started[n])}" for n in stalled[:10])
        problems.append(
            f"STALLED: {waiting} triggers of {len(stalled)} entries that ran before "
            f"({ran}{', ...' if len(stalled) > 10 else ''}) were not started by any worker "
            f"within {redispatch_seconds:g} s: are their workers down or behind (a backlog "
            "in their queue)? (Or the task was renamed or removed since it last ran.) "
            f"{_capital(_worker_advice(framework, registered=False))}; `reliable-beat runs "
            "--entry NAME "
            "--state dispatched` lists the waiting triggers (the re-dispatch sweep re-sends "
            "them; their idempotency keys deduplicate)."
            f"{depth_note(depths, stalled)}"
        )
    if n_waiting:
        shown = "; ".join(
            f"{w['key']}: " + (
                f"re-sent {w['resends']} times by the re-dispatch sweep, last at "
                f"{fmt_instant(w['retry_due_at'])}, and no worker took it up"
                if w["why"] == "resent" else
                f"retry due {fmt_instant(w['retry_due_at'])}"
                + ("" if w["retry_scheduled"] else " (no retry was scheduled: its attempt "
                   "was fenced out, e.g. `lease clear`)")
                + f", the re-dispatch sweep was due to re-send it at {fmt_instant(w['resend_at'])}"
                " and did not")
            for w in waiting_runs)
        problems.append(
            f"RETRY OVERDUE: {n_waiting} runs wait in `retrying` although their retry was due "
            f"more than {redispatch_seconds:g} s ago and re-sending did not move them on "
            f"({shown}{'; ...' if n_waiting > len(waiting_runs) else ''}). Re-sent and not "
            "taken up: are the workers of its queue down or behind, and does one register "
            "the task? Not re-sent: does a beat or relay of its app (schedule group) run, "
            "and is its queue backlogged? `reliable-beat runs show KEY` shows each."
        )
    if n_expired:
        problems.append(_lease_expired_problem(n_expired, expired_runs, lease_expired_seconds,
                                               now))
    gaps = sorted(between)
    if gaps:
        problems.append(
            f"UNSTARTED BETWEEN STARTED: {sum(unstarted[n] for n in gaps)} triggers of "
            f"{len(gaps)} entries ({', '.join(gaps[:10])}{', ...' if len(gaps) > 10 else ''}) "
            f"have no recorded start within {redispatch_seconds:g} s although later triggers "
            "of the same entries did start (their workers know the task): either they were "
            "lost (e.g. consumed by another app's worker as an unregistered task: check the "
            "entries' schedule groups), or a worker ran them but could not record the start "
            "(its log: WARNING 'could not record the start', e.g. the database was down "
            "then; it writes the start when the database answers again, unless it stopped "
            "first). `reliable-beat runs --entry NAME --state dispatched` lists them."
        )
    return problems


def warnings_of(info: Mapping[str, Any], *, starts_recorded: bool) -> list[str]:
    """The warnings of the status data ``info``: no worker recorded a start in the last
    :data:`~reliable_beat.ops.reads.UNSTARTED_WINDOW_HOURS` h (``starts_recorded`` False),
    live beats started with another beat_schedule, UNREGISTERED TASKS."""
    groups, unregistered = info["groups"], info["unregistered"]
    warnings: list[str] = []
    if not starts_recorded:
        warnings.append(
            "no worker has recorded starting a trigger in the last "
            f"{UNSTARTED_WINDOW_HOURS:g} h: either no worker runs, or workers run plain tasks "
            "without `reliable_beat.celery.acks` in their imports (then triggers that no "
            "worker knows cannot be told from done ones)"
        )
    for g in groups:
        if g["beats_on_other_config"]:
            warnings.append(
                f"schedule group {g['group']!r}: {g['beats_on_other_config']} of "
                f"{g['beats_alive']} live beats started with a beat_schedule other than the "
                "group's current one (old pods of a deploy in progress, or a config the beat "
                "refused: see its log; `reliable-beat schedule list`)"
            )
    if unregistered:
        warnings.append(
            f"UNREGISTERED TASKS: {len(unregistered)} config entries name a task their "
            "group's beat does not register: "
            + ", ".join(f"{k} -> {v}" for k, v in sorted(unregistered.items())[:10])
        )
    return warnings


def _malformed_fix(m: dict[str, Any]) -> str:
    """How to repair one MALFORMED ENTRY (a config entry: from its beat_schedule)."""
    name = m["name"]
    if m["origin"] == "config":
        return (f"a config entry: `reliable-beat -A APP schedule sync` (or a restart of a "
                f"beat of group {m['schedule_group'] or 'default'!r}) rewrites it from its "
                "beat_schedule")
    return f"`reliable-beat entries update {name} ...` with the right values"


def _malformed_problem(found: list[dict[str, Any]]) -> str:
    """The MALFORMED ENTRY line (bounded: the first :data:`MAX_SHOWN` entries)."""
    shown = "; ".join(
        f"{m['name']!r}: {', '.join(m['problems'][:3])}"
        f"{' ...' if len(m['problems']) > 3 else ''} (fix: {_malformed_fix(m)})"
        for m in found[:MAX_SHOWN])
    return (
        f"MALFORMED ENTRY: {len(found)} enabled entries have a stored row a beat cannot fire "
        f"({shown}{'; ...' if len(found) > MAX_SHOWN else ''}): a beat quarantines each when it "
        "comes due, and that slot is lost. Repair them before then (`reliable-beat entries "
        "show NAME` shows the row)."
    )


def _lease_expired_problem(count: int, shown: list[dict[str, Any]], grace_seconds: float,
                           now: datetime) -> str:
    """The LEASE EXPIRED line (bounded: the keys of the longest expired, then ``...``)."""
    keys = "; ".join(
        f"{r['key']} (held by {r['leased_by'] or '?'}, expired "
        f"{r['expired_seconds']:.0f} s ago, "
        + ("no trigger row: the sweep does not re-send it" if r["resend_at"] is None
           else f"the sweep re-sends it at about {fmt_instant(r['resend_at'])}"
           if r["resend_at"] > now
           else f"the sweep was due to re-send it at {fmt_instant(r['resend_at'])}: does any beat "
           "or relay of its group run?")
        + ")"
        for r in shown)
    return (
        f"LEASE EXPIRED: {count} running runs whose lease expired more than "
        f"{grace_seconds:g} s ago ({keys}{'; ...' if count > len(shown) else ''}): their "
        "workers stopped (killed or frozen) and no redelivery took them over. The re-dispatch "
        "sweep re-sends them at the times given, or run `reliable-beat lease clear KEY` to "
        "fence the holder out and re-send the run now (stop a frozen worker too)."
    )


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _worker_advice(framework: str | None, *, registered: bool) -> str:
    """Where to look at the workers, in the app's framework's terms."""
    if framework == "celery":
        return ("`celery -A APP inspect registered` shows what workers know" if registered
                else "`celery -A APP inspect active_queues` shows which workers consume "
                "which queues, `celery -A APP inspect active` what they run now")
    if framework == "dramatiq":
        return ("check that a `dramatiq` worker process runs with the module that declares "
                "the actor, on the actor's queue" if registered
                else "check that the `dramatiq` worker processes run and consume the actor's "
                "queue (its depth in the broker tells behind from down)")
    return ("check that a worker of the app runs with the module that declares the task"
            if registered else "check that the app's workers run and consume the task's "
            "queue (its depth in the broker tells behind from down)")


def depth_note(depths: list[dict[str, Any]], names: list[str]) -> str:
    """`` Queue Q holds N ready messages (...)`` for the queues of ``names``, or ''."""
    wanted = set(names)
    notes = []
    for d in depths:
        if not wanted.intersection(d["entries"]):
            continue
        if d["error"] is not None:
            notes.append(f"the broker could not tell its queue depths ({d['error']})")
        elif d["ready"] is None:
            notes.append(f"the broker cannot tell how deep queue {shown_name(d['queue'])} is")
        elif d["ready"] > 0:
            notes.append(f"queue {shown_name(d['queue'])} holds {d['ready']:,} ready messages (a "
                         "backlog: its workers are behind or stopped)")
        else:
            notes.append(f"queue {shown_name(d['queue'])} holds 0 ready messages (not a backlog: a "
                         "worker holds them unacknowledged, or the broker lost them)")
    return (" " + _capital("; ".join(notes)) + ".") if notes else ""


def shown_name(name: Any) -> str:
    """A queue (or other) name as printed in a sentence: as is, or quoted with ``repr``
    when whitespace or an unprintable character could mislead (``' celery'``)."""
    text = str(name)
    if text and text == text.strip() and text.isprintable() and " " not in text:
        return text
    return repr(name)


def fmt_instant(at: datetime | None) -> str:
    """An instant as ``status`` prints it: ``2026-05-01T02:00:00Z`` (UTC, whole seconds),
    ``-`` for None, a PostgreSQL ``infinity`` (a malformed row) as stored."""
    if infinity_text(at) is not None:  # PostgreSQL 'infinity' (a malformed row)
        return str(infinity_text(at))
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if at else "-"
