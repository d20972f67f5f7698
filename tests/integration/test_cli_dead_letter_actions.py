"""``dead-letters requeue`` of an outbox dead letter and ``dead-letters dismiss``, through the
real CLI on every store: a dead outbox row is delivered again under the same message id by a
real relay, once; a dismissed dead letter stays listed and stops counting as waiting."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner, Result

from reliable_beat import outbox, runs
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.errors import PermanentDeliveryError
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay


def cli(store: Store, *args: str) -> Result:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def _dead_outbox_row(store: Store, delivered: list[Any], broken: dict[str, bool]) -> Relay:
    def sink(m: OutboxMessage) -> None:
        if broken["now"]:
            raise PermanentDeliveryError("410 Gone")
        delivered.append((m.message_id, m.payload))

    with store.begin() as conn:
        outbox.add(conn, "sink", {"n": 1}, key="pay:1#1")
    relay = Relay(store, handlers={"sink": sink})
    relay.run_once()
    return relay


def test_an_outbox_dead_letter_is_delivered_again_once_under_its_message_id(
        store: Store) -> None:
    delivered: list[Any] = []
    broken = {"now": True}
    relay = _dead_outbox_row(store, delivered, broken)
    [dl] = runs.list_dead_letters(store)
    assert dl["kind"] == "outbox" and delivered == []

    broken["now"] = False  # the far end is fixed
    r = cli(store, "dead-letters", "requeue", str(dl["id"]), "--yes", "--by", "alice", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["outcome"] == "requeued"
    relay.run_once()
    relay.run_once()
    assert delivered == [("pay:1#1", {"n": 1})]
    assert runs.get_dead_letter(store, dl["id"])["requeued_by"] == "alice"

    again = cli(store, "dead-letters", "requeue", str(dl["id"]), "--yes")
    assert again.exit_code == 1 and "requeued at" in again.output
    relay.run_once()
    assert len(delivered) == 1


def test_a_dismissed_dead_letter_stays_listed_and_stops_counting(store: Store) -> None:
    _dead_outbox_row(store, [], {"now": True})
    [dl] = runs.list_dead_letters(store)
    assert [d["id"] for d in runs.list_dead_letters(store, handled=False)] == [dl["id"]]

    r = cli(store, "dead-letters", "dismiss", str(dl["id"]), "--yes", "--by", "bob")
    assert r.exit_code == 0, r.output
    assert runs.list_dead_letters(store, handled=False) == []
    shown = runs.get_dead_letter(store, dl["id"])
    assert shown["handled_by"] == "bob (dismissed)" and shown["handled_at"] is not None

    twice = cli(store, "dead-letters", "dismiss", str(dl["id"]), "--yes")
    assert twice.exit_code == 1 and "already handled" in twice.output


def test_requeueing_twice_names_the_force_option(store: Store) -> None:
    relay = _dead_outbox_row(store, [], {"now": True})
    [dl] = runs.list_dead_letters(store)
    assert cli(store, "dead-letters", "requeue", str(dl["id"]), "--yes").exit_code == 0
    relay.run_once()  # dead again: the far end still refuses

    again = cli(store, "dead-letters", "requeue", str(dl["id"]), "--yes")
    assert again.exit_code == 1, again.output
    assert "pass --force" in again.output and "pass force" not in again.output
    forced = cli(store, "dead-letters", "requeue", str(dl["id"]), "--yes", "--force")
    assert forced.exit_code == 0, forced.output


def test_a_dismissed_dead_letter_needs_force_to_be_requeued(store: Store) -> None:
    delivered: list[Any] = []
    broken = {"now": True}
    relay = _dead_outbox_row(store, delivered, broken)
    [dl] = runs.list_dead_letters(store)
    assert cli(store, "dead-letters", "dismiss", str(dl["id"]), "--yes",
               "--by", "bob").exit_code == 0
    broken["now"] = False

    r = cli(store, "dead-letters", "requeue", str(dl["id"]), "--yes")
    assert r.exit_code == 1, r.output
    assert "was dismissed at" in r.output and "by bob;" in r.output
    assert "pass --force" in r.output
    relay.run_once()
    assert delivered == []  # nothing was requeued

    forced = cli(store, "dead-letters", "requeue", str(dl["id"]), "--yes", "--force")
    assert forced.exit_code == 0, forced.output
    relay.run_once()
    assert delivered == [("pay:1#1", {"n": 1})]
