"""Entry definitions from beat_schedule: per-entry policies, DST overrides, validation."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab

from reliable_beat.entries import definition_from_celery, definitions_from_beat_schedule
from reliable_beat.errors import EntryValidationError
from reliable_beat.settings import Settings

NOW = datetime(2026, 3, 1, tzinfo=timezone.utc)
UTC = timezone.utc


def _define(raw: dict[str, object], name: str = "e") -> object:
    return definition_from_celery(name, raw, default_timezone="UTC", settings=Settings(),
                                  now=NOW)


def _day(definition: object, y: int, m: int, d: int) -> list[datetime]:
    start = datetime(y, m, d, tzinfo=UTC) - timedelta(hours=2)
    return list(definition.schedule.slots_between(start, start + timedelta(days=1)))  # type: ignore[attr-defined]


def test_per_entry_dst_overrides_change_the_gap_slot() -> None:
    base = {"task": "t", "schedule": "30 2 * * *"}
    berlin = {"timezone": "Europe/Berlin"}
    default = _define({**base, "options": {"reliable_beat": berlin}})
    skip = _define({**base, "options": {"reliable_beat": {**berlin, "dst_nonexistent": "skip"}}})
    gap_end = _define({**base, "reliable_beat": {**berlin, "dst_nonexistent": "gap_end"}})
    # 2026-03-29 02:30 does not exist in Berlin (02:00 CET -> 03:00 CEST).
    assert _day(default, 2026, 3, 29) == [datetime(2026, 3, 29, 1, 30, tzinfo=UTC)]
    assert _day(skip, 2026, 3, 29) == []
    assert _day(gap_end, 2026, 3, 29) == [datetime(2026, 3, 29, 1, 0, tzinfo=UTC)]


def test_repeated_hour_override_both() -> None:
    raw = {"task": "t", "schedule": "30 2 * * *",
           "options": {"reliable_beat": {"timezone": "Europe/Berlin", "dst_repeated": "both"}}}
    # 2026-10-25 02:30 happens twice in Berlin: 00:30Z (CEST) and 01:30Z (CET).
    assert _day(_define(raw), 2026, 10, 25) == [
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC), datetime(2026, 10, 25, 1, 30, tzinfo=UTC)
    ]


def test_policies_and_publish_options_are_read() -> None:
    d = _define({
        "task": "t", "schedule": crontab(minute=0, hour=2),
        "options": {"queue": "q", "expires": timedelta(minutes=5),
                    "reliable_beat": {"misfire_policy": "catch_up", "catch_up_limit": 3,
                                      "misfire_grace": 10, "overlap_policy": "skip"}},
    })
    assert d.misfire_policy == "catch_up" and d.catch_up_limit == 3  # type: ignore[attr-defined]
    assert d.misfire_grace == timedelta(seconds=10)  # type: ignore[attr-defined]
    assert d.options == {"queue": "q", "expires": 300.0}  # type: ignore[attr-defined]


def test_a_catch_up_limit_above_the_bound_is_refused_not_lowered() -> None:
    """Old code accepted catch_up_limit=50000 and fired at most 10000 of the missed slots,
    recording the rest as skipped: a quiet change of what the entry asks for."""
    with pytest.raises(EntryValidationError) as info:
        _define({"task": "t", "schedule": 60,
                 "options": {"reliable_beat": {"misfire_policy": "catch_up",
                                               "catch_up_limit": 50_000}}})
    text = str(info.value)
    assert "catch_up_limit=50000" in text and "at most 10000" in text
    assert "catch_up_window" in text  # the fix is named
    ok = _define({"task": "t", "schedule": 60,
                  "options": {"reliable_beat": {"catch_up_limit": 10_000}}})
    assert ok.catch_up_limit == 10_000  # type: ignore[attr-defined]


def test_every_problem_of_every_entry_is_listed() -> None:
    with pytest.raises(EntryValidationError) as info:
        definitions_from_beat_schedule(
            {
                "bad-cron": {"task": "t", "schedule": "61 * * * *"},
                "seconds-first": {"task": "t", "schedule": "*/15 * * * * *"},
                "bad-zone": {"task": "t", "schedule": 60,
                             "options": {"reliable_beat": {"timezone": "Mars/Olympus"}}},
                "bad-args": {"task": "t", "schedule": 60, "args": [object()]},
                "typo": {"task": "t", "schedule": 60,
                         "options": {"reliable_beat": {"misfire_polcy": "skip"}}},
                "ok": {"task": "t", "schedule": 60},
            },
            default_timezone="UTC", settings=Settings(), now=NOW,
        )
    text = str(info.value)
    for name in ("bad-cron", "seconds-first", "bad-zone", "bad-args", "typo"):
        assert f"entry {name!r}" in text, text
    assert "'ok'" not in text
    assert "Mars/Olympus" in text and "misfire_polcy" in text
    assert len(info.value.problems) == 5


def test_overlap_policy_needs_an_idempotent_task() -> None:
    with pytest.raises(EntryValidationError, match="IdempotentTask"):
        definition_from_celery(
            "e", {"task": "plain", "schedule": 60,
                  "options": {"reliable_beat": {"overlap_policy": "skip"}}},
            default_timezone="UTC", settings=Settings(), now=NOW,
            is_idempotent=lambda _task: False,
        )


def test_docs_scheduled_workflow_example_passes_the_beats_validation() -> None:
    """The ``beat_schedule`` of docs/workflows.md "Scheduled workflows" is accepted as
    written (an unknown publish option such as ``overlap_policy`` directly under
    ``options`` makes both beats refuse the configuration and exit)."""
    import re
    import types
    from pathlib import Path

    from reliable_beat.policies import OverlapPolicy

    text = (Path(__file__).parents[2] / "docs" / "workflows.md").read_text()
    section = text.split("## Scheduled workflows", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    app = types.SimpleNamespace(conf=types.SimpleNamespace())
    exec(code.group(1), {"app": app, "crontab": crontab})
    [entry] = definitions_from_beat_schedule(
        app.conf.beat_schedule, default_timezone="UTC", settings=Settings(), now=NOW)
    assert entry.name == "nightly-report"
    assert entry.overlap_policy == OverlapPolicy("skip")


def test_a_crontab_anding_both_day_fields_is_shown_with_its_meaning() -> None:
    """Fails on the old code: `entries list` showed `cron '0 22 1-7 * 6' UTC`, which pasted
    into --cron means the 1st-7th OR any Saturday; the entry fires on the first Saturday."""
    from reliable_beat.ops.entries import schedule_text

    now = datetime(2026, 5, 1, tzinfo=timezone.utc)

    def shown(schedule: object) -> str:
        d = definition_from_celery("e", {"task": "t", "schedule": schedule},
                                   default_timezone="UTC", settings=Settings(), now=now)
        return schedule_text(d.schedule.to_spec())

    assert shown(crontab(minute=0, hour=22, day_of_month="1-7", day_of_week="sat")) == (
        "cron '0 22 1-7 * 6' with day-of-month AND day-of-week (Celery crontab) UTC")
    assert shown("0 22 1-7 * 6") == "cron '0 22 1-7 * 6' UTC"  # a cron string: POSIX OR
    assert shown(crontab(minute=0, hour=22, day_of_week="sat")) == "cron '0 22 * * 6' UTC"
