"""The five questions of `entries describe`, answered from facts (pure, no I/O)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from reliable_beat.runtime import answer_questions, manual_key, task_kind

QUESTIONS = {"run_twice", "overlap", "machine_dies", "retry", "idempotent"}


def test_plain_task_is_at_least_once() -> None:
    a = answer_questions(kind="plain", overlap_policy="allow", period_seconds=60.0)
    assert set(a) == QUESTIONS
    assert a["run_twice"]["answer"] == "yes"
    assert a["overlap"]["answer"] == "yes"
    assert a["retry"]["answer"] == "no"
    assert a["idempotent"]["answer"] == "no"
    assert "at-least-once" in a["idempotent"]["why"]
    assert a["machine_dies"]["answer"] == "depends"


def test_idempotent_task_with_skip_policy() -> None:
    a = answer_questions(
        kind="idempotent", overlap_policy="skip", period_seconds=60.0, active_runs=1,
        lease_seconds=30.0,
    )
    assert a["run_twice"]["answer"] == "no"
    assert a["overlap"]["answer"] == "no"
    assert "1 now" in a["overlap"]["why"]
    assert a["retry"]["answer"] == "yes"
    assert a["idempotent"]["answer"] == "yes"
    assert a["machine_dies"]["answer"] == "finishes"
    assert "30 s" in a["machine_dies"]["why"]


def test_buffer_one_explains_the_buffer() -> None:
    a = answer_questions(kind="idempotent", overlap_policy="buffer_one", period_seconds=60.0)
    assert a["overlap"]["answer"] == "no"
    assert "buffered" in a["overlap"]["why"]


def test_plain_task_ignores_overlap_policy() -> None:
    a = answer_questions(kind="plain", overlap_policy="skip", period_seconds=60.0)
    assert a["overlap"]["answer"] == "yes"
    assert "treats it as 'allow'" in a["overlap"]["why"]


def test_unknown_task_kind_says_how_to_find_out() -> None:
    a = answer_questions(kind="unknown", overlap_policy="allow", period_seconds=60.0)
    assert a["run_twice"]["answer"] == "depends"
    assert a["idempotent"]["answer"] == "unknown"
    assert "-A APP" in a["idempotent"]["why"]


def test_run_duration_close_to_period_is_called_out() -> None:
    a = answer_questions(
        kind="plain", overlap_policy="allow", period_seconds=60.0, longest_run_seconds=55.0,
        finished_runs=12,
    )
    why = a["overlap"]["why"]
    assert "55.0 s" in why and "12 finished runs" in why and "92%" in why
    assert "will overlap" in why
    calm = answer_questions(
        kind="plain", overlap_policy="allow", period_seconds=60.0, longest_run_seconds=6.0,
        finished_runs=3,
    )
    assert "will overlap" not in calm["overlap"]["why"]


def test_one_off_cannot_overlap_itself() -> None:
    a = answer_questions(kind="plain", overlap_policy="allow", period_seconds=None)
    assert "One-off" in a["overlap"]["why"]


def test_task_kind_without_app_is_unknown() -> None:
    assert task_kind(None, "x") == "unknown"

    class FakeApp:
        tasks: dict[str, object] = {"a": object()}

    assert task_kind(FakeApp(), "missing") == "unknown"
    assert task_kind(FakeApp(), "a") == "plain"


def test_manual_key_keeps_microseconds_and_needs_aware_time() -> None:
    at = datetime(2026, 1, 10, 10, 5, 0, 123456, tzinfo=timezone.utc)
    assert manual_key("report", at) == "report@manual:2026-01-10T10:05:00.123456Z"
    with pytest.raises(ValueError):
        manual_key("report", datetime(2026, 1, 10))
