"""The beat's claim stays index-driven: ``EXPLAIN`` of the real claim statement uses the
partial index ``ix_reliable_beat_entries_due`` (benchmarks/scale.py found it had become a
sequential scan when the predicate was spelled ``enabled IS TRUE AND paused IS FALSE``)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat.beat import Beat
from reliable_beat.db.dialects import Store

pytestmark = pytest.mark.postgres

SPEC = json.dumps({"kind": "interval", "every_seconds": 60, "anchor": "2000-01-01T00:00:00Z",
                   "timezone": "UTC"})


def _seed(store: Store, n: int) -> None:
    with store.begin() as conn:
        conn.execute(sa.text(
            """
            INSERT INTO reliable_beat_entries
              (name, task, args, kwargs, options, schedule_kind, schedule, enabled, paused,
               origin, next_fire_at, created_at, updated_at)
            SELECT 'e-' || g, 't', '[]', '{}', '{}', 'interval', CAST(:spec AS jsonb), true,
                   false, 'runtime', now() + interval '1 day' + g * interval '1 second',
                   now(), now()
            FROM generate_series(1, :n) AS g
            """), {"spec": SPEC, "n": n})
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE reliable_beat_entries"))


@pytest.mark.parametrize("group", [None, "proj"], ids=["any_group", "own_group"])
@pytest.mark.parametrize("ahead", [0.0, 0.5], ids=["claim_when_due", "claim_ahead"])
def test_claim_and_next_fire_at_use_the_partial_index(
    pg_store: Store, ahead: float, group: str | None
) -> None:
    _seed(pg_store, 20_000)
    statements: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, context: Any,
                executemany: bool) -> None:
        if "reliable_beat_entries" in statement and statement.lstrip().startswith("SELECT"):
            statements.append((statement, params))

    sa.event.listen(pg_store.engine, "before_cursor_execute", capture)
    try:
        result = Beat(pg_store, owner="t", claim_ahead=timedelta(seconds=ahead),
                      schedule_group=group).tick()
    finally:
        sa.event.remove(pg_store.engine, "before_cursor_execute", capture)
    assert result.claimed == 0
    claim = [s for s in statements if "SKIP LOCKED" in s[0]]
    earliest = [s for s in statements if "min(" in s[0].lower()]
    assert claim and earliest
    assert len(earliest) == (2 if ahead else 1)  # + the earliest `allow` entry in the window
    with pg_store.engine.connect() as conn:
        for statement, params in (claim[0], *earliest):
            plan = "\n".join(conn.exec_driver_sql("EXPLAIN " + statement, params).scalars())
            assert "ix_reliable_beat_entries_due" in plan, plan
            assert "Seq Scan on reliable_beat_entries" not in plan, plan
