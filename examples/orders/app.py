"""The orders Celery app: a beat places orders, a workflow fulfils each one.

* ``orders.place`` (a beat entry, every 2 s in the demo): places ``ORDERS_PER_SLOT`` orders
  for its slot. Each order row and the start of its workflow commit in ONE transaction with
  the run's idempotency key (transactional start), so a slot places its orders once,
  whatever the beats and workers do.
* ``orders.fulfil`` (the workflow)::

      with ctx.saga() as saga:
          saga.compensate(cancel_authorization, order_id)   # recorded BEFORE the step
          ctx.activity(authorize_payment, order_id, cents)
          saga.compensate(release_inventory, order_id)
          ctx.activity(reserve_inventory, order_id, sku)
          ctx.sleep(hold)                                   # durable timer (24 h in prod)
          ctx.activity(capture_payment, order_id)           # + the receipt, via the outbox

  A capture the card issuer declines (deterministically, one order in four here) fails
  permanently: the saga releases the inventory, then cancels the authorization. An
  authorization it declines (one in eight) unwinds too: ``cancel_authorization`` then finds
  nothing to cancel and writes a tombstone (compensations tolerate "nothing to undo").

Every activity writes its effect and an ``effects`` row (order, action) in one transaction
with its idempotency key; the report counts those rows: each effect exactly once. The
compensations are safe to repeat and tolerate "nothing to undo": cancelling an authorization
that was never made writes a ``cancelled`` tombstone so a late authorization cannot take
hold; releasing a reservation that was never made changes nothing.

Environment (the runner in ``__main__`` sets it): ``RELIABLE_BEAT_DATABASE_URL``,
``ORDERS_BROKER_URL`` (default: a filesystem broker under ``ORDERS_DIR``),
``ORDERS_WEBHOOK_URL`` (where receipts go), ``ORDERS_HOLD_SECONDS`` (default 86400: 24 h),
``ORDERS_PER_SLOT`` (default 2), ``ORDERS_SCHEDULE`` (cron, default every 2 s),
``ORDERS_QUEUE`` (the queue of every message, default ``celery``).
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
    select,
    update,
)

from reliable_beat import IdempotentTask
from reliable_beat.workflows import WorkflowContext, workflow

WORKDIR = Path(os.environ.get("ORDERS_DIR", ".orders-demo")).resolve()
DATABASE_URL = os.environ.get(
    "RELIABLE_BEAT_DATABASE_URL", f"sqlite:///{WORKDIR / 'orders.sqlite3'}"
)
BROKER_URL = os.environ.get("ORDERS_BROKER_URL", "filesystem://")
WEBHOOK_URL = os.environ.get("ORDERS_WEBHOOK_URL", "http://127.0.0.1:8766/receipts")
HOLD_SECONDS = float(os.environ.get("ORDERS_HOLD_SECONDS", str(24 * 3600)))
PER_SLOT = int(os.environ.get("ORDERS_PER_SLOT", "2"))
SKUS = {"mug": 1_000, "tee": 1_000}  # initial stock
_hook = urlsplit(WEBHOOK_URL)

app = Celery("orders", broker=BROKER_URL)
app.conf.update(
    beat_scheduler="reliable_beat.ReliableScheduler",
    reliable_beat_database_url=DATABASE_URL,
    reliable_beat_webhook_destinations={
        "receipts": {"base_url": f"{_hook.scheme}://{_hook.netloc}"}},
    reliable_beat_lease_seconds=float(os.environ.get("ORDERS_LEASE_SECONDS", "10")),
    reliable_beat_redispatch_seconds=20.0,  # above the 15 s visibility timeout below
    reliable_beat_retry_base_seconds=0.5,
    reliable_beat_retry_cap_seconds=5.0,
    beat_max_loop_interval=5,
    task_default_queue=os.environ.get("ORDERS_QUEUE", "celery"),
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 15, "unacked_restore_interval": 1,
                              "unacked_restore_throttle": 1, "unacked_mutex_expire": 5},
    beat_schedule={
        "place-orders": {
            "task": "orders.place",
            "schedule": os.environ.get("ORDERS_SCHEDULE", "* * * * * */2"),
            "options": {"reliable_beat": {"misfire_policy": "catch_up",
                                          "catch_up_limit": 50}},
        }
    },
)
if BROKER_URL == "filesystem://":
    broker_dir = WORKDIR / "broker"
    app.conf.broker_transport_options = {
        "data_folder_in": str(broker_dir), "data_folder_out": str(broker_dir),
        "control_folder": str(broker_dir / "control"),  # not ./control in the cwd
        "store_processed": False,
    }

# -- the shop's own tables, in the same database as reliable_beat's ----------------------
metadata = MetaData()
orders = Table(
    "orders", metadata,
    Column("order_id", String(100), primary_key=True),
    Column("sku", String(20), nullable=False),
    Column("cents", BigInteger, nullable=False),
)
payments = Table(  # one row per order: authorized -> captured | cancelled
    "payments", metadata,
    Column("order_id", String(100), primary_key=True),
    Column("state", String(20), nullable=False),
    Column("cents", BigInteger, nullable=False),
)
stock = Table(
    "stock", metadata,
    Column("sku", String(20), primary_key=True),
    Column("on_hand", Integer, nullable=False),
)
reservations = Table(  # held -> released (or stays held: shipped with the capture)
    "reservations", metadata,
    Column("order_id", String(100), primary_key=True),
    Column("sku", String(20), nullable=False),
    Column("state", String(20), nullable=False),
)
effects = Table(  # one row per effect that happened: the report counts them
    "order_effects", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("order_id", String(100), nullable=False),
    Column("action", String(40), nullable=False),
)


def create_app_tables() -> None:
    """Create the example's own tables and the initial stock (an app has migrations)."""
    engine = create_engine(DATABASE_URL)
    metadata.create_all(engine)
    with engine.begin() as conn:
        if not conn.execute(select(stock.c.sku)).first():
            conn.execute(insert(stock), [{"sku": s, "on_hand": n} for s, n in SKUS.items()])
    engine.dispose()


def declines_capture(order_id: str) -> bool:
    """The card issuer declines one capture in four (deterministic, for the report)."""
    return hashlib.sha256(order_id.encode()).digest()[0] % 4 == 0


def declines_authorization(order_id: str) -> bool:
    """... and one authorization in eight: the unwind then has nothing to undo."""
    return hashlib.sha256(order_id.encode()).digest()[1] % 8 == 0


def _effect(tx: Any, order_id: str, action: str) -> None:
    tx.execute(insert(effects).values(order_id=order_id, action=action))


# -- activities: IdempotentTasks, keyed by the workflow (wf:<order>/<run>#<seq>) ----------


@app.task(base=IdempotentTask, bind=True, name="orders.authorize_payment")
def authorize_payment(self: Any, order_id: str, cents: int) -> str:
    """Authorize ``cents``; a no-op if the authorization was already cancelled (a late
    authorization racing its cancellation never takes hold)."""
    if declines_authorization(order_id):
        raise ValueError(f"{order_id}: authorization declined by the issuer")  # permanent
    with self.transaction() as tx:
        row = tx.execute(select(payments.c.state)
                         .where(payments.c.order_id == order_id)).first()
        if row is None:
            tx.execute(insert(payments).values(order_id=order_id, state="authorized",
                                               cents=cents))
            _effect(tx, order_id, "authorize")
            outcome = "authorized"
        else:
            outcome = f"not authorized: payment already {row.state}"
        self.returns(outcome)
    return outcome


@app.task(base=IdempotentTask, bind=True, name="orders.reserve_inventory")
def reserve_inventory(self: Any, order_id: str, sku: str) -> str:
    with self.transaction() as tx:
        tx.execute(update(stock).where(stock.c.sku == sku)
                   .values(on_hand=stock.c.on_hand - 1))
        tx.execute(insert(reservations).values(order_id=order_id, sku=sku, state="held"))
        _effect(tx, order_id, "reserve")
        self.returns("reserved")
    return "reserved"


@app.task(base=IdempotentTask, bind=True, name="orders.capture_payment")
def capture_payment(self: Any, order_id: str) -> str:
    """Capture the authorized payment and send the receipt (outbox, same transaction)."""
    if declines_capture(order_id):
        raise ValueError(f"{order_id}: capture declined by the issuer")  # permanent
    with self.transaction() as tx:
        done = tx.execute(update(payments)
                          .where(payments.c.order_id == order_id,
                                 payments.c.state == "authorized")
                          .values(state="captured")).rowcount
        if done != 1:
            raise ValueError(f"{order_id}: nothing authorized to capture")
        _effect(tx, order_id, "capture")
        self.outbox.add(tx, "webhook", {"destination": "receipts",
                                        "path": _hook.path or "/",
                                        "body": {"order_id": order_id, "receipt": True}})
        self.returns("captured")
    return "captured"


@app.task(base=IdempotentTask, bind=True, name="orders.release_inventory")
def release_inventory(self: Any, order_id: str) -> str:
    """Compensation: release a held reservation. Safe to repeat; nothing held: no-op."""
    with self.transaction() as tx:
        row = tx.execute(select(reservations.c.sku).where(
            reservations.c.order_id == order_id, reservations.c.state == "held")).first()
        if row is None:
            outcome = "nothing to release"
        else:
            tx.execute(update(reservations).where(reservations.c.order_id == order_id)
                       .values(state="released"))
            tx.execute(update(stock).where(stock.c.sku == row.sku)
                       .values(on_hand=stock.c.on_hand + 1))
            _effect(tx, order_id, "release")
            outcome = "released"
        self.returns(outcome)
    return outcome


@app.task(base=IdempotentTask, bind=True, name="orders.cancel_authorization")
def cancel_authorization(self: Any, order_id: str) -> str:
    """Compensation: cancel the authorization. Safe to repeat; none made yet: a tombstone,
    so an authorization arriving late is refused."""
    with self.transaction() as tx:
        row = tx.execute(select(payments.c.state)
                         .where(payments.c.order_id == order_id)).first()
        if row is None:
            tx.execute(insert(payments).values(order_id=order_id, state="cancelled", cents=0))
            outcome = "nothing to cancel (tombstone written)"
        elif row.state == "authorized":
            tx.execute(update(payments).where(payments.c.order_id == order_id)
                       .values(state="cancelled"))
            _effect(tx, order_id, "cancel_authorization")
            outcome = "cancelled"
        else:
            outcome = f"nothing to cancel: payment {row.state}"
        self.returns(outcome)
    return outcome


# -- the workflow -------------------------------------------------------------------------


@workflow(app, name="orders.fulfil")
def fulfil(ctx: WorkflowContext, order_id: str, sku: str, cents: int,
           hold_seconds: float) -> dict[str, Any]:
    with ctx.saga() as saga:
        saga.compensate(cancel_authorization, order_id)
        ctx.activity(authorize_payment, order_id, cents)
        saga.compensate(release_inventory, order_id)
        ctx.activity(reserve_inventory, order_id, sku)
        ctx.sleep(timedelta(seconds=hold_seconds))  # 24 h in production: a row, no worker
        ctx.activity(capture_payment, order_id)
    return {"order_id": order_id, "state": "captured"}


@app.task(base=IdempotentTask, bind=True, name="orders.place")
def place(self: Any) -> int:
    """Place this slot's orders: each order row and its workflow's start commit together."""
    slot = self.idempotency_key.rsplit("@", 1)[-1]
    with self.transaction() as tx:
        for i in range(PER_SLOT):
            order_id = f"order-{slot}-{i}"
            sku = sorted(SKUS)[i % len(SKUS)]
            tx.execute(insert(orders).values(order_id=order_id, sku=sku, cents=1500 + i))
            fulfil.start(order_id, args=(order_id, sku, 1500 + i, HOLD_SECONDS), conn=tx)
    return PER_SLOT
