"""An outbox row for a destination no relay handles ("emial", a typo) is loud, not silent.

Before: it stayed pending forever, the relay logged nothing and ``status --check`` exited 0.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import update

from reliable_beat import outbox as ob
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def _add(store: Store, destination: str, key: str, due_minutes_ago: float) -> None:
    with store.begin() as conn:
        ob.add(conn, destination, {"to": "a@example.com"}, key=key)
        now = store.now(conn)
        conn.execute(update(outbox).where(outbox.c.message_id == key).values(
            available_at=now - timedelta(minutes=due_minutes_ago),
            created_at=now - timedelta(minutes=due_minutes_ago)))


def test_status_check_alarms_on_undelivered_outbox_rows_per_destination(store: Store) -> None:
    _add(store, "email", "fresh", 1)  # due a minute: a relay may just not have got to it
    assert cli(store, "status", "--check").exit_code == 0
    _add(store, "emial", "typo1", 11)
    _add(store, "emial", "typo2", 12)
    r = cli(store, "status", "--check")
    assert r.exit_code == 1, r.output
    assert "UNDELIVERED OUTBOX: 2 pending rows for destination 'emial'" in r.output, r.output
    assert "'email'" not in r.output.split("UNDELIVERED OUTBOX")[1].split("\n")[0]
    info = json.loads(cli(store, "status", "--json").output)
    assert [u["destination"] for u in info["undelivered_outbox"]] == ["emial"]
    assert info["ok"] is False
    # the threshold is an option
    assert cli(store, "status", "--check", "--outbox-stuck", "15").exit_code == 0


def test_relay_warns_about_due_rows_it_has_no_handler_for(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    _add(store, "emial", "typo", 5)
    _add(store, "email", "ok", 5)
    _add(store, "sms", "new", 0)  # just added: another relay may take it, not reported yet
    sent: list[object] = []
    relay = Relay(store, handlers={"email": lambda m: sent.append(m)}, settings=Settings(),
                  owner="r1")
    with caplog.at_level(logging.WARNING, logger="reliable_beat"):
        relay.run_once()
        relay.run_once()  # once per check window, not per cycle
    lines = [r.getMessage() for r in caplog.records if "no handler" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "'emial'" in lines[0] and "email" in lines[0] and "'sms'" not in lines[0]
    assert len(sent) == 1  # the handled row was delivered


def test_a_row_of_a_schedule_group_is_reported_once_as_unserved_not_undelivered(
        store: Store) -> None:
    """A row only its group's relays publish (a workflow's message, ``schedule_group`` set)
    and no relay of that group alive: UNSERVED OUTBOX names the group; UNDELIVERED OUTBOX (per
    destination, "no running relay has a handler") must not report it too — its advice is
    false when a relay with that handler runs for another group (a fresh user's finding; the
    old code reported the row twice)."""
    with store.begin() as conn:
        ob.add(conn, "celery", {"task": "reports.build", "args": [], "kwargs": {}},
               key="rep:1", schedule_group="reports")
        now = store.now(conn)
        conn.execute(update(outbox).where(outbox.c.message_id == "rep:1").values(
            available_at=now - timedelta(minutes=20), created_at=now - timedelta(minutes=20)))
    _add(store, "emial", "typo", 20)  # a group-less row: still UNDELIVERED
    info = json.loads(cli(store, "status", "--json").output)
    assert [u["destination"] for u in info["undelivered_outbox"]] == ["emial"], info
    assert [u["group"] for u in info["unserved_outbox"]] == ["reports"], info
    r = cli(store, "status", "--check")
    assert r.exit_code == 1
    assert r.output.count("rep:1") == 0 and "UNSERVED OUTBOX: group 'reports'" in r.output
    assert "destination 'celery'" not in r.output, r.output
