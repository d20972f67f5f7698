"""A destination that was down is noticed back by one probe row, and the rows the relay
backed off for it are delivered at once, not after their backoff (up to
``outbox_retry_cap_seconds``, 300 s).

Found by a fresh user: a Redis broker hung 75 s with two beats and a relay; every slot ran
once, but the last trigger went out 4 min 52 s after the broker answered again (the relay's
backoff had reached 283 s), and ``status`` said nothing meanwhile.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update

from reliable_beat import outbox as ob
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.handlers import DestinationUnavailableError
from reliable_beat.outbox import OutboxMessage
from reliable_beat.relay import Relay
from reliable_beat.settings import Settings


def test_rows_backed_off_for_a_down_destination_go_out_once_it_answers(store: Store) -> None:
    down = True
    delivered: list[str] = []

    def sink(m: OutboxMessage) -> None:
        if down:
            raise DestinationUnavailableError("sink: connection refused")
        delivered.append(m.message_id)

    with store.begin() as conn:
        for i in range(5):
            ob.add(conn, "sink", {"i": i}, key=f"m{i}")
    relay = Relay(store, handlers={"sink": sink}, settings=Settings(
        outbox_retry_base_seconds=60.0, outbox_retry_cap_seconds=300.0))
    relay.run_once()
    with store.engine.connect() as conn:
        now = store.now(conn)
        waits = sorted((r.available_at.replace(tzinfo=now.tzinfo) - now).total_seconds()
                       for r in conn.execute(select(outbox.c.available_at)))
    assert waits[0] <= Relay.PROBE_SECONDS + 1, waits  # one probe row soon
    assert all(w >= 55 for w in waits[1:]), waits  # the others back off
    assert delivered == []

    down = False  # the destination is back; the probe row's few seconds pass
    with store.begin() as conn:
        now = store.now(conn)
        conn.execute(update(outbox).where(
            outbox.c.available_at <= now + timedelta(seconds=Relay.PROBE_SECONDS + 1))
            .values(available_at=now - timedelta(seconds=1)))
    relay.run_once()  # delivers the probe, makes the others due
    relay.run_once()
    assert sorted(delivered) == [f"m{i}" for i in range(5)], delivered  # main: only the probe
    with store.engine.connect() as conn:
        states = list(conn.execute(select(outbox.c.state)).scalars())
    assert states == ["sent"] * 5


def test_status_names_the_broker_for_triggers_a_relay_backed_off(pg_store: Store) -> None:
    """BROKER NOT TAKING TRIGGERS also counts the triggers a relay handed back after a failed
    publish (their ``available_at`` is in the future while they back off): before, the alarm
    never fired while a relay ran (the fresh user's 75 s hang: status silent)."""
    from sqlalchemy import text

    from reliable_beat.cli.status import collect_status
    from reliable_beat.groups import record_beat

    record_beat(pg_store, owner="beat:1", group="shop", config_hash=None, unregistered={},
                destinations=["celery"])
    with pg_store.begin() as conn:
        ob.add(conn, "celery", {"task": "t"}, key="trigger:t@1")
        conn.execute(text(
            "UPDATE reliable_beat_outbox SET schedule_group = 'shop', "
            "created_at = now() - interval '3 minutes', "
            "available_at = now() + interval '200 seconds', "
            "last_error = 'DestinationUnavailableError: broker timed out'"))
    info = collect_status(pg_store)
    assert [(u["group"], u["rows"]) for u in info["unpublished_triggers"]] == [("shop", 1)], info
    assert any("BROKER NOT TAKING TRIGGERS" in p for p in info["problems"]), info["problems"]
