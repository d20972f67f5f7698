"""Size limits at the edge and a relay claim by byte budget; protocol headers refused in
entries (issue 13). On main a 10 MB args entry was copied into runs, outbox and broker on
every slot, and a relay claim of 200 such rows held ~4 GB."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from reliable_beat import outbox
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries
from reliable_beat.db.tables import outbox as outbox_t
from reliable_beat.entries import definition_from_celery
from reliable_beat.errors import EntryValidationError
from reliable_beat.relay import Relay, claim_outbox_batch
from reliable_beat.settings import Settings

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def define(raw: dict[str, Any], settings: Settings | None = None) -> Any:
    return definition_from_celery("big", raw, default_timezone="UTC",
                                  settings=settings or Settings(), now=NOW)


def test_entry_over_the_payload_limit_is_refused_naming_it() -> None:
    raw = {"task": "t", "schedule": 60.0, "args": ["x" * 2_000_000]}
    with pytest.raises(EntryValidationError, match=r"entry 'big': args \+ kwargs \+ options "
                       r"are 2000008 bytes as JSON, over reliable_beat_max_payload_bytes "
                       r"\(1048576\)"):
        define(raw)
    define(raw, Settings(max_payload_bytes=3_000_000))  # the operator may raise it
    define({"task": "t", "schedule": 60.0, "kwargs": {"k": "y" * 500_000}})


def test_cli_entries_add_refuses_an_oversized_entry(store: Store) -> None:
    r = CliRunner().invoke(reliable_beat, [
        "--database-url", store.url, "entries", "add", "big", "--task", "t", "--every", "60",
        "--kwargs", '{"blob": "' + "z" * 1_100_000 + '"}'], catch_exceptions=False)
    assert r.exit_code == 2, r.output[-2000:]
    assert "entry 'big'" in r.output and "reliable_beat_max_payload_bytes" in r.output
    with store.begin() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(entries)).scalar_one() == 0


@pytest.mark.parametrize("header", ["task", "id", "eta", "retries", "root_id", "parent_id",
                                    "group", "Task"])
def test_entry_may_not_set_celery_protocol_headers(header: str) -> None:
    raw = {"task": "a", "schedule": 60.0, "options": {"headers": {header: "b", "ok": 1}}}
    with pytest.raises(EntryValidationError,
                       match=f"entry 'big': options\\['headers'\\] may not set Celery "
                             f"protocol header\\(s\\) {header}"):
        define(raw)
    define({"task": "a", "schedule": 60.0, "options": {"headers": {"x-tenant": "b"}}})


def test_outbox_add_refuses_an_oversized_message(store: Store) -> None:
    with store.begin() as conn:
        with pytest.raises(ValueError, match=r"outbox message 'k1' to 'notify': payload \+ "
                           r"headers are \d+ bytes as JSON, over the limit of 1048576"):
            outbox.add(conn, "notify", {"blob": "x" * 1_048_600}, key="k1")
        with pytest.raises(ValueError, match="over the limit of 100"):
            outbox.add(conn, "notify", {"a": 1}, key="k2", headers={"h": "y" * 100},
                       max_bytes=100)
        outbox.add(conn, "notify", {"blob": "x" * 1000}, key="k3")
    with store.begin() as conn:
        assert list(conn.execute(sa.select(outbox_t.c.message_id)).scalars()) == ["k3"]


def test_relay_claims_by_byte_budget(store: Store) -> None:
    """Ten 300 KB rows and a 1 MB budget: three rows per claim (the fourth would pass the
    budget); a row larger than the budget is claimed alone."""
    with store.begin() as conn:
        for i in range(10):
            outbox.add(conn, "bulk", {"blob": "x" * 300_000}, key=f"r{i}")
        outbox.add(conn, "bulk", {"blob": "y" * 1_500_000}, key="huge", max_bytes=2_000_000)
        outbox.add(conn, "bulk", {"small": 1}, key="tail")
    sizes: list[list[str]] = []
    relay = Relay(store, handlers={"bulk": lambda m: None}, owner="r",
                  settings=Settings(database_url="unused://", outbox_batch_bytes=1_000_000))
    while True:
        claimed = relay.claim()
        if not claimed:
            break
        sizes.append([m.message_id for m in claimed])
        relay.settle(relay.deliver(claimed))
    assert sizes == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6", "r7", "r8"], ["r9"],
                     ["huge"], ["tail"]]
    with store.begin() as conn:  # no budget: the row count alone, as before
        outbox.add(conn, "bulk", {"blob": "x" * 300_000}, key="n1")
        outbox.add(conn, "bulk", {"blob": "x" * 300_000}, key="n2")
    with store.begin() as conn:
        got = claim_outbox_batch(store, conn, owner="o", now=store.now(conn),
                                 lease=relay.claim_lease, limit=10)
    assert [m.message_id for m in got] == ["n1", "n2"]
