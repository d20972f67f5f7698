"""The testing kit: what users import in their own tests (``docs/testing.md``).

Five questions every scheduled job must answer, each turned into one assertion on *your*
task, run against a real store (SQLite by default, your PostgreSQL with a URL)::

    from reliable_beat import testing as rbt

    def test_payout_is_effectively_once(rb_store, rb_app):       # fixtures: the pytest plugin
        probe = "SELECT count(*) FROM payouts WHERE merchant = 'm1'"
        rbt.run_twice(pay, args=("m1",), key="payout:m1:2026-01", effects=probe)
        rbt.run_concurrently(pay, args=("m1",), key="payout:m1:2026-02", effects=probe, n=4)
        ...

* :func:`run_twice`: can it run twice? (replaying one work unit changes nothing)
* :func:`run_concurrently`: can it overlap? (n concurrent runs, one set of effects)
* :func:`die_mid_run`: what if the machine dies mid-run? (crash, recover, one set)
* :func:`fail_then_retry`: can it retry safely? (injected transient failure, one set)
* :func:`stale_runner`: is a stale runner fenced out? (fence moved: writes rolled back)

Each helper returns the :class:`Evidence` it saw and raises :class:`QuestionFailed` (an
``AssertionError``) whose message names the question. The scheduler clock
(:class:`SchedulerClock`) drives entries through a window on a simulated database clock.

The pytest plugin is opt-in: ``pytest -p reliable_beat.testing.pytest`` (or
``pytest_plugins = ["reliable_beat.testing.pytest"]`` in your ``conftest.py``).
"""

from __future__ import annotations

from reliable_beat.testing.clock import SchedulerClock, SimulatedClockStore, SlotSeen, Window
from reliable_beat.testing.kit import (
    Evidence,
    Probe,
    Question,
    QuestionFailed,
    SimulatedCrash,
    call,
    count_effects,
    die_mid_run,
    fail_then_retry,
    make_app,
    run_concurrently,
    run_twice,
    stale_runner,
    throwaway_store,
    use_store,
)

__all__ = [
    "Evidence",
    "Probe",
    "Question",
    "QuestionFailed",
    "SchedulerClock",
    "SimulatedClockStore",
    "SimulatedCrash",
    "SlotSeen",
    "Window",
    "call",
    "count_effects",
    "die_mid_run",
    "fail_then_retry",
    "make_app",
    "run_concurrently",
    "run_twice",
    "stale_runner",
    "throwaway_store",
    "use_store",
]
