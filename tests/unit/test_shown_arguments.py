"""What Celery shows of an ``IdempotentTask`` message's arguments (``argsrepr`` /
``kwargsrepr``: its worker's logs, events, ``celery inspect``) is redacted; the task still
gets the real arguments. On a real kombu broker (the in-process memory transport)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from reliable_beat.celery.task import KEY_HEADER, IdempotentTask


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery(f"shown-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)

    @app.task(base=IdempotentTask, bind=True, name="shown.charge", shared=False)
    def charge(self: IdempotentTask, *args: Any, **kwargs: Any) -> None:
        """Never run here."""

    yield app
    app.close()


def _published(app: Celery, queue: str) -> Any:
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue)
        try:
            message = simple.get(timeout=5)
            message.ack()
            return message
        finally:
            simple.close()


@pytest.mark.parametrize(("args", "kwargs", "argsrepr", "kwargsrepr"), [
    (("c-1", "token=Tk1x"), {"api_key": "Ak1x", "key": "Kk1x", "n": 2},
     "('c-1', 'token=***')", "{'api_key': '***', 'key': '***', 'n': 2}"),
    ((), {"creds": {"password": "Pw1x", "user": "u"}, "idempotency_key": "k"},
     "()", "{'creds': {'password': '***', 'user': 'u'}, 'idempotency_key': 'k'}"),
    (["Authorization: Bearer Bt1x1234567"], None, "['Authorization: Bearer ***']", "{}"),
])
def test_apply_async_publishes_redacted_reprs(app: Celery, args: Any, kwargs: Any,
                                              argsrepr: str, kwargsrepr: str) -> None:
    queue = f"shown-{uuid.uuid4().hex[:8]}"
    app.tasks["shown.charge"].apply_async(args, kwargs, queue=queue,
                                          headers={KEY_HEADER: "charge:1"})
    message = _published(app, queue)
    assert (message.headers["argsrepr"], message.headers["kwargsrepr"]) == (argsrepr, kwargsrepr)
    body_args, body_kwargs, _ = message.decode()
    assert list(body_args) == list(args) and body_kwargs == (kwargs or {})


def test_reprs_given_by_the_caller_are_kept(app: Celery) -> None:
    queue = f"shown-{uuid.uuid4().hex[:8]}"
    app.tasks["shown.charge"].apply_async(("a",), {"key": "x"}, queue=queue,
                                          headers={KEY_HEADER: "charge:2"},
                                          argsrepr="(hidden)", kwargsrepr="{hidden}")
    message = _published(app, queue)
    assert (message.headers["argsrepr"], message.headers["kwargsrepr"]) == ("(hidden)",
                                                                            "{hidden}")
