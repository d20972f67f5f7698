"""The dashboard's requeue of dead letters that are not a Celery task's run, through
:mod:`reliable_beat.ops.requeue` (as ``dead-letters requeue``), Starlette's TestClient, SQLite:

* a Dramatiq actor's dead run, with the dashboard given the broker (``-A mod:broker``): the
  run is sent again under the same key through the broker (Dramatiq's ``StubBroker``);
* an outbox dead letter, with no app at all: its row is pending again and a relay delivers it
  once under its message id;
* a ``message`` dead letter the worker refused (not requeueable): the page says why and
  offers no button; a POST is refused and recorded.
"""

from __future__ import annotations

import re
import warnings
from datetime import timedelta
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from sqlalchemy import select

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import operator_actions
from reliable_beat.dramatiq import OPTION, IdempotentActor, ReliableBeat
from reliable_beat.web import AuthConfig, create_app
from tests.integration.test_cli_dead_letter_actions import _dead_outbox_row

with warnings.catch_warnings():  # Starlette 1.x: "install httpx2" (httpx still works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

LOOPBACK = ("127.0.0.1", 50000)
LOCAL_URL = "http://127.0.0.1:8000"  # a loopback Host: the tokenless dashboard refuses others


def _csrf(page: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m, "no CSRF field in the page"
    return m.group(1)


def _requeue(client: TestClient, dl_id: int) -> str:
    page = client.get(f"/dead-letters/{dl_id}").text
    r = client.post("/actions/requeue", data={"csrf": _csrf(page), "target": str(dl_id),
                                              "confirm": "yes"})
    assert r.status_code == 200, r.text
    return r.text


def _audit(store: Store) -> list[tuple[str, str, str]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            select(operator_actions.c.action, operator_actions.c.target,
                   operator_actions.c.outcome).order_by(operator_actions.c.id))]


def test_a_dramatiq_actors_dead_run_is_requeued_through_the_broker(
        sqlite_store: Store) -> None:
    stub = StubBroker()
    stub.add_middleware(ReliableBeat(settings={"database_url": sqlite_store.url}))

    @dramatiq.actor(actor_class=IdempotentActor, queue_name="payq", broker=stub)
    def pay(x: int) -> None: ...

    key = "pay:card-7"
    claim = runs.claim_run(sqlite_store, key, owner="w@host", lease=timedelta(minutes=1),
                           task="pay")
    runs.record_failure(sqlite_store, claim, "PermanentError: declined",
                        dead_reason="permanent",
                        payload={"actor": "pay", "task": "pay", "args": [7], "kwargs": {},
                                 "key": key, "queue": "payq",
                                 "options": {OPTION: {"key": key}}})
    [dl] = runs.list_dead_letters(sqlite_store)
    with TestClient(create_app(sqlite_store, app=stub, auth=AuthConfig()),
                    client=LOOPBACK,
                    base_url=LOCAL_URL) as local:
        page = local.get(f"/dead-letters/{dl['id']}").text
        assert f"Requeue pay under key {key!r}" in page.replace("&#39;", "'"), page
        shown = _requeue(local, dl["id"])
    assert f"requeued dead letter {dl['id']}: pay under key" in shown.replace("&#39;", "'")
    [sent] = [dramatiq.Message.decode(m) for m in stub.queues["payq"].queue]  # type: ignore[attr-defined]
    assert (sent.actor_name, sent.args, sent.options[OPTION]["key"]) == ("pay", (7,), key)
    assert runs.get_run(sqlite_store, key)["state"] == "dispatched"
    assert runs.get_dead_letter(sqlite_store, dl["id"])["requeued_by"] == "local"
    assert _audit(sqlite_store) == [("requeue", str(dl["id"]), "ok")]


def test_an_outbox_dead_letter_is_delivered_again_without_an_app(sqlite_store: Store) -> None:
    delivered: list[Any] = []
    broken = {"now": True}
    relay = _dead_outbox_row(sqlite_store, delivered, broken)
    [dl] = runs.list_dead_letters(sqlite_store)
    broken["now"] = False  # the far end is fixed
    with TestClient(create_app(sqlite_store, auth=AuthConfig()), client=LOOPBACK,
                    base_url=LOCAL_URL) as local:
        page = local.get(f"/dead-letters/{dl['id']}").text
        assert "Deliver outbox message" in page and "to sink again" in page, page
        shown = _requeue(local, dl["id"])
        assert "is pending again" in shown, shown
    relay.run_once()
    relay.run_once()
    assert delivered == [("pay:1#1", {"n": 1})]
    assert _audit(sqlite_store) == [("requeue", str(dl["id"]), "ok")]


def test_a_refused_message_is_not_requeueable_and_the_page_says_why(
        sqlite_store: Store) -> None:
    dl_id = runs.record_refused_message(
        sqlite_store, key="k" * 5, task="shop.pay", payload={"task": "shop.pay", "args": []},
        error="ValueError: no key", reason="no_key")
    with TestClient(create_app(sqlite_store, auth=AuthConfig()), client=LOOPBACK,
                    base_url=LOCAL_URL) as local:
        page = local.get(f"/dead-letters/{dl_id}").text
        assert "(no_key) is not requeueable" in page and 'data-action="requeue"' not in page
        r = local.post("/actions/requeue", data={"csrf": local.cookies["rb_csrf"],
                                                 "target": str(dl_id), "confirm": "yes"})
        assert "not requeueable" in r.text
    assert _audit(sqlite_store) == [("requeue", str(dl_id), "failed")]


@pytest.mark.parametrize("kind", ["run", "message"])
def test_the_page_names_what_is_missing_without_an_app(sqlite_store: Store, kind: str) -> None:
    """Without the app the page still asks, and says how to start the dashboard to send."""
    if kind == "run":
        claim = runs.claim_run(sqlite_store, "k1", owner="w", lease=timedelta(minutes=1),
                               task="t.pay")
        runs.record_failure(sqlite_store, claim, "boom", dead_reason="permanent",
                            payload={"task": "t.pay", "key": "k1", "args": [], "kwargs": {}})
        [dl] = runs.list_dead_letters(sqlite_store)
        dl_id = int(dl["id"])
    else:
        dl_id = runs.record_refused_message(
            sqlite_store, key="k2", task="t.late",
            payload={"task": "t.late", "task_id": "tid-1", "args": []},
            error="unregistered", reason="unregistered")
    with TestClient(create_app(sqlite_store, auth=AuthConfig()), client=LOOPBACK,
                    base_url=LOCAL_URL) as local:
        page = local.get(f"/dead-letters/{dl_id}").text
        assert "reliable-beat -A APP dashboard" in page and "Yes, requeue it" in page, page
