"""UNPUBLISHED SLOTS: due slots a beat committed and never published (it died between its
claim and its publish) while no beat or relay of a version that publishes them runs: status
says so and `--check` fails, on real PostgreSQL."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select, update

from reliable_beat import schedules as sch
from reliable_beat import unsent
from reliable_beat.beat import Beat
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, outbox, runs
from reliable_beat.entries import EntryDefinition

pytestmark = [pytest.mark.postgres]


def _cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def _seed(store: Store, name: str, due_in: float) -> None:
    with store.begin() as conn:
        now = store.now(conn)
        slot = (now + timedelta(seconds=due_in)).replace(microsecond=0)
        d = EntryDefinition(name=name, task="t", args=[], schedule=sch.IntervalSchedule(
            timedelta(hours=1), slot))
        values = d.row_values()
        values.update(next_fire_at=slot, created_at=now, updated_at=now, enabled=True,
                      paused=False)
        conn.execute(entries.insert().values(**values))


def _age_runs(store: Store, names: list[str], seconds: float) -> None:
    with store.begin() as conn:
        ago = store.now(conn) - timedelta(seconds=seconds)
        conn.execute(update(runs).where(runs.c.entry_name.in_(names))
                     .values(fire_at=ago, updated_at=ago))


def _problems(store: Store) -> list[str]:
    r = _cli(store, "status", "--json")
    assert r.exit_code == 0, r.output
    return [p for p in json.loads(r.output)["problems"] if "UNPUBLISHED SLOTS" in p]


def test_committed_never_published_slots_raise_unpublished_slots(pg_store: Store) -> None:
    """Fails on the old code: such runs waited forever and `status --check` exited 0."""
    store = pg_store
    _seed(store, "lost", due_in=-1)
    _seed(store, "fresh", due_in=-1)
    _seed(store, "ahead", due_in=2)  # claimed ahead: its trigger row is written at the claim
    result = Beat(store, owner="dead:1", claim_ahead=timedelta(seconds=10)).tick()  # then died
    assert len(result.triggers) == 3
    with store.engine.connect() as conn:
        keys = {r.entry_name: r.idempotency_key for r in conn.execute(select(runs))}
        assert len(conn.execute(select(outbox)).all()) == 1  # 'ahead' only
    assert _cli(store, "status", "--check").exit_code == 0  # just committed: a sweep's turn
    _age_runs(store, ["lost", "ahead"], seconds=120)
    _age_runs(store, ["fresh"], seconds=30)  # within the sweep delay + margin: not yet
    (problem,) = _problems(store)
    assert problem.startswith("UNPUBLISHED SLOTS: 1 due slots"), problem
    assert keys["lost"] in problem and "start a beat of this version" in problem.lower()
    assert "reliable-beat -A APP relay" in problem
    checked = _cli(store, "status", "--check")
    assert checked.exit_code == 1 and "UNPUBLISHED SLOTS" in checked.output
    # a beat (or relay with the app) of this version sweeps them: the alarm clears
    with store.begin() as conn:
        assert unsent.materialise_unsent(store, conn, now=store.now(conn),
                                         sweep_delay=timedelta(seconds=10),
                                         destination="celery", schedule_group=None,
                                         limit=10) == 2  # lost and fresh
    assert _problems(store) == []
