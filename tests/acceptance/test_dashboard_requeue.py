"""A dropped message requeued from the dashboard, with real worker processes on PostgreSQL and
Redis (tests/apps/lostapp.py, as tests/acceptance/test_dropped_messages.py).

A relay publishes an outbox row naming ``lostapp.late``, which the first worker does not
register: the worker drops it and records a ``message`` dead letter (``unregistered``). Once a
worker that registers the task runs, an operator requeues the dead letter from its dashboard
page: a viewer sees the question but no button and is refused, a POST without the CSRF field
or without the confirmation is refused, and the confirmed one sends the same message again,
which the new worker runs once. Every attempt is in the operator actions table.
"""

from __future__ import annotations

import base64
import re
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import redis
from celery import Celery
from sqlalchemy import select

from reliable_beat import outbox, runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import operator_actions
from reliable_beat.relay import Relay
from reliable_beat.web import AuthConfig, create_app
from tests.acceptance.test_dropped_messages import dead_letters, procs, start_worker  # noqa: F401

with warnings.catch_warnings():  # Starlette 1.x: "install httpx2" (httpx still works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
import procs as procs_mod  # tests/apps

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(180)]

OPERATOR_TOKEN = "op-" + "o" * 30
VIEWER_TOKEN = "view-" + "v" * 30
LOOPBACK = ("127.0.0.1", 50000)
LOCAL_URL = "http://127.0.0.1:8000"  # a loopback Host: the tokenless dashboard refuses others


def _csrf(page: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m, "no CSRF field in the page"
    return m.group(1)


def test_a_dropped_message_requeued_from_the_dashboard_runs_once_registered(
        pg_store: Store, redis_url: str, procs: procs_mod.BeatProcs) -> None:  # noqa: F811
    queue = f"rbq_{uuid.uuid4().hex[:10]}"
    procs.env.update({"RB_BROKER_URL": redis_url, "RELIABLE_BEAT_DATABASE_URL": pg_store.url,
                      "RB_QUEUE": queue})
    effects = redis.Redis.from_url(redis_url)
    worker = start_worker(procs, queue)
    with pg_store.begin() as conn:
        outbox.add(conn, "celery", {"task": "lostapp.late", "args": ["a"]})
    app = Celery("lostapp", broker=redis_url)
    app.conf.task_default_queue = queue
    relay = Relay(pg_store, app, claim_lease_seconds=10)
    relay.run_once()
    [dl] = procs_mod.wait_for(lambda: dead_letters(pg_store, "unregistered"), 30,
                              "the dropped message's dead letter")
    procs.terminate(worker)
    start_worker(procs, queue, RB_REGISTER_LATE="1")  # the fix is deployed

    web = create_app(pg_store, app=app,
                     auth=AuthConfig(operator_token=OPERATOR_TOKEN, viewer_token=VIEWER_TOKEN))
    page_url = f"/dead-letters/{dl['id']}"
    with TestClient(web, client=LOOPBACK, base_url=LOCAL_URL,
                    headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}) as viewer:
        page = viewer.get(page_url).text
        assert "Send lostapp.late[" in page and "again (dropped: unregistered)?" in page, page
        assert 'data-action="requeue"' not in page  # no button for a viewer
        r = viewer.post("/actions/requeue", data={
            "csrf": viewer.cookies["rb_csrf"], "target": str(dl["id"]), "confirm": "yes"})
        assert r.status_code == 403 and "only operators may act" in r.text
    basic = base64.b64encode(f"alice:{OPERATOR_TOKEN}".encode()).decode()
    with TestClient(web, client=LOOPBACK, base_url=LOCAL_URL,
                    headers={"Authorization": f"Basic {basic}"}) as op:
        page = op.get(page_url).text
        assert 'data-action="requeue"' in page and "Yes, requeue it" in page, page
        r = op.post("/actions/requeue", data={"target": str(dl["id"]), "confirm": "yes"})
        assert r.status_code == 403 and "CSRF" in r.text
        r = op.post("/actions/requeue", data={"csrf": _csrf(page), "target": str(dl["id"])})
        assert "not confirmed" in r.text
        assert effects.lrange(f"{queue}:effects", 0, -1) == []
        r = op.post("/actions/requeue", data={"csrf": _csrf(page), "target": str(dl["id"]),
                                              "confirm": "yes", "back": page_url},
                    follow_redirects=False)
        assert r.status_code == 303, r.text
        shown = op.get(r.headers["location"]).text
        assert "sent again" in shown, shown
    procs_mod.wait_for(lambda: effects.lrange(f"{queue}:effects", 0, -1), 30,
                       "the requeued message to run")
    assert effects.lrange(f"{queue}:effects", 0, -1) == [b"late:a"]
    assert runs.get_dead_letter(pg_store, dl["id"])["requeued_by"] == "alice"
    assert runs.list_dead_letters(pg_store, include_requeued=False) == []
    with pg_store.engine.connect() as conn:
        audit = [tuple(r) for r in conn.execute(
            select(operator_actions.c.actor, operator_actions.c.role, operator_actions.c.action,
                   operator_actions.c.target, operator_actions.c.outcome)
            .order_by(operator_actions.c.id))]
    target = str(dl["id"])
    assert audit == [("viewer-token", "viewer", "requeue", target, "refused"),
                     ("alice", "operator", "requeue", target, "refused"),  # no CSRF
                     ("alice", "operator", "requeue", target, "refused"),  # not confirmed
                     ("alice", "operator", "requeue", target, "ok")], audit
