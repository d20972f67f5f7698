"""The hand-built protocol-2 messages of the pipelined publish
(:class:`reliable_beat.celery.publishing._MessageBuilder`) are byte-for-byte the messages
``send_task`` publishes through kombu, for every publish option the ``celery`` destination
supports, on the installed Celery (tox runs this file in every Celery env of its matrix);
and a stock ``celery worker`` runs them as it runs ``send_task``'s.

Only the fields that must differ are normalised: kombu's random ``delivery_tag`` and the
``expiration`` property (milliseconds left until ``expires``, taken from the clock at each
publish; compared within 10 s). The task ids are the same on both sides (``uuid5`` of the
message id)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import kombu.transport.redis as _kredis
import pytest
import redis
from celery import Celery, signals
from kombu import Exchange, Queue

from reliable_beat.celery import publishing
from reliable_beat.celery.publishing import publish_celery_batch
from reliable_beat.outbox import OutboxMessage

pytestmark = pytest.mark.skipif(
    not hasattr(_kredis, "PublishBatch"),
    reason="kombu < 5.7: no Producer.batch(), no builder (send_task for every message)")

ROOT = Path(__file__).resolve().parents[2]
TRIGGER = {"reliable_beat_key": "e@2030", "reliable_beat_entry": "e",
           "reliable_beat_fire_at": "2030-01-01T00:00:00.000000Z",
           "reliable_beat_trigger": "schedule"}


def _rows(n: int, *, start: int = 1, **payload: Any) -> list[OutboxMessage]:
    """``n`` rows of one shape; args / kwargs / headers values differ per row."""
    out = []
    for i in range(start, start + n):
        body: dict[str, Any] = {"task": "rb.echo", "args": [] if i % 3 == 0 else [i, "a"],
                                "kwargs": {} if i % 2 else {"k": i, "nested": {"l": [i]}},
                                "headers": {**TRIGGER, "reliable_beat_key": f"e{i}@2030",
                                            "x-n": i},
                                **payload}
        out.append(OutboxMessage(id=i, message_id=f"trigger:e{i}@2030", destination="celery",
                                 payload=body))
    return out


IN_AN_HOUR = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()

#: name -> (app config, rows): every option the ``celery`` destination publishes with
CASES: dict[str, tuple[dict[str, Any], Callable[[], list[OutboxMessage]]]] = {
    "plain": ({}, lambda: _rows(6)),
    "queue": ({}, lambda: _rows(5, options={"queue": "q2"})),
    "routing_key": ({}, lambda: _rows(5, options={"routing_key": "q2"})),
    "exchange": ({}, lambda: _rows(5, options={"exchange": "ex3", "routing_key": "rk3"})),
    "priority": ({}, lambda: _rows(5, options={"priority": 6})),
    "expires": ({}, lambda: _rows(5, expires_at=IN_AN_HOUR)),
    "explicit_task_id": ({}, lambda: [
        OutboxMessage(id=i, message_id=f"m{i}", destination="celery",
                      payload={"task": "rb.echo", "task_id": f"explicit-{i}"})
        for i in range(1, 5)]),
    "long_args": ({}, lambda: _rows(4, args=["x" * 3000, list(range(500))],
                                    kwargs={"big": "y" * 2000})),
    "mixed_shapes": ({}, lambda: [m for rows in zip(
        _rows(4), _rows(4, start=10, options={"queue": "q2", "priority": 3}),
        _rows(4, start=20, expires_at=IN_AN_HOUR), strict=True) for m in rows]),
    "compression_zlib": ({"task_compression": "zlib"}, lambda: _rows(5)),
    "serializer_json": ({"task_serializer": "json", "accept_content": ["json"]},
                        lambda: _rows(5)),
    "task_routes": ({"task_routes": {"rb.*": {"queue": "q2"}}}, lambda: _rows(5)),
    "default_queue": ({"task_default_queue": "q2"}, lambda: _rows(5)),
    "delivery_mode": ({"task_default_delivery_mode": "transient"}, lambda: _rows(5)),
    "result_backend": ({"result_backend": "REDIS"}, lambda: _rows(5)),
    "registered_task_options": ({"register": True}, lambda: _rows(5)),
    "secret_arguments": ({}, lambda: [
        OutboxMessage(id=i, message_id=f"trigger:s{i}@2030", destination="celery",
                      payload={"task": "rb.echo", "args": [i, f"key=LeakArg{i}"],
                               "kwargs": {"api_key": f"LeakKw{i}", "key": f"LeakKey{i}",
                                          "n": i}, "headers": TRIGGER})
        for i in range(1, 6)]),
}


def _app(redis_url: str, conf: dict[str, Any]) -> Celery:
    app = Celery("builder", broker=redis_url)
    app.conf.task_queues = [Queue("celery"), Queue("q2"),
                            Queue("q3", Exchange("ex3", type="direct"), routing_key="rk3")]
    conf = dict(conf)
    if conf.pop("register", False):
        @app.task(name="rb.echo", time_limit=30, soft_time_limit=20, priority=4,
                  ignore_result=True, shared=False)
        def echo(*args: Any, **kwargs: Any) -> None:
            return None
    for key, value in conf.items():
        app.conf[key] = redis_url if value == "REDIS" else value
    with app.connection_for_write() as conn:  # bind q3 to ex3 (kombu's Redis bindings)
        app.conf.task_queues[2].bind(conn.default_channel).declare()
    return app


def _raw(url: str) -> dict[str, list[bytes]]:
    """Every Redis list, its raw entries in publish order."""
    client = redis.Redis.from_url(url)
    try:
        lists = {key.decode(): list(reversed(client.lrange(key, 0, -1)))
                 for key in client.scan_iter(_type="list")}
        if lists:
            client.delete(*lists)  # the exchange bindings (sets) stay
        return lists
    finally:
        client.close()


_TAG = re.compile(rb'"delivery_tag": "[0-9a-f-]{36}"')
_EXP = re.compile(rb'"expiration": "(\d+)"')


def _normalised(lists: dict[str, list[bytes]]) -> tuple[dict[str, list[bytes]], list[int]]:
    expirations = [int(m) for raws in lists.values() for raw in raws
                   for m in _EXP.findall(raw)]
    return ({k: [_EXP.sub(b'"expiration": "<ms>"', _TAG.sub(b'"delivery_tag": "<tag>"', r))
                 for r in raws] for k, raws in lists.items()}, expirations)


@contextlib.contextmanager
def _count_built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    built = [0]
    real = publishing._MessageBuilder.publish

    def counting(self: Any, *args: Any, **kwargs: Any) -> bool:
        done = real(self, *args, **kwargs)
        built[0] += bool(done)
        return done

    monkeypatch.setattr(publishing._MessageBuilder, "publish", counting)
    yield built
    monkeypatch.setattr(publishing._MessageBuilder, "publish", real)


def _publish_both(app: Celery, redis_url: str, rows: list[OutboxMessage],
                  monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, int]:
    """(hand-built batch, ``send_task`` one by one, messages built by hand)."""
    _raw(redis_url)
    with _count_built(monkeypatch) as built:
        results = publish_celery_batch(app, rows)
    assert [e for _, e in results] == [None] * len(rows)
    built_lists = _raw(redis_url)
    with monkeypatch.context() as m:  # the reference: plain send_task per message
        m.setattr(publishing, "_publish_batch",
                  lambda producer, size: contextlib.nullcontext(()))
        m.setattr(publishing._MessageBuilder, "for_batch", classmethod(lambda cls, app: None))
        results = publish_celery_batch(app, rows)
    assert [e for _, e in results] == [None] * len(rows)
    return built_lists, _raw(redis_url), built[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_built_messages_equal_send_task_byte_for_byte(
    case: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf, make_rows = CASES[case]
    app = _app(redis_url, conf)
    try:
        rows = make_rows()
        built, reference, n_built = _publish_both(app, redis_url, rows, monkeypatch)
        # the builder did build: every message after each shape's first (the batch's first
        # message and each shape's template go through send_task)
        shapes = {(m.payload.get("task"), m.payload.get("expires_at") is None,
                   json.dumps(m.payload.get("options"), sort_keys=True)) for m in rows}
        assert n_built >= len(rows) - len(shapes) - 1 > 0
        b_norm, b_exp = _normalised(built)
        r_norm, r_exp = _normalised(reference)
        assert sum(len(v) for v in b_norm.values()) == len(rows)
        for key in set(b_norm) | set(r_norm):  # byte-for-byte: body, headers, properties
            for b_raw, r_raw in zip(b_norm.get(key, []), r_norm.get(key, []), strict=True):
                assert b_raw.decode() == r_raw.decode(), key
        assert b_norm == r_norm
        assert len(b_exp) == len(r_exp)
        assert all(abs(a - b) < 10_000 for a, b in zip(b_exp, r_exp, strict=True))
        if "expires" in case:
            assert len(b_exp) >= 4
    finally:
        app.close()


def test_shown_arguments_are_redacted_and_the_task_gets_the_real_ones(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trigger's ``argsrepr`` / ``kwargsrepr`` (what Celery's worker logs, events and
    ``inspect`` show) mask credential-named arguments, by ``send_task`` and by the builder
    alike; the body keeps the real ones. On the old code the reprs showed them in clear."""
    import base64

    app = _app(redis_url, {})
    try:
        built, reference, n_built = _publish_both(app, redis_url, CASES["secret_arguments"][1](),
                                                  monkeypatch)
        assert n_built >= 3
        for lists in (built, reference):
            raws = [json.loads(raw) for raws in lists.values() for raw in raws]
            assert len(raws) == 5
            for i, raw in enumerate(raws, start=1):
                shown = json.dumps([raw["headers"], raw["properties"]])
                assert "Leak" not in shown, shown
                assert raw["headers"]["kwargsrepr"] == (
                    f"{{'api_key': '***', 'key': '***', 'n': {i}}}")
                assert raw["headers"]["argsrepr"] == f"[{i}, 'key=***']"
                body = json.loads(base64.b64decode(raw["body"]))
                assert body[0] == [i, f"key=LeakArg{i}"]
                assert body[1] == {"api_key": f"LeakKw{i}", "key": f"LeakKey{i}", "n": i}
    finally:
        app.close()


def test_a_publish_signal_receiver_means_send_task_for_every_message(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``before_task_publish`` receiver must see every message: no builder then."""
    seen: list[str] = []

    def receiver(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append((headers or {})["id"])

    signals.before_task_publish.connect(receiver, weak=False)
    app = _app(redis_url, {})
    try:
        rows = _rows(5)
        built, reference, n_built = _publish_both(app, redis_url, rows, monkeypatch)
        assert n_built == 0
        assert len(seen) == 10  # both runs, every message signalled
        assert _normalised(built)[0] == _normalised(reference)[0]
    finally:
        signals.before_task_publish.disconnect(receiver)
        app.close()


def test_a_router_function_means_send_task_for_every_message(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router function may route on the arguments: not a shape the builder can reuse."""
    def by_parity(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                  **kw: Any) -> dict[str, str]:
        return {"queue": "q2" if args and args[0] % 2 else "celery"}

    app = _app(redis_url, {"task_routes": (by_parity,)})
    try:
        rows = _rows(6)
        built, reference, n_built = _publish_both(app, redis_url, rows, monkeypatch)
        assert n_built == 0
        assert _normalised(built)[0] == _normalised(reference)[0]
        assert sorted(built) == ["celery", "q2"]
    finally:
        app.close()


def test_stock_worker_runs_built_messages_like_send_task_messages(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stock ``celery worker`` (real process) runs the hand-built messages: every task
    once, ``task_prerun`` sees the same headers and arguments as for ``send_task``'s
    messages, each on the routed queue with its priority; an expired one is not run."""
    check_stock_worker(redis_url, tmp_path, monkeypatch)


def check_stock_worker(broker_url: str, tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The stock worker check on ``broker_url`` (Redis here, RabbitMQ in
    ``test_publish_builder_amqp.py``)."""
    app = Celery("builder_app", broker=broker_url)
    app.conf.task_queues = [Queue("celery"), Queue("q2")]
    expiring_at: list[datetime] = []
    shapes = [{}, {"options": {"queue": "q2", "priority": 5}},
              {"expires_at": IN_AN_HOUR}]

    def rows(start: int) -> list[OutboxMessage]:
        out = []
        for k, extra in enumerate(shapes):
            out += _rows(4, start=start + 10 * k, **extra)
        for m in out:
            m.payload["task"] = "bb.echo"
            m.payload["headers"]["x_custom"] = f"c{m.id}"
        soon = datetime.now(timezone.utc) + timedelta(seconds=4)
        expiring_at.append(soon)
        expiring = _rows(2, start=start + 40, expires_at=soon.isoformat())  # expired when run
        for m in expiring:
            m.payload["task"] = "bb.echo"
        return out + expiring

    with _count_built(monkeypatch) as built:
        assert all(e is None for _, e in publish_celery_batch(app, rows(100)))
    assert built[0] >= 8
    with monkeypatch.context() as m:
        m.setattr(publishing._MessageBuilder, "for_batch", classmethod(lambda cls, a: None))
        assert all(e is None for _, e in publish_celery_batch(app, rows(200)))
    app.close()
    # the ``expires`` of the last two rows of each batch passes before the worker starts
    time.sleep(max(0.0, (max(expiring_at) - datetime.now(timezone.utc)).total_seconds()) + 0.5)

    out = tmp_path / "ran.jsonl"
    env = dict(os.environ, RB_BROKER_URL=broker_url, RB_TEST_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "apps")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "builder_app", "worker", "--pool", "solo",
         "-Q", "celery,q2", "-l", "WARNING", "--without-gossip", "--without-mingle",
         "--without-heartbeat"], cwd=str(tmp_path), env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        lines: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            lines = [json.loads(x) for x in out.read_text().splitlines()] \
                if out.exists() else []
            if len(lines) >= 24:
                break
            time.sleep(0.2)
        time.sleep(2)  # anything else (the expired ones) would run now
        lines = [json.loads(x) for x in out.read_text().splitlines()]
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    by_n = {int(x["reliable_beat_message_id"].split("e")[-1].split("@")[0]): x
            for x in lines}
    assert len(lines) == len(by_n) == 24, lines  # each once; the 4 expired ones not run
    for n in (140, 141, 240, 241):
        assert n not in by_n
    for n in by_n:
        if n < 200:
            built_run, stock_run = by_n[n], by_n[n + 100]
            same = {k: v for k, v in built_run.items() if k not in (
                "id", "root_id", "reliable_beat_key", "reliable_beat_message_id",
                "x_custom", "args", "kwargs", "argsrepr", "kwargsrepr")}
            other = {k: v for k, v in stock_run.items() if k in same}
            assert same == other, (n, built_run, stock_run)
            assert built_run["id"] == built_run["root_id"]
            assert built_run["x_custom"] == f"c{n}"
            assert built_run["reliable_beat_key"] == f"e{n}@2030"
            assert built_run["args"] == ([] if n % 3 == 0 else [n, "a"])
            assert built_run["routing_key"] == ("q2" if 110 <= n < 120 else "celery")
            assert built_run["priority"] == (5 if 110 <= n < 120 else None) or \
                built_run["priority"] == stock_run["priority"]
            assert (built_run["expires"] is not None) == (120 <= n < 130)


def test_a_custom_header_naming_a_celery_header_means_send_task(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A custom header that names one of ``send_task``'s own headers (here ``stamps``, as
    if a newer Celery added it and our list of protocol headers did not know it yet) stays
    at that header's place in ``send_task``'s message: the shape gets no template."""
    monkeypatch.setattr(publishing, "CELERY_PROTOCOL_HEADERS",
                        publishing.CELERY_PROTOCOL_HEADERS - {"stamps"})
    app = _app(redis_url, {})
    try:
        rows = _rows(5)
        for m in rows:
            m.payload["headers"]["stamps"] = {"s": m.id}
        built, reference, n_built = _publish_both(app, redis_url, rows, monkeypatch)
        assert n_built == 0
        assert _normalised(built)[0] == _normalised(reference)[0]
    finally:
        app.close()


def test_a_transport_error_on_the_template_path_is_kombus_operational_error(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message handed straight to the Redis batch (the template path) raises what
    ``Producer.publish`` raises for a transport error: kombu's ``OperationalError`` over
    it (``Connection._reraise_as_library_errors``); the rest of the batch is unavailable."""
    from kombu.exceptions import OperationalError

    app = _app(redis_url, {})
    raised: list[BaseException] = []
    real_publish = _kredis.PublishBatch.publish
    calls = [0]

    def failing(self: Any, message: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise redis.exceptions.ConnectionError("connection reset (injected)")
        return real_publish(self, message, **kwargs)

    real_build = publishing._MessageBuilder.publish

    def recording(self: Any, *args: Any, **kwargs: Any) -> bool:
        try:
            return real_build(self, *args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(_kredis.PublishBatch, "publish", failing)
    monkeypatch.setattr(publishing._MessageBuilder, "publish", recording)
    try:
        results = publish_celery_batch(app, _rows(5))
    finally:
        app.close()
    assert len(raised) == 1 and type(raised[0]) is OperationalError
    assert isinstance(raised[0].__cause__, redis.exceptions.ConnectionError)
    assert all(err is not None for _, err in results[2:])
