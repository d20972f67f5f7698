"""CLI output conventions: ``--version``; ``--json`` on every command that prints data; errors
as one JSON object on stderr with a non-zero exit when ``--json`` is given; one date format
(ISO 8601 ``Z``) in all JSON; one error prefix (``error:``)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from click.testing import CliRunner, Result

from reliable_beat import __version__
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store

ISO_Z = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")
DATE_LIKE = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def dates(value: Any) -> list[str]:
    """Every string in ``value`` that looks like a date."""
    if isinstance(value, str):
        return [value] if DATE_LIKE.match(value) else []
    if isinstance(value, dict):
        return [d for v in value.values() for d in dates(v)]
    if isinstance(value, list):
        return [d for v in value for d in dates(v)]
    return []


def test_version() -> None:
    r = CliRunner().invoke(reliable_beat, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"reliable-beat {__version__}"


@pytest.fixture
def fired(store: Store) -> Store:
    """An entry with one fired slot (a run row, instants in every table)."""
    from datetime import timedelta

    from sqlalchemy import update

    from reliable_beat.beat import Beat
    from reliable_beat.db.tables import entries

    assert cli(store, "entries", "add", "e", "--task", "t", "--cron", "0 0 1 1 *").exit_code == 0
    with store.begin() as conn:
        slot = (store.now(conn) - timedelta(seconds=2)).replace(microsecond=0)
        conn.execute(update(entries).where(entries.c.name == "e").values(next_fire_at=slot))
    Beat(store, owner="test").tick()
    return store


@pytest.mark.parametrize("argv", [
    ["db", "current"], ["db", "check"], ["entries", "list"], ["entries", "show", "e"],
    ["entries", "describe", "e"], ["entries", "pause", "e"], ["entries", "resume", "e"],
    ["entries", "trigger", "e"], ["entries", "update", "e", "--cron", "0 0 2 1 *"],
    ["entries", "add", "f", "--task", "t", "--every", "60"],
    ["runs"], ["status"], ["outbox", "status"], ["dead-letters", "list"],
    ["schedule", "list"],
])
def test_every_data_command_prints_json_with_iso_z_dates(fired: Store, argv: list[str]) -> None:
    r = cli(fired, *argv, "--json")
    assert r.exit_code == 0, r.output
    value = json.loads(r.stdout)
    bad = [d for d in dates(value) if not ISO_Z.match(d)]
    assert bad == [], f"{argv}: dates not ISO 8601 Z: {bad[:5]}"
    if argv in (["runs"], ["entries", "list"], ["entries", "show", "e"], ["status"]):
        assert dates(value), f"{argv}: expected instants in {value!r}"[:400]


@pytest.mark.parametrize(("argv", "code", "kind"), [
    (["entries", "show", "nope"], 1, "not_found"),
    (["runs", "show", "nope@2026-01-01T00:00:00Z"], 1, "not_found"),
    (["entries", "add", "x", "--task", "t", "--cron", "not a cron"], 2, "invalid"),
    (["entries", "list", "--bogus-option"], 2, "usage"),
])
def test_errors_are_a_json_object_on_stderr(
    store: Store, argv: list[str], code: int, kind: str
) -> None:
    r = cli(store, *argv, "--json")
    assert r.exit_code == code
    assert r.stdout == ""
    err = json.loads(r.stderr)["error"]
    assert err["kind"] == kind and err["exit_code"] == code and err["message"]
    if kind == "invalid":
        assert any("'x'" in p for p in err["problems"])


@pytest.mark.parametrize("argv", [
    ["entries", "show", "nope"],
    ["runs", "show", "nope@2026-01-01T00:00:00Z"],
    ["entries", "list", "--bogus-option"],
])
def test_one_error_prefix(store: Store, argv: list[str]) -> None:
    r = cli(store, *argv)
    assert r.exit_code != 0
    lines = [ln for ln in r.stderr.splitlines() if "rror" in ln]
    assert lines and all(ln.startswith("error: ") for ln in lines), r.stderr
