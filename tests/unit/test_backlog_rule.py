"""The re-dispatch sweep's backlog rule (:func:`reliable_beat.redispatch.backlogged`, pure);
against real brokers: tests/integration/test_redispatch_backlog.py."""

from __future__ import annotations

import pytest

from reliable_beat.redispatch import backlogged


@pytest.mark.parametrize(("candidates", "held", "queues"), [
    ([("q", 3, True)] * 3, {0, 1, 2}, ["q"]),  # deep enough, all young: held
    ([("q", 2, True)] * 3, set(), []),  # fewer ready than stuck: some are lost
    ([("q", None, True)] * 3, set(), []),  # unknown depth: today's behaviour
    ([("q", 9, True), ("q", 9, False)], set(), []),  # one past the cap: re-send the queue
    ([("a", 5, True), ("b", 0, True)], {0}, ["a"]),  # per queue
])
def test_backlogged_rule(candidates: list[tuple[str, int | None, bool]], held: set[int],
                         queues: list[str]) -> None:
    got, notes = backlogged(candidates)
    assert got == held
    assert [n.queue for n in notes] == queues
