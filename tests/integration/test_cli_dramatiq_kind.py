"""`reliable-beat -A <Dramatiq broker module> entries ...`: the task kind of a Dramatiq actor.

The core asks the app's adapter (reliable_beat.adapters) what kind an entry's task is; for a
Dramatiq broker that is the Dramatiq adapter: an ``IdempotentActor`` is tracked
(``idempotent``), any other declared actor ``plain``, an actor name the broker does not
declare ``unknown``, with the fix. Before the Dramatiq adapter answered, ``-A`` of a broker
module failed (Celery's loader found no Celery app) and the kind was Celery-only.
SQLite store; the app is ``tests/apps/dq_kind_app.py`` (a StubBroker: no server).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner, Result

from reliable_beat.db.dialects import Store

pytest.importorskip("dramatiq")

APP = "tests.apps.dq_kind_app"


def cli(store: Store, *args: str, app: str | None = APP) -> Result:
    from reliable_beat.cli import reliable_beat

    base = ["--database-url", store.url]
    if app:
        base = ["-A", app, *base]
    return CliRunner().invoke(reliable_beat, [*base, *args], catch_exceptions=False)


def ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.output


def describe(store: Store, name: str, app: str | None = APP) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(ok(cli(store, "entries", "describe", name, "--json",
                                              app=app)))
    return info


def test_dramatiq_actor_kinds_in_describe(sqlite_store: Store) -> None:
    store = sqlite_store
    # `entries add -A` checks the actor is declared on the broker (the adapter's task_kind)
    ok(cli(store, "entries", "add", "tracked", "--task", "kind_tracked", "--every", "60",
           "--overlap-policy", "skip"))
    ok(cli(store, "entries", "add", "plain", "--task", "kind_plain", "--every", "60"))
    refused = cli(store, "entries", "add", "typo", "--task", "kind_tpyo", "--every", "60")
    assert refused.exit_code != 0 and "'kind_tpyo' is not registered" in refused.output
    ok(cli(store, "entries", "add", "typo", "--task", "kind_tpyo", "--every", "60", app=None))

    tracked = describe(store, "tracked")
    assert tracked["task_kind"] == "idempotent" and tracked["framework"] == "dramatiq"
    assert tracked["task_kind_fix"] is None
    q = tracked["questions"]
    assert q["run_twice"]["answer"] == "no" and "IdempotentActor" in q["run_twice"]["why"]
    assert q["overlap"]["answer"] == "no"
    assert q["idempotent"]["answer"] == "yes" and "current().transaction()" in (
        q["idempotent"]["why"])
    assert "(7 s" in q["machine_dies"]["why"]  # the actor's lease_seconds, not Celery's

    plain = describe(store, "plain")
    assert plain["task_kind"] == "plain"
    q = plain["questions"]
    assert q["run_twice"]["answer"] == "yes" and "plain Dramatiq actor" in q["run_twice"]["why"]
    assert q["idempotent"]["answer"] == "no" and "actor_class=IdempotentActor" in (
        q["idempotent"]["why"])
    assert "Celery" not in json.dumps(q)

    unknown = describe(store, "typo")
    assert unknown["task_kind"] == "unknown"
    assert "'kind_tpyo' is not registered in the -A app (dramatiq)" in unknown["task_kind_fix"]
    assert "import the module" in unknown["task_kind_fix"]
    text = ok(cli(store, "entries", "describe", "typo"))
    assert "(unknown)" in text and "task kind unknown: task 'kind_tpyo'" in text

    # without -A: unknown, and the fix is to give one
    assert describe(store, "tracked", app=None)["task_kind"] == "unknown"
    assert "-A APP" in describe(store, "tracked", app=None)["task_kind_fix"]

    text = ok(cli(store, "entries", "describe", "tracked"))
    assert "task kind_tracked (idempotent)" in text
    assert "task kind_plain (plain)" in ok(cli(store, "entries", "describe", "plain"))


def test_dramatiq_app_settings_and_trigger_destination(sqlite_store: Store) -> None:
    """With ``-A`` a broker module the CLI reads the ReliableBeat middleware's settings
    (``--database-url`` still wins) and a manual trigger is a ``dramatiq`` trigger row
    published through the broker (the StubBroker's queue), not a ``celery`` one."""
    from sqlalchemy import select

    from reliable_beat.db.tables import outbox
    from tests.apps.dq_kind_app import broker

    store = sqlite_store
    ok(cli(store, "entries", "add", "tracked", "--task", "kind_tracked", "--every", "3600"))
    broker.flush_all()
    out = ok(cli(store, "entries", "trigger", "tracked"))
    assert "triggered tracked" in out
    with store.engine.connect() as conn:
        rows = conn.execute(select(outbox.c.destination, outbox.c.state)).all()
    assert rows == [("dramatiq", "sent")], rows
    queued = broker.queues["kinds"].qsize()
    assert queued == 1
    message = broker.queues["kinds"].get()
    assert b"kind_tracked" in message


def test_a_broker_module_without_a_broker_is_a_clear_error(sqlite_store: Store,
                                                           tmp_path: Any,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    (tmp_path / "dq_nobroker_mod.py").write_text(
        "from dramatiq.brokers.stub import StubBroker\n"
        "one = StubBroker()\ntwo = StubBroker()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = cli(sqlite_store, "entries", "list", app="dq_nobroker_mod")
    assert r.exit_code != 0
    assert "-A dq_nobroker_mod: 'dq_nobroker_mod' has no Dramatiq broker" in r.output
    assert "-A module:attr" in r.output
