"""The Celery app the fault-injection harness runs as beats, workers and relays.

Not for applications: it exists so :mod:`harness.faults` can start real
processes (``celery -A harness.faultapp worker|beat``,
``reliable-beat -A harness.faultapp relay``). Everything is configured by the
JSON file named in ``RB_FAULTS_CONFIG`` (written by the harness)::

    {"mode": "reliable" | "stock" | "redbeat", "database_url": ..., "broker_url": ...,
     "sink_url": ..., "dir": ..., "lease_seconds": 3, "slow_seconds": 8,
     "transient_every": 7, "permanent_every": 60,
     "entries": [{"name", "kind": "cron" | "interval", "expr", "every", "timezone",
                  "anchor"}]}

What the tasks do:

* ``faultapp.effect(entry)`` (``IdempotentTask``, ``reliable`` mode): in one transaction,
  writes an effect row ``(entry, slot, run_id, fence_token, attempt, pid)`` into
  ``faults_effects`` -- a table with **no** unique constraint, so a duplicate effect would
  be visible -- and an outbox message for the HTTP sink. A deterministic subset of slots
  raises ``ConnectionError`` on attempt 1 (transient), a smaller one raises
  ``PermanentError`` (dead letter expected exactly there); when the harness drops the
  ``slow.flag`` file, the first attempt-1 run that takes it sleeps ``slow_seconds`` *inside*
  the transaction, after its writes, so the harness can SIGSTOP it past its lease.
* ``faultapp.record(entry)`` (plain task, comparison modes): records one trigger row
  ``(entry, fire_at or sent_at)`` in ``faults_triggers``.

``RB_FAULTS_CLOCK_SKEW`` (seconds) shifts ``time.time`` of the process (the skewed-clock
beat); reliable_beat decides due-ness on the database clock, so it must not matter.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import before_task_publish
from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    insert,
)

from reliable_beat.errors import PermanentDeliveryError, PermanentError

__all__ = [
    "app",
    "effects",
    "is_permanent",
    "is_transient",
    "metadata",
    "slot_hash",
    "triggers",
]

_skew = float(os.environ.get("RB_FAULTS_CLOCK_SKEW", "0") or 0)
if _skew:
    _real_time = time.time

    def _skewed_time() -> float:
        return _real_time() + _skew

    time.time = _skewed_time

CONFIG: dict[str, Any] = {}
if os.environ.get("RB_FAULTS_CONFIG"):
    CONFIG = json.loads(Path(os.environ["RB_FAULTS_CONFIG"]).read_text())
MODE: str = CONFIG.get("mode", "reliable")
DIR = Path(CONFIG.get("dir", "."))

metadata = MetaData()
effects = Table(
    "faults_effects",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("entry", String(100), nullable=False),
    Column("slot", String(40), nullable=False),  # deliberately NOT unique with entry
    Column("run_id", BigInteger, nullable=False),
    Column("fence_token", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), server_default=func.now()),
)
triggers = Table(
    "faults_triggers",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("mode", String(16), nullable=False),
    Column("entry", String(100), nullable=False),
    Column("at", Float, nullable=False),  # the slot (reliable) or the publish time (epoch s)
    Column("task_id", String(64), nullable=True),
    Column("pid", Integer, nullable=False),
)


def slot_hash(entry: str, slot: str) -> int:
    """A stable hash of ``(entry, slot)`` (the same in every process)."""
    return int.from_bytes(hashlib.sha256(f"{entry}@{slot}".encode()).digest()[:8], "big")


def is_transient(entry: str, slot: str, every: int | None = None) -> bool:
    """Slots whose first attempt raises ``ConnectionError`` (after writing its effect)."""
    n = every if every is not None else int(CONFIG.get("transient_every", 7))
    return n > 0 and slot_hash(entry, slot) % n == 1


def is_permanent(entry: str, slot: str, every: int | None = None) -> bool:
    """Slots whose every attempt raises ``PermanentError``: dead letter, no effect."""
    n = every if every is not None else int(CONFIG.get("permanent_every", 60))
    return n > 0 and slot_hash(entry, slot) % n == 3


app = Celery("faultapp", broker=CONFIG.get("broker_url", "memory://"))
app.conf.update(
    timezone="UTC",
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    beat_max_loop_interval=5,
    broker_transport_options={
        # Redelivery of an unacked message (a killed or frozen worker) after 10 s, checked
        # every second (kombu's periodic restore).
        "visibility_timeout": float(CONFIG.get("visibility_timeout", 10)),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # The restore runs under a Redis lock; a worker SIGKILLed while holding it would
        # block every restore for kombu's default 300 s.
        "unacked_mutex_expire": 5,
    },
    worker_hijack_root_logger=False,
)
if MODE == "reliable":
    app.conf.update(
        beat_scheduler="reliable_beat.celery:ReliableScheduler",
        reliable_beat_database_url=CONFIG.get(
            "database_url", os.environ.get("RELIABLE_BEAT_DATABASE_URL", "sqlite:///faults.sqlite3")
        ),
        reliable_beat_lease_seconds=float(CONFIG.get("lease_seconds", 3)),
        reliable_beat_retry_base_seconds=0.5,
        reliable_beat_retry_cap_seconds=3.0,
        reliable_beat_retry_max_attempts=8,
        reliable_beat_outbox_retry_base_seconds=0.5,
        reliable_beat_outbox_retry_cap_seconds=3.0,
        reliable_beat_outbox_max_attempts=1000,
        reliable_beat_relay_poll_seconds=0.5,
        # Above the 10 s visibility timeout: the broker redelivers first; what it lost
        # (a worker killed between BRPOP and recording the message unacked) is re-sent.
        reliable_beat_redispatch_seconds=float(CONFIG.get("redispatch_seconds", 15)),
        reliable_beat_outbox_handlers={"sink": "harness.faultapp.deliver"},
    )
elif MODE == "redbeat":
    app.conf.update(
        beat_scheduler="redbeat.RedBeatScheduler",
        redbeat_redis_url=CONFIG.get("broker_url"),
        redbeat_key_prefix="faults:",
    )

_compare = CONFIG.get("compare_task", False)
_schedule: dict[str, Any] = {}
for _e in CONFIG.get("entries", []):
    _item: dict[str, Any] = {
        "task": "faultapp.record" if _compare or MODE != "reliable" else "faultapp.effect",
        "args": [_e["name"]],
    }
    if MODE == "reliable":
        _item["schedule"] = (
            _e["expr"] if _e["kind"] == "cron" else timedelta(seconds=int(_e["every"]))
        )
        rb: dict[str, Any] = {
            "timezone": _e["timezone"],
            "misfire_policy": "catch_up",
            "catch_up_limit": 1000,
            "misfire_grace": 600,
            # Far above any delay the other faults cause (a few seconds), so every slot of
            # the window still fires; bounds what the long outage (next_fire_at a week back)
            # catches up: the slots of the last 2 minutes, not a week of them.
            "catch_up_window": 120,
        }
        if _e["kind"] == "interval":
            rb["anchor"] = _e["anchor"]
        _item["options"] = {"reliable_beat": rb}
    else:  # stock celery / RedBeat: Celery interval schedules of the same period
        _item["schedule"] = timedelta(seconds=int(_e["every"]))
    _schedule[_e["name"]] = _item
app.conf.beat_schedule = _schedule

_engine: Any = None
_engine_pid = 0


def _db() -> Any:
    """A plain engine for the comparison task (no reliable_beat machinery)."""
    global _engine, _engine_pid
    if _engine is None or _engine_pid != os.getpid():
        _engine = create_engine(CONFIG["database_url"], pool_pre_ping=True)
        _engine_pid = os.getpid()
    return _engine


def _take_slow_flag() -> Path | None:
    """Atomically take the harness's ``slow.flag`` (at most one process wins it)."""
    flag = DIR / "slow.flag"
    taken = DIR / f"slow.taken.{os.getpid()}.{time.monotonic_ns()}"
    try:
        os.rename(flag, taken)
    except FileNotFoundError:
        return None
    return taken


def _note_taken(taken: Path, info: dict[str, Any]) -> None:
    tmp = taken.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.rename(tmp, DIR / (taken.name + ".json"))


def _effect_body(task: Any, entry: str) -> dict[str, Any]:
    key: str = task.idempotency_key
    slot = key.rsplit("@", 1)[-1]
    attempt: int = task.attempt
    with task.transaction() as tx:
        tx.execute(
            insert(effects).values(
                entry=entry, slot=slot, run_id=task.run_id, fence_token=task.fence_token,
                attempt=attempt, pid=os.getpid(),
            )
        )
        task.outbox.add(tx, "sink", {"entry": entry, "slot": slot})
        if is_permanent(entry, slot):
            raise PermanentError(f"injected permanent failure of {key}")
        if attempt == 1 and is_transient(entry, slot):
            raise ConnectionError(f"injected transient failure of {key} (attempt 1)")
        if attempt == 1:
            taken = _take_slow_flag()
            if taken is not None:
                _note_taken(taken, {"key": key, "pid": os.getpid(),
                                    "fence_token": task.fence_token})
                time.sleep(float(CONFIG.get("slow_seconds", 8)))
    return {"entry": entry, "slot": slot}


def _record_body(task: Any, entry: str) -> None:
    headers = getattr(task.request, "headers", None) or {}
    fire_at = headers.get("reliable_beat_fire_at") or getattr(
        task.request, "reliable_beat_fire_at", None
    )
    sent_at = headers.get("faults_sent_at") or getattr(task.request, "faults_sent_at", None)
    if fire_at:
        at = datetime.fromisoformat(str(fire_at).replace("Z", "+00:00")).timestamp()
    elif sent_at is not None:
        at = float(sent_at)
    else:  # no stamp at all: the execution time is the best we have
        at = datetime.now(timezone.utc).timestamp()
    with _db().begin() as conn:
        conn.execute(
            insert(triggers).values(mode=MODE, entry=entry, at=at, task_id=task.request.id,
                                    pid=os.getpid())
        )


if MODE == "reliable" and not _compare:
    from reliable_beat.celery.task import IdempotentTask

    @app.task(base=IdempotentTask, bind=True, name="faultapp.effect")  # type: ignore[untyped-decorator]
    def effect(self: Any, entry: str) -> dict[str, Any]:
        """The effect of one slot: an effect row + an outbox message, in one transaction."""
        return _effect_body(self, entry)


@app.task(bind=True, name="faultapp.record")  # type: ignore[untyped-decorator]
def record(self: Any, entry: str) -> None:
    """Comparison mode: record one executed trigger of ``entry``."""
    _record_body(self, entry)


@before_task_publish.connect  # type: ignore[untyped-decorator]
def _stamp_publish_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp every published message with the publisher's send time (comparison modes)."""
    if headers is not None:
        headers.setdefault("faults_sent_at", time.time())


def deliver(message: Any) -> None:
    """Outbox handler: POST the payload to the sink with ``Idempotency-Key: message_id``."""
    body = json.dumps(message.payload).encode()
    req = urllib.request.Request(
        str(CONFIG["sink_url"]), data=body, method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": message.message_id},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        if 400 <= exc.code < 500 and exc.code not in (408, 429):
            raise PermanentDeliveryError(f"sink answered {exc.code}") from exc
        raise
