"""``reliable-beat lease clear``: fence the holder out, close its attempt, re-send the task.

Trial findings (leaseops): ``lease clear`` moved a ``running`` run to ``retrying`` and sent
nothing (the run waited minutes for the re-dispatch sweep); the fenced-out holder's attempt
row stayed ``running`` forever; without ``--yes`` on a non-TTY it exited 1, the code of "no
such run". Real stores (the ``store`` fixture: SQLite, PostgreSQL, MariaDB); the CLI on
PostgreSQL. The relay that publishes the re-sent row is the real
:func:`reliable_beat.relay.claim_outbox_batch`.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from reliable_beat import runs
from reliable_beat.beat import build_trigger_payload, trigger_message_id, trigger_outbox_row
from reliable_beat.celery.commands import reliable_beat
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.db.tables import runs as runs_t
from reliable_beat.errors import StaleFenceToken
from reliable_beat.relay import claim_outbox_batch, mark_sent

LEASE = timedelta(seconds=600)  # a long lease: the holder is frozen, not dead


def _scheduled_run(store: Store, key: str, *, expires: float | None = None) -> int:
    """A run + its trigger row, as the beat writes them, already published (``sent``)."""
    with store.begin() as conn:
        now = store.now(conn)
        run_id = conn.execute(sa.insert(runs_t).values(
            idempotency_key=key, entry_name="pay", fire_at=now, trigger="schedule",
            task="proj.pay", args=[1], kwargs={}, state="scheduled", created_at=now,
            updated_at=now,
        ).returning(runs_t.c.id)).scalar_one()
        options: dict[str, Any] = {"queue": "q1"}
        if expires is not None:
            options["expires"] = expires
        payload = build_trigger_payload(task="proj.pay", args=[1], kwargs={}, options=options,
                                        key=key, entry="pay", fire_at=now, trigger="schedule")
        conn.execute(sa.insert(outbox).values(
            **trigger_outbox_row(key, run_id, payload, now, available_at=now,
                                 claimed_by=None)))
    relay_publishes(store)  # the first delivery
    return int(run_id)


def relay_publishes(store: Store) -> list[str]:
    """One relay cycle over trigger rows: claim what is due, mark it sent; the message ids."""
    with store.begin() as conn:
        now = store.now(conn)
        got = claim_outbox_batch(store, conn, owner="relay-1", now=now,
                                 lease=timedelta(seconds=60), limit=100,
                                 destinations=["celery"])
        mark_sent(conn, [m.id for m in got], now)
    return [m.message_id for m in got]


def claim(store: Store, key: str, owner: str) -> runs.Claim:
    return runs.claim_run(store, key, owner=owner, lease=LEASE, task="proj.pay", args=[1],
                          entry="pay")


def trigger_row(store: Store, key: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(outbox).where(
            outbox.c.message_id == trigger_message_id(key))).one()


def test_clear_resends_the_trigger_and_closes_the_holders_attempt(store: Store) -> None:
    """Fails on the old code: nothing was re-sent (no ``release_lease``; the old
    ``clear_lease`` left the trigger row ``sent``) and attempt 1 stayed ``running``."""
    key = "pay@2026-05-01T02:00:00Z"
    _scheduled_run(store, key)
    assert relay_publishes(store) == []  # sent once: nothing more to publish
    a = claim(store, key, "worker-a")  # A runs the body ... and freezes
    assert a.acquired

    done = runs.release_lease(store, key)

    assert (done.previous_state, done.state) == ("running", "retrying")
    assert done.fence_token == a.fence_token + 1
    assert done.holder == "worker-a" and done.fenced_out_attempts == 1
    assert done.resend == runs.RESENT and done.message_id == trigger_message_id(key)
    row = trigger_row(store, key)
    assert row.state == "pending" and row.claimed_by is None
    # the relay publishes it at once (due now), the same message as the first delivery
    assert relay_publishes(store) == [trigger_message_id(key)]
    # the superseded attempt has an honest end, not `running` forever
    tries = runs.list_attempts(store, a.run_id)
    assert [(t["fence_token"], t["outcome"]) for t in tries] == [(1, "fenced_out")]
    assert tries[0]["finished_at"] is not None and "lease clear" in tries[0]["error"]
    # the re-sent message's runner is the only one that can commit
    b = claim(store, key, "worker-b")
    assert b.acquired and b.fence_token == done.fence_token + 1
    assert runs.renew_lease(store, a, LEASE) is False
    with pytest.raises(StaleFenceToken), store.begin() as conn:
        runs.complete(conn, a, "stale")
    runs.record_fenced_out(store, a)
    with store.begin() as conn:
        runs.complete(conn, b, "ok")
    run = runs.get_run(store, key)
    assert (run["state"], run["result"], run["fence_token"]) == ("succeeded", "ok", 3)
    tries = runs.list_attempts(store, a.run_id)
    assert [(t["fence_token"], t["outcome"]) for t in tries] == [
        (1, "fenced_out"), (3, "succeeded")]


def test_clear_no_resend_and_not_running(store: Store) -> None:
    key = "pay@2026-05-01T03:00:00Z"
    _scheduled_run(store, key)
    claim(store, key, "worker-a")
    done = runs.release_lease(store, key, resend=False)
    assert done.resend == runs.RESEND_SKIPPED and done.state == "retrying"
    assert done.fenced_out_attempts == 1
    assert trigger_row(store, key).state == "sent"
    assert relay_publishes(store) == []
    # a second clear: the run is not running any more, nothing re-sent, said so
    again = runs.release_lease(store, key)
    assert again.resend == runs.RESEND_SKIPPED and again.fence_token == done.fence_token + 1
    assert again.previous_state == again.state == "retrying"
    assert "not running" in again.note and again.fenced_out_attempts == 0
    assert relay_publishes(store) == []
    # a finished run keeps its state and is not re-sent
    b = claim(store, key, "worker-b")
    with store.begin() as conn:
        runs.complete(conn, b, "ok")
    last = runs.release_lease(store, key)
    assert (last.state, last.resend) == ("succeeded", runs.RESEND_SKIPPED)
    assert "succeeded" in last.note and relay_publishes(store) == []


def test_clear_adhoc_run_says_it_cannot_resend(store: Store) -> None:
    a = runs.claim_run(store, "invoice:42", owner="worker-a", lease=LEASE, task="proj.inv")
    done = runs.release_lease(store, "invoice:42")
    assert done.resend == runs.NOT_RESENT and done.state == "retrying"
    assert "no trigger row" in done.note and "same idempotency key" in done.note
    assert [t["outcome"] for t in runs.list_attempts(store, a.run_id)] == ["fenced_out"]
    with pytest.raises(runs.RunNotFound):
        runs.release_lease(store, "nope")


def test_clear_expired_trigger_is_not_resent(store: Store) -> None:
    key = "pay@2026-05-01T04:00:00Z"
    _scheduled_run(store, key, expires=0.001)  # expired at the slot + 1 ms
    claim(store, key, "worker-a")
    done = runs.release_lease(store, key)
    assert done.resend == runs.NOT_RESENT and "expired" in done.note
    assert trigger_row(store, key).state == "sent"


def _cli(store: Store, *args: str) -> Any:
    return CliRunner().invoke(reliable_beat, ["--database-url", store.url, *args],
                              catch_exceptions=False)


def test_cli_lease_clear_exit_codes_and_output(pg_store: Store) -> None:
    """Fails on the old code: no TTY without --yes exited 1 (click's Abort), the code of
    "no such run"; the output said nothing about a re-send."""
    key = "pay@2026-05-01T05:00:00Z"
    _scheduled_run(pg_store, key)
    claim(pg_store, key, "worker-a")

    refused = _cli(pg_store, "lease", "clear", key)  # CliRunner: stdin is no TTY
    assert refused.exit_code == 2, refused.output
    assert "--yes" in refused.output and "no TTY" in refused.output
    assert runs.get_run(pg_store, key)["state"] == "running"  # nothing changed

    missing = _cli(pg_store, "lease", "clear", "nope", "--yes")
    assert missing.exit_code == 1 and "no run with key 'nope'" in missing.output
    missing_no_tty = _cli(pg_store, "lease", "clear", "nope")
    assert missing_no_tty.exit_code == 1  # not found is decided before asking

    done = _cli(pg_store, "lease", "clear", key, "--yes")
    assert done.exit_code == 0, done.output
    assert "fence token is now 2" in done.output
    assert "fenced out: worker-a" in done.output
    assert "running -> retrying" in done.output
    assert "re-sent" in done.output and trigger_message_id(key) in done.output
    assert relay_publishes(pg_store) == [trigger_message_id(key)]

    again = _cli(pg_store, "lease", "clear", key, "--yes", "--json")
    assert again.exit_code == 0, again.output
    body = json.loads(again.output)
    assert body["outcome"] == "cleared" and body["fence_token"] == 3
    assert body["resend"] == "skipped" and body["state"] == "retrying"
    assert "not running" in body["note"]


def test_cli_lease_clear_json_and_no_resend(pg_store: Store) -> None:
    key = "pay@2026-05-01T06:00:00Z"
    _scheduled_run(pg_store, key)
    claim(pg_store, key, "worker-a")
    out = _cli(pg_store, "lease", "clear", key, "--yes", "--no-resend", "--json")
    assert out.exit_code == 0, out.output
    body = json.loads(out.output)
    assert body["resend"] == "skipped" and body["holder"] == "worker-a"
    assert body["previous_state"] == "running" and body["fence_token"] == 2
    assert isinstance(body["lease_expires_at"], str)
    assert datetime.fromisoformat(body["lease_expires_at"].replace("Z", "+00:00"))
    assert relay_publishes(pg_store) == []
    refused = _cli(pg_store, "lease", "clear", key, "--json")
    assert refused.exit_code == 2
    err = json.loads(refused.output)["error"]  # CliRunner mixes stderr into output
    assert err["kind"] == "usage" and err["exit_code"] == 2


def test_cli_clear_resends_and_runs_show_shows_the_fenced_out_attempt(pg_store: Store) -> None:
    """Through the CLI only (the same command on the old code): fails there twice over, the
    relay found nothing to publish and attempt 1 stayed ``running``."""
    key = "pay@2026-05-01T07:00:00Z"
    _scheduled_run(pg_store, key)
    claim(pg_store, key, "worker-a")
    assert _cli(pg_store, "lease", "clear", key, "--yes").exit_code == 0
    published = relay_publishes(pg_store)
    shown = _cli(pg_store, "runs", "show", key)
    assert shown.exit_code == 0, shown.output
    line = [x for x in shown.output.splitlines() if x.startswith("1 ")]
    assert line and "fenced_out" in line[0] and "worker-a" in line[0], shown.output
    assert published == [trigger_message_id(key)]
