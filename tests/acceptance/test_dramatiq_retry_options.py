"""Dramatiq's own retry options on an IdempotentActor, with real ``dramatiq`` workers.

Dramatiq's ``Retries`` middleware has the last word on the ``dramatiq.Retry`` an
IdempotentActor raises to retry. ``retry_when``, a ``throws`` matching ``Retry`` and a
per-message ``max_retries`` made it drop that retry ("Retries exceeded"): the run stayed
``retrying`` with no message, no effect and no dead letter. Those options are now refused at
decoration or dropped with a WARNING; a body's own ``dramatiq.Retry`` is a retry request
with its delay; and a ``retrying`` run whose message is lost anyway is re-sent by the sweep.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("dramatiq")

from reliable_beat import runs
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters
from reliable_beat.db.tables import runs as runs_table
from tests.acceptance.test_dramatiq_adapter import DqEnv, outcomes
from tests.apps.adapter_rig import running

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(180)]


@pytest.fixture
def dq(pg_url: str, broker_url: str, pg_store: Store, tmp_path: Path) -> Iterator[DqEnv]:
    with running(DqEnv(pg_url, broker_url, pg_store, tmp_path)) as e:
        yield e


def _client(dq: DqEnv, code: str, *argv: Any) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with ``dq_app`` imported as ``app`` in a separate process (a client)."""
    return subprocess.run(
        [sys.executable, "-c", "import sys, json, dramatiq, dq_app as app\n" + code,
         *[json.dumps(a) for a in argv]],
        env=dq.env, cwd=dq.tmp, capture_output=True, text=True, timeout=60, check=True)


@pytest.mark.parametrize("option", ["retry_when", "throws"])
def test_options_that_drop_our_retries_are_refused_at_decoration(dq: DqEnv,
                                                                  option: str) -> None:
    """Fails on the old code: the worker started, and the actor's retries were dropped."""
    dq.extra["RB_RETRY_OPTION"] = option
    worker = dq.worker("refused")
    dq.wait("the worker to refuse the actor", lambda: worker.poll() is not None, 30)
    assert worker.returncode != 0
    out = dq.logs()
    assert "ConfigurationError" in out and "IdempotentActor bad_retry" in out, out
    assert f"{option}=" in out and "would stay `retrying`" in out, out


def test_per_message_max_retries_is_ignored_with_a_warning(dq: DqEnv) -> None:
    """``send_with_options(max_retries=0)`` (dropped where the message is built) and a
    message built by hand with ``max_retries: 0`` (dropped in the worker): both retried by
    us and completed once. Fails on the old code: Dramatiq failed both after the first
    try ("Retries exceeded") and the runs stayed ``retrying``."""
    dq.worker()
    sent = _client(dq, "app.flaky.send_with_options(args=('mr', 1), max_retries=0, "
                       "reliable_beat={'key': 'flaky:mr'})")
    _client(dq, "app.broker.enqueue(dramatiq.Message(queue_name=app.QUEUE, actor_name='flaky',"
                " args=('raw', 1), kwargs={}, options={'max_retries': 0,"
                " 'reliable_beat': {'key': 'flaky:raw'}}))")
    for key in ("flaky:mr", "flaky:raw"):
        dq.wait(f"{key} succeeded", lambda k=key: dq.state(k) == "succeeded", 60)
        assert outcomes(dq.attempts(key)) == ["retrying", "succeeded"]
        assert len(dq.effects(key)) == 1
    assert "max_retries=0 ignored (when the message was built)" in sent.stderr, sent.stderr
    out = dq.logs()
    assert "message option(s) max_retries=0 ignored (in the worker)" in out, out


def test_throws_keeps_its_dramatiq_meaning(dq: DqEnv) -> None:
    """An exception listed in the actor's ``throws`` is never retried: a dead letter at
    once. Fails on the old code: it was retried until the budget ran out."""
    dq.worker()
    dq.send("throws_key_error", "tk", key="tk")
    dq.wait("dead", lambda: dq.state("tk") == "dead", 60)
    assert outcomes(dq.attempts("tk")) == ["dead"]
    assert runs.get_run(dq.store, "tk")["reason"] == "permanent"


def test_a_body_raising_retry_is_retried_after_its_delay(dq: DqEnv) -> None:
    """``raise dramatiq.Retry(delay=3000)``: a retry request, 3 s later, recorded as one
    (not an error), then the run succeeds once; no dead letter. Asked for past the budget:
    a dead letter that says so. Fails on the old code: the delay was ours (< 2 s here) and
    the recorded error was an empty ``Retry``."""
    dq.worker()
    dq.send("asks_retry", "br", 1, 3000, key="asks:br")
    dq.send("asks_retry", "bx", 99, 100, key="asks:bx")
    dq.wait("asks:br succeeded", lambda: dq.state("asks:br") == "succeeded", 60)
    tries = dq.attempts("asks:br")
    assert outcomes(tries) == ["retrying", "succeeded"]
    assert tries[0]["retry_in_seconds"] == 3.0
    assert (tries[1]["started_at"] - tries[0]["finished_at"]).total_seconds() >= 2.8, tries
    assert "retry requested by the body" in tries[0]["error"], tries[0]["error"]
    assert len(dq.effects("asks:br")) == 1
    assert not dq.rows(sa.select(dead_letters).where(dead_letters.c.key == "asks:br"))
    dq.wait("asks:bx dead", lambda: dq.state("asks:bx") == "dead", 60)
    assert outcomes(dq.attempts("asks:bx")) == ["retrying"] * 3 + ["dead"]
    letters = dq.rows(sa.select(dead_letters).where(dead_letters.c.key == "asks:bx"))
    assert len(letters) == 1 and letters[0]["reason"] == "exhausted"
    assert "retry requested by the body" in letters[0]["error"], letters[0]["error"]


def test_a_retrying_run_whose_message_was_lost_is_re_sent_by_the_sweep(dq: DqEnv) -> None:
    """An ad-hoc run (no trigger row) waits in ``retrying`` for a retry 4 s away; its worker
    is SIGKILLed and the broker loses every message (the namespace's Redis keys deleted).
    The relay's sweep re-sends it ``redispatch_seconds`` after the retry was due, built from
    the run row; another worker completes it, once. Fails on the old code: a run without a
    trigger row was never re-sent (and a triggered one only after redispatch_seconds +
    retry_cap_seconds)."""
    if dq.amqp:
        pytest.skip("loses the message by deleting the Redis broker's keys")
    import redis

    first = dq.worker("w1")
    dq.send("asks_retry", "lost", 1, 4000, key="asks:lost")
    dq.wait("retrying", lambda: dq.state("asks:lost") == "retrying", 60)
    dq.killpg(first)
    first.wait(timeout=20)
    r = redis.Redis.from_url(dq.redis_url)
    try:
        for key in r.scan_iter(f"dq-{dq.tag}:*"):
            r.delete(key)
    finally:
        r.close()
    assert dq.state("asks:lost") == "retrying"  # the kill came before the retry
    dq.extra["RB_REDISPATCH_SECONDS"] = "1"
    dq.worker("w2")
    dq.relay()
    dq.wait("re-sent and succeeded", lambda: dq.state("asks:lost") == "succeeded", 40)
    assert outcomes(dq.attempts("asks:lost")) == ["retrying", "succeeded"]
    assert len(dq.effects("asks:lost")) == 1
    starts = [p["pid"] for p in dq.progress("asks:lost")]
    assert len(starts) == 2 and starts[0] != starts[1], starts  # w2 ran the re-sent message
    row = dq.rows(sa.select(runs_table.c.redispatches).where(
        runs_table.c.idempotency_key == "asks:lost"))
    assert row[0]["redispatches"] >= 1, row
