"""``reliable-beat workflows signal ID NAME PAYLOAD``: PAYLOAD is required. A signal sent
without one used to carry JSON null, which a workflow waiting with a timeout cannot tell
from the timeout (an operator's approval read as "no approval")."""

from __future__ import annotations

import json

from click.testing import CliRunner, Result

from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.workflows import engine


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def test_a_signal_without_payload_is_refused_naming_the_fix(sqlite_store: Store) -> None:
    engine.start(sqlite_store, "t.approval", "appr-1", [])
    r = cli(sqlite_store, "workflows", "signal", "appr-1", "approve")
    assert r.exit_code == 2, r.output
    assert "PAYLOAD is required" in r.output
    assert "reliable-beat workflows signal appr-1 approve true" in r.output
    assert engine.get_workflow(sqlite_store, "appr-1", events=True)["signals"] == []

    ok = cli(sqlite_store, "workflows", "signal", "appr-1", "approve", "true")
    assert ok.exit_code == 0, ok.output
    [stored] = engine.get_workflow(sqlite_store, "appr-1", events=True)["signals"]
    assert stored["name"] == "approve" and stored["payload"] is True


def test_an_explicit_null_payload_is_stored_with_a_warning(sqlite_store: Store) -> None:
    engine.start(sqlite_store, "t.approval", "appr-2", [])
    r = CliRunner().invoke(
        reliable_beat, ["--database-url", sqlite_store.url, "workflows", "signal", "appr-2",
                        "approve", "null", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["stored"] is True
    assert "null payload" in r.stderr and "timeout" in r.stderr


def test_a_nan_or_infinite_payload_is_a_usage_error(sqlite_store: Store) -> None:
    engine.start(sqlite_store, "t.approval", "appr-3", [])
    for bad in ("NaN", "Infinity", '{"x": -Infinity}'):
        r = CliRunner().invoke(reliable_beat, ["--database-url", sqlite_store.url, "workflows",
                                               "signal", "appr-3", "approve", bad])
        assert r.exit_code == 2 and "not a JSON value" in r.output, (bad, r.output)
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert engine.get_workflow(sqlite_store, "appr-3", events=True)["signals"] == []
