"""Dramatiq app used by the Dramatiq acceptance tests' real ``dramatiq`` worker and
``reliable-beat dramatiq beat`` processes. Imports neither Celery nor kombu.

Configured from the environment (set by the tests): ``RB_BROKER_URL`` (Redis, or RabbitMQ
with an ``amqp://`` URL: ``RabbitmqBroker(confirm_delivery=True)``),
``RB_DATABASE_URL`` (the PostgreSQL store), ``RB_NAMESPACE`` (a Redis namespace per test,
so leftovers never leak between tests), ``RB_QUEUE`` (the actors' queue), ``RB_PERIOD``
(seconds between slots of the periodic actor; unset: no periodic entry), ``RB_CLAIM_AHEAD``
(``claim_ahead_seconds``), ``RB_PAUSE_AFTER_CLAIM_AHEAD`` (tests/apps/pause_hook.py),
``RB_REDISPATCH_SECONDS`` (``redispatch_seconds``), ``RB_RETRY_OPTION`` (``retry_when`` or
``throws``: declare an actor with that refused Dramatiq retry option).

The broker's ``heartbeat_timeout`` is 3 s and maintenance runs on every command, so the
message of a SIGKILLed worker comes back within seconds (defaults: 60 s and 0.1 %).
"""

from __future__ import annotations

import os
import time

import dramatiq
import sqlalchemy as sa
from dramatiq.brokers.redis import RedisBroker

from reliable_beat.dramatiq import IdempotentActor, ReliableBeat, current

meta = sa.MetaData()
effects = sa.Table(
    "test_effects", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("run_id", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)
progress = sa.Table(
    "test_progress", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("fence", sa.Integer, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("what", sa.String(50), nullable=False),
)

BROKER_URL = os.environ.get("RB_BROKER_URL", "redis://localhost:6379/0")
broker: dramatiq.Broker
if BROKER_URL.startswith("amqp"):
    # RabbitMQ (--broker rabbitmq): publisher confirms, so a trigger marked sent is in the
    # broker; a killed worker's unacked deliveries come back when its connection drops.
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    from reliable_beat.dramatiq import rabbitmq_url

    broker = RabbitmqBroker(url=rabbitmq_url(BROKER_URL), confirm_delivery=True)
else:
    broker = RedisBroker(url=BROKER_URL, namespace=os.environ.get("RB_NAMESPACE", "dramatiq"),
                         heartbeat_timeout=3000, maintenance_chance=1_000_000)
#: ``RB_MANUAL_ENTRIES``: entries for ``reliable-beat dramatiq entries trigger|backfill``
#: (hourly, so no slot of them is due while a test runs, except by hand).
SCHEDULE = {
    "manual_effect": {"actor": "write_effect", "schedule": "0 * * * *", "args": ["manual"]},
    "expiring": {"actor": "write_effect", "schedule": "0 * * * *", "args": ["expiring"],
                 "options": {"expires": 2}},
} if os.environ.get("RB_MANUAL_ENTRIES") else {}
broker.add_middleware(ReliableBeat(schedule=SCHEDULE, settings={
    "database_url": os.environ.get("RB_DATABASE_URL", "sqlite:///rb-dq-test.sqlite3"),
    "lease_seconds": float(os.environ.get("RB_LEASE_SECONDS", "2")),
    "retry_max_attempts": 4,
    "retry_base_seconds": 1.0,
    "retry_cap_seconds": 2.0,
    **({"claim_ahead_seconds": float(os.environ["RB_CLAIM_AHEAD"])}
       if os.environ.get("RB_CLAIM_AHEAD") else {}),
    **({"redispatch_seconds": float(os.environ["RB_REDISPATCH_SECONDS"])}
       if os.environ.get("RB_REDISPATCH_SECONDS") else {}),
}))
dramatiq.set_broker(broker)
if os.environ.get("RB_PAUSE_AFTER_CLAIM_AHEAD"):
    import pause_hook  # noqa: F401  (tests/apps: patches the beat's claim; see its docstring)
QUEUE = os.environ.get("RB_QUEUE", "default")
PERIOD = os.environ.get("RB_PERIOD")


def _mark(what: str) -> None:
    rb = current()
    with rb.state.store.begin() as conn:
        conn.execute(progress.insert().values(
            key=rb.idempotency_key, fence=rb.fence_token, attempt=rb.attempt,
            pid=os.getpid(), what=what))


def _effect() -> None:
    rb = current()
    with rb.transaction() as tx:
        tx.execute(effects.insert().values(key=rb.idempotency_key, fence=rb.fence_token,
                                           run_id=rb.run_id, pid=os.getpid()))


@dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="write_effect",
                idempotency_key=lambda name, **_: f"effect:{name}")
def write_effect(name: str, sleep_first_attempt: float = 0.0, sleep: float = 0.0) -> str:
    """One effect row per run, written with the run's fence in the run's transaction."""
    _mark("start")
    if current().attempt == 1 and sleep_first_attempt:
        time.sleep(sleep_first_attempt)
    elif sleep:
        time.sleep(sleep)
    _effect()
    return name


@dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="flaky")
def flaky(name: str, transient_failures: int, then_permanent: bool = False) -> None:
    """Fails with ConnectionError on the first ``transient_failures`` tries, then (with
    ``then_permanent``) with ValueError, else writes its effect."""
    _mark("start")
    if current().attempt <= transient_failures:
        raise ConnectionError(f"{name}: transient failure {current().attempt}")
    if then_permanent:
        raise ValueError(f"{name}: permanent failure")
    _effect()


@dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE,
                actor_name="permanent_unless_file_gone")
def permanent_unless_file_gone(name: str, flag_file: str) -> None:
    """PermanentError while ``flag_file`` exists; else one effect (the requeue proof)."""
    from pathlib import Path

    from reliable_beat.errors import PermanentError

    _mark("start")
    if Path(flag_file).exists():
        raise PermanentError(f"{flag_file} says no")
    _effect()


@dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="slow",
                time_limit=1000)
def slow(name: str) -> None:
    """Sleeps past its 1 s Dramatiq time limit on the first try, then writes its effect."""
    _mark("start")
    if current().attempt == 1:
        for _ in range(300):  # short sleeps: an async interrupt lands between bytecodes
            time.sleep(0.1)
    _effect()


@dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="fan_out")
def fan_out(name: str) -> None:
    """Commits, with its run, an outbox row to the ``dramatiq`` destination asking for
    ``write_effect(name)``: the relay delivers it."""
    rb = current()
    with rb.transaction() as tx:
        rb.outbox.add(tx, "dramatiq", {"actor": "write_effect", "args": [name]})


@dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="asks_retry")
def asks_retry(name: str, times: int, delay_ms: int) -> None:
    """Raises ``dramatiq.Retry(delay=delay_ms)`` on its first ``times`` tries, then writes
    its effect."""
    _mark("start")
    if current().attempt <= times:
        raise dramatiq.Retry(delay=delay_ms)
    _effect()


@dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="throws_key_error",
                throws=(KeyError,))
def throws_key_error(name: str) -> None:
    """Raises KeyError, listed in its ``throws``: never retried (Dramatiq's meaning)."""
    _mark("start")
    raise KeyError(name)


if os.environ.get("RB_RETRY_OPTION"):
    _refused: dict[str, object] = (
        {"retry_when": lambda retries, exc: retries < 1}
        if os.environ["RB_RETRY_OPTION"] == "retry_when" else {"throws": (Exception,)})

    @dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="bad_retry",
                    **_refused)
    def bad_retry() -> None:
        """Declared with a Dramatiq retry option that would drop our retries: refused."""


if PERIOD:
    @dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="tick",
                    periodic=float(PERIOD), reliable_beat={"misfire_policy": "skip"})
    def tick() -> None:
        """The periodic actor: one effect per slot (the key is the slot's)."""
        _effect()


if os.environ.get("RB_BAD_PERIODIC"):
    @dramatiq.actor(actor_class=IdempotentActor, queue_name=QUEUE, actor_name="bad_cron",
                    periodic="61 * * * *")
    def bad_cron() -> None:
        """A periodic actor whose cron cannot be valid: the beat refuses to start."""
