"""The framework-neutral part of the fault harness's app: its configuration, ledger tables,
the effect body both adapters run, and the HTTP sink's outbox handler.

:mod:`harness.faultapp` (Celery) and :mod:`harness.faultapp_dramatiq` (Dramatiq) import it;
it imports neither Celery nor Dramatiq. Everything is configured by the JSON file named in
``RB_FAULTS_CONFIG`` (written by :mod:`harness.faults`).

``RB_FAULTS_CLOCK_SKEW`` (seconds) shifts ``time.time`` of the process once, when this module
is first imported (the skewed-clock beat); reliable_beat decides due-ness on the database
clock, so it must not matter.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

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
    "CONFIG",
    "DIR",
    "MODE",
    "db",
    "deliver",
    "effect_body",
    "effects",
    "is_permanent",
    "is_transient",
    "metadata",
    "reliable_settings",
    "slot_hash",
    "triggers",
    "wf_activity_body",
    "wf_effects",
    "wf_fails",
    "wf_transient",
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
#: One row per effect of a workflow activity or compensation (the workflow shapes):
#: ``(workflow_id, action)`` is deliberately NOT unique, so a duplicate effect is visible.
wf_effects = Table(
    "faults_wf_effects",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("workflow_id", String(400), nullable=False),
    Column("action", String(20), nullable=False),  # fwd1..3, comp1..3, before, after, signalled
    Column("run_key", String(400), nullable=False),
    Column("fence_token", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), server_default=func.now()),
)


def reliable_settings() -> dict[str, Any]:
    """The ``reliable_beat`` settings of the run (names without the ``reliable_beat_``
    prefix), the same for both adapters."""
    return {
        "database_url": CONFIG.get(
            "database_url",
            os.environ.get("RELIABLE_BEAT_DATABASE_URL", "sqlite:///faults.sqlite3")),
        "lease_seconds": float(CONFIG.get("lease_seconds", 3)),
        "retry_base_seconds": 0.5,
        "retry_cap_seconds": 3.0,
        "retry_max_attempts": 8,
        "outbox_retry_base_seconds": 0.5,
        "outbox_retry_cap_seconds": 3.0,
        "outbox_max_attempts": 1000,
        "relay_poll_seconds": 0.5,
        # Above the broker's redelivery delay (10 s): the broker redelivers first; what it
        # lost is re-sent by the re-dispatch sweep.
        "redispatch_seconds": float(CONFIG.get("redispatch_seconds", 15)),
        "outbox_handlers": {"sink": "harness.faultcore.deliver"},
    }


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


_engine: Any = None
_engine_pid = 0


def db() -> Any:
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


def effect_body(run: Any, entry: str) -> dict[str, Any]:
    """The effect of one slot, for either adapter: ``run`` is the Celery ``IdempotentTask``
    (``self``) or the Dramatiq ``current()`` run context (both have ``idempotency_key``,
    ``attempt``, ``run_id``, ``fence_token``, ``transaction()``, ``outbox.add``).

    In one transaction: an effect row and an outbox message for the sink; injected transient
    / permanent failures; the harness's ``slow.flag`` taken -> sleeps inside the
    transaction (the zombie fault)."""
    key: str = run.idempotency_key
    slot = key.rsplit("@", 1)[-1]
    attempt: int = run.attempt
    with run.transaction() as tx:
        tx.execute(
            insert(effects).values(
                entry=entry, slot=slot, run_id=run.run_id, fence_token=run.fence_token,
                attempt=attempt, pid=os.getpid(),
            )
        )
        run.outbox.add(tx, "sink", {"entry": entry, "slot": slot})
        if is_permanent(entry, slot):
            raise PermanentError(f"injected permanent failure of {key}")
        if attempt == 1 and is_transient(entry, slot):
            raise ConnectionError(f"injected transient failure of {key} (attempt 1)")
        if attempt == 1:
            taken = _take_slow_flag()
            if taken is not None:
                _note_taken(taken, {"key": key, "pid": os.getpid(),
                                    "fence_token": run.fence_token})
                time.sleep(float(CONFIG.get("slow_seconds", 8)))
    return {"entry": entry, "slot": slot}


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


# ---------------------------------------------------------------- workflow shapes ----


def wf_fails(workflow_id: str, every: int | None = None) -> bool:
    """Saga workflows whose third forward activity fails permanently (so they unwind):
    a deterministic fraction, one in ``wf_fail_every`` (default 3), by a hash of the id."""
    n = every if every is not None else int(CONFIG.get("wf_fail_every", 3))
    return n > 0 and slot_hash("wf", workflow_id) % n == 0


def wf_transient(workflow_id: str, action: str) -> bool:
    """Workflow activities whose attempt 1 raises ``ConnectionError`` after writing its
    effect (rolled back, retried): one in five, by a hash of ``(workflow id, action)``."""
    return slot_hash(workflow_id, action) % 5 == 1


def wf_activity_body(run: Any, workflow_id: str, action: str) -> str:
    """The effect of one workflow activity or compensation (``run`` is the
    ``IdempotentTask``): an effect row ``(workflow_id, action, run_key, ...)`` written in the
    run's completing transaction, with its result declared there.

    ``fwd3`` of a saga in the :func:`wf_fails` fraction raises ``PermanentError`` (no
    effect: it dead-letters and the saga unwinds); a :func:`wf_transient` activity raises
    ``ConnectionError`` on attempt 1, inside the transaction, after its write."""
    if action == "fwd3" and wf_fails(workflow_id):
        raise PermanentError(f"injected permanent failure of {workflow_id} {action}")
    with run.transaction() as tx:
        tx.execute(insert(wf_effects).values(
            workflow_id=workflow_id, action=action, run_key=run.idempotency_key,
            fence_token=run.fence_token, attempt=run.attempt, pid=os.getpid(),
        ))
        if run.attempt == 1 and wf_transient(workflow_id, action):
            raise ConnectionError(
                f"injected transient failure of {workflow_id} {action} (attempt 1)")
        run.returns(action)
    return action
