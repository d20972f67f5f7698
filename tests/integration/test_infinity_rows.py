"""PostgreSQL ``'infinity'`` / ``'-infinity'`` timestamps, and connections the server refuses.

Before: ``UPDATE reliable_beat_entries SET next_fire_at = 'infinity'`` (or a run's
``created_at``, an outbox row's ``available_at``) made ``status``, ``entries list`` and
``runs`` exit 1 with ``timestamp too large (after year 10K): 'infinity'`` naming no row (the
driver failed the whole result); the entry never fired and was never quarantined. Now the
store's connections (psycopg 3 and psycopg2) read such values as sentinels, the rows layer
flags them as malformed (the entry is quarantined, naming the column and the fix; an outbox
row is dead-lettered) and the others go on.

Before: a role or database that does not exist was reported as "the reliable_beat schema is
missing ... run reliable-beat db upgrade" (kind ``schema_missing``): now it is
``store_unavailable`` naming what the server refused.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from reliable_beat import outbox as ob
from reliable_beat import schedules as sch
from reliable_beat.beat import Beat
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.db.tables import dead_letters, entries, outbox, runs
from reliable_beat.entries import EntryDefinition
from reliable_beat.relay import Relay

UTC = timezone.utc
#: what 'infinity' / '-infinity' read as (reliable_beat.db.types.INFINITY / NEG_INFINITY)
INFINITY = datetime.max.replace(tzinfo=UTC)
NEG_INFINITY = datetime.min.replace(tzinfo=UTC)

#: entry name -> (column, value written with SQL)
BAD: dict[str, tuple[str, str]] = {
    "next_inf": ("next_fire_at", "infinity"),
    "next_neginf": ("next_fire_at", "-infinity"),
    "next_far": ("next_fire_at", "12345-01-01 00:00:00+00"),
    "last_inf": ("last_fire_at", "infinity"),
    "last_neginf": ("last_fire_at", "-infinity"),
}


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def _now(store: Store) -> datetime:
    with store.begin() as conn:
        return store.now(conn)


def _seed(store: Store, name: str, now: datetime) -> None:
    d = EntryDefinition(name=name, task="beatapp.tick", args=[name],
                        schedule=sch.IntervalSchedule(timedelta(seconds=60),
                                                      now - timedelta(seconds=30)))
    values = d.row_values()
    values.update(next_fire_at=now - timedelta(seconds=1), created_at=now, updated_at=now,
                  enabled=True, paused=False)
    with store.begin() as conn:
        conn.execute(entries.insert().values(**values))


def _poison(store: Store) -> None:
    now = _now(store)
    for name in ["good1", *BAD, "good2"]:
        _seed(store, name, now)
    with store.begin() as conn:
        for name, (column, value) in BAD.items():
            conn.execute(text(f"UPDATE reliable_beat_entries SET {column} = :v WHERE name = :n"),
                         {"v": value, "n": name})


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_infinity_reads_as_a_sentinel_on_both_drivers(pg_url: str, driver: str) -> None:
    url = make_url(pg_url).set(drivername=f"postgresql+{driver}").render_as_string(False)
    store = Store.from_url(url)
    try:
        with store.connect() as conn:
            row = conn.execute(text(
                "SELECT 'infinity'::timestamptz, '-infinity'::timestamptz, "
                "'12345-06-01 00:00:00+00'::timestamptz, '0044-03-15 00:00:00+00 BC'::timestamptz"
            )).one()
            assert tuple(row) == (INFINITY, NEG_INFINITY, INFINITY, NEG_INFINITY)
            with pytest.raises(Exception, match="invalid input syntax"):  # garbage still fails
                conn.execute(text("SELECT 'garbage'::timestamptz"))
    finally:
        store.dispose()


def test_cli_reads_infinity_rows_and_names_them(pg_store: Store) -> None:
    store = pg_store
    _poison(store)
    now = _now(store)
    with store.begin() as conn:
        conn.execute(runs.insert().values(
            idempotency_key="good1@slot", entry_name="good1", fire_at=now, trigger="schedule",
            task="beatapp.tick", args=[], kwargs={}, state="succeeded", created_at=now,
            updated_at=now))
        conn.execute(text("UPDATE reliable_beat_runs SET created_at = 'infinity'"))

    info = collect_status(store)
    status = {e["name"]: e["status"] for e in info["entries"]}
    assert {n: status[n] for n in BAD} == dict.fromkeys(BAD, "malformed")
    assert status["good1"] == "active"

    for args in (("status",), ("status", "--json"), ("entries", "list"),
                 ("entries", "list", "--json"), ("runs",), ("runs", "--json")):
        r = cli(store, *args)
        assert r.exit_code in (0, 1) and "timestamp too large" not in r.output, (args, r.output)
        assert "error" not in r.stderr, (args, r.stderr)  # status exits 1 for its problems
        assert r.exit_code == 0 or args[0] == "status", (args, r.output)
        if args[0] != "runs":
            assert "next_inf" in r.output and "last_neginf" in r.output, (args, r.output)
    from reliable_beat.metrics import StoreCollector

    scraped = StoreCollector(store)._read()  # the scrape reads them too
    assert scraped["entries"]["active"] >= 2
    listed = json.loads(cli(store, "entries", "list", "--json").stdout)
    by_name = {e["name"]: e for e in (listed if isinstance(listed, list) else listed["entries"])}
    assert by_name["next_inf"]["next_fire_at"] == "infinity"
    assert by_name["last_neginf"]["last_fire_at"] == "-infinity"
    run_rows = json.loads(cli(store, "runs", "--json").stdout)
    run_rows = run_rows if isinstance(run_rows, list) else run_rows["runs"]
    assert [(r["idempotency_key"], r["created_at"]) for r in run_rows] == [
        ("good1@slot", "infinity")]


def test_infinity_entries_are_quarantined_and_the_others_fire(
    pg_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store = pg_store
    _poison(store)
    fired: list[str] = []
    quarantined = 0
    for _ in range(2):  # a second tick (a restarted beat) is just as fine
        result = Beat(store, owner="t:1").tick()
        fired += [t.payload["headers"]["reliable_beat_entry"] for t in result.triggers]
        quarantined += result.quarantined
    assert sorted(fired) == ["good1", "good2"]
    assert quarantined == len(BAD)
    with store.engine.connect() as conn:
        rows = {r.name: r for r in conn.execute(
            select(entries.c.name, entries.c.enabled, entries.c.quarantine_reason))}
    for name, (column, value) in BAD.items():
        reason = rows[name].quarantine_reason
        assert not rows[name].enabled and reason, name
        shown = "infinity" if value == "12345-01-01 00:00:00+00" else value
        assert f"{column}={shown!r}" in reason and "set a real instant" in reason, reason
    assert rows["good1"].enabled and rows["good1"].quarantine_reason is None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    for name in BAD:
        assert any(repr(name) in m and "Fix:" in m for m in errors), name
    info = collect_status(store)
    assert sorted(q["name"] for q in info["quarantined"]) == sorted(BAD)
    r = cli(store, "status")
    assert r.exit_code == 0 and "QUARANTINED: 5 malformed entries" in r.output, r.output


def test_infinity_outbox_rows_are_dead_lettered_and_the_others_delivered(
    pg_store: Store,
) -> None:
    store = pg_store
    with store.begin() as conn:
        for i in range(4):
            ob.add(conn, "sink", {"i": i}, key=f"k{i}")
        conn.execute(text("UPDATE reliable_beat_outbox SET available_at = 'infinity' "
                          "WHERE message_id = 'k1'"))
        conn.execute(text("UPDATE reliable_beat_outbox SET available_at = '-infinity' "
                          "WHERE message_id = 'k2'"))
        conn.execute(text("UPDATE reliable_beat_outbox SET created_at = 'infinity' "
                          "WHERE message_id = 'k3'"))
    delivered: list[Any] = []
    relay = Relay(store, handlers={"sink": lambda m: delivered.append(m.payload)})
    relay.run_once()
    relay.run_once()
    with store.engine.connect() as conn:
        states = dict(conn.execute(select(outbox.c.message_id, outbox.c.state)).all())
        dead = {d.key: d for d in conn.execute(
            select(dead_letters.c.key, dead_letters.c.reason, dead_letters.c.error))}
    assert states == {"k0": "sent", "k1": "dead", "k2": "dead", "k3": "dead"}
    assert [p["i"] for p in delivered] == [0]
    assert {d.reason for d in dead.values()} == {"malformed"}
    assert "available_at='infinity'" in dead["k1"].error
    assert "available_at='-infinity'" in dead["k2"].error
    assert "created_at='infinity'" in dead["k3"].error
    assert collect_status(store)["quarantined_rows"]["outbox"] == 3


# ------------------------------------------------------------ connections refused


def _err(result: Result) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(result.stderr.strip().splitlines()[-1])["error"]
    return body


@pytest.mark.parametrize("what", ["role", "database"])
@pytest.mark.parametrize("command", [("db", "upgrade"), ("db", "check"), ("status",)])
def test_refused_connection_is_store_unavailable_not_schema_missing(
    pg_url: str, what: str, command: tuple[str, ...]
) -> None:
    parsed = make_url(pg_url)
    url = (parsed.set(username="nouser") if what == "role"
           else parsed.set(database="no_such_db")).render_as_string(False)
    r = CliRunner().invoke(reliable_beat, ["--database-url", url, *command, "--json"])
    assert r.exit_code == 1, r.output
    err = _err(r)
    assert err["kind"] == "store_unavailable", err
    assert "schema" not in err["message"] and "db upgrade" not in err["message"], err
    assert f"the {what}" in err["message"] and "does not exist" in err["message"], err
    r = CliRunner().invoke(reliable_beat, ["--database-url", url, *command])
    assert r.exit_code == 1
    assert r.stderr.startswith("error: database ") and "is unavailable: the " in r.stderr


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_refused_connection_in_the_library_is_store_unavailable(pg_url: str, driver: str) -> None:
    from reliable_beat.db.migrate import check
    from reliable_beat.errors import StoreUnavailableError

    url = make_url(pg_url).set(drivername=f"postgresql+{driver}", username="nouser")
    store = Store.from_url(url.render_as_string(False))
    try:
        with pytest.raises(StoreUnavailableError, match=r"the role \(user\) does not exist"):
            check(store)
        with pytest.raises(StoreUnavailableError) as info, store.begin():
            pass
        assert "unavailable: the role (user)" in store.describe_failure(info.value)
    finally:
        store.dispose()


def test_missing_schema_is_still_schema_missing(pg_url: str) -> None:
    r = CliRunner().invoke(reliable_beat, ["--database-url", pg_url, "status", "--json"])
    assert r.exit_code == 1
    assert _err(r)["kind"] == "schema_missing"
    store = Store.from_url(pg_url)
    try:
        upgrade(store)  # then it works
    finally:
        store.dispose()
    assert CliRunner().invoke(reliable_beat, ["--database-url", pg_url, "db", "check"]
                              ).exit_code == 0
