"""Run the orders example end to end and print a report.

    python -m examples.orders                    # embedded: SQLite store, filesystem broker
    python -m examples.orders --server           # private PostgreSQL + Redis (local binaries)
    python -m examples.orders --server --break-it   # SIGKILL / SIGSTOP workers, beats, relays

Starts two beats (they place orders every 2 s), workers and relays as real processes, plus a
local webhook endpoint that records every receipt; places orders for ``--seconds``; stops the
beats; lets everything drain (each order waits ``--hold-seconds`` on its durable timer, the
demo's stand-in for 24 h); prints the report; exits non-zero if any effect happened twice or
is missing, any order is left half-done, or a receipt was lost.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack

from sqlalchemy.engine import Connection

from examples._demo import (
    ROOT,
    Procs,
    Sink,
    break_it,
    demo_env,
    fresh_workdir,
    private_servers,
    run_then_settle,
    wait_idle,
)

APP = "examples.orders.app"

#: The effects each outcome must show exactly once (and no other).
COMPLETED = {"authorize": 1, "reserve": 1, "capture": 1}
COMPENSATED = {"authorize": 1, "reserve": 1, "release": 1, "cancel_authorization": 1}
DECLINED: dict[str, int] = {}  # authorization declined: nothing happened, nothing to undo


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", APP, *args]


def relay() -> list[str]:
    return [sys.executable, "-m", "reliable_beat.cli", "-A", APP, "relay"]


def _in_flight(conn: Connection) -> int:
    """Workflows not yet ended plus pending outbox rows."""
    from sqlalchemy import func, select

    from reliable_beat.db.tables import outbox, workflows

    live = conn.execute(select(func.count()).where(
        workflows.c.state.in_(("pending", "running", "waiting")))).scalar_one()
    pending = conn.execute(select(func.count()).where(outbox.c.state == "pending")
                           ).scalar_one()
    return int(live) + int(pending)


def report(env: dict[str, str], sink: Sink, procs: Procs, seconds: float) -> int:
    from sqlalchemy import create_engine, select

    from examples.orders.app import (
        SKUS,
        declines_authorization,
        declines_capture,
        effects,
        orders,
        payments,
        reservations,
        stock,
    )
    from reliable_beat.db.tables import outbox, workflows

    engine = create_engine(env["RELIABLE_BEAT_DATABASE_URL"])
    with engine.connect() as conn:
        placed = [r.order_id for r in conn.execute(select(orders.c.order_id))]
        wf_state = dict(conn.execute(select(workflows.c.workflow_id, workflows.c.state)).all())
        eff = Counter((o, a) for o, a in conn.execute(select(effects.c.order_id,
                                                             effects.c.action)))
        pay = dict(conn.execute(select(payments.c.order_id, payments.c.state)).all())
        held = dict(conn.execute(select(reservations.c.order_id, reservations.c.state)).all())
        on_hand = dict(conn.execute(select(stock.c.sku, stock.c.on_hand)).all())
        pending = conn.execute(select(outbox.c.id).where(outbox.c.state == "pending")).all()
    engine.dispose()
    states = Counter(wf_state.get(o, "missing") for o in placed)
    twice = [k for k, n in eff.items() if n > 1]
    missing: list[tuple[str, str]] = []
    half_done: list[str] = []
    for o in placed:
        state = wf_state.get(o)
        refused = declines_authorization(o)
        want = (COMPLETED if state == "completed" else DECLINED if refused
                else COMPENSATED if state == "failed" else {})
        missing += [(o, a) for a in want if eff[(o, a)] == 0]
        missing += [(o, a) for (oo, a) in eff if oo == o and a not in want]  # stray effect
        if state == "completed":
            ok = pay.get(o) == "captured" and held.get(o) == "held"
        elif state == "failed" and refused:  # the tombstone, no reservation
            ok = pay.get(o) == "cancelled" and held.get(o) is None
        elif state == "failed":
            ok = (pay.get(o) == "cancelled" and held.get(o) == "released"
                  and declines_capture(o))
        else:
            ok = False
        if not ok:
            half_done.append(f"{o}: workflow {state}, payment {pay.get(o)}, "
                             f"reservation {held.get(o)}")
    declined = [o for o in placed if wf_state.get(o) == "failed" and declines_authorization(o)]
    shipped = sum(1 for s in held.values() if s == "held")
    stock_ok = sum(on_hand.values()) + shipped == sum(SKUS.values())
    receipts = Counter(body.get("order_id") for _, body in sink.requests)
    completed = [o for o in placed if wf_state.get(o) == "completed"]
    receipts_ok = all(receipts[o] >= 1 for o in completed) and set(receipts) <= set(completed)
    keys = Counter(k for k, _ in sink.requests)
    lines = [
        "",
        f"orders demo report ({seconds:.0f} s of orders, store "
        f"{env['RELIABLE_BEAT_DATABASE_URL'].split('@')[-1]})",
        "",
        "| what | count |",
        "|---|---|",
        f"| orders placed | {len(placed)} |",
        f"| workflows by state | {dict(states)} |",
        f"| orders completed (authorized, reserved, captured, receipt sent) | "
        f"{states['completed']} |",
        f"| orders compensated (capture declined: inventory released, authorization "
        f"cancelled) | {states['failed'] - len(declined)} |",
        f"| orders declined at authorization (unwound, nothing to undo: tombstone) | "
        f"{len(declined)} |",
        f"| effects applied | {sum(eff.values())} |",
        f"| effects applied twice | {len(twice)} |",
        f"| effects missing or stray | {len(missing)} |",
        f"| orders left half-done | {len(half_done)} |",
        f"| stock balance (on hand + shipped = initial) | "
        f"{'ok' if stock_ok else 'WRONG'} |",
        f"| receipts delivered (distinct orders) | {len(receipts)} of {len(completed)} |",
        f"| receipt requests in all (duplicates collapse on the key) | {len(sink.requests)}"
        f" ({len(keys)} keys) |",
        f"| outbox rows still pending | {len(pending)} |",
    ]
    if procs.faults:
        lines.append(f"| faults injected | {dict(procs.faults)} |")
    print("\n".join(lines))
    for problem in (twice[:5] + missing[:5] + half_done[:5]):
        print("PROBLEM:", problem)
    ok = (bool(placed) and not twice and not missing and not half_done and stock_ok
          and receipts_ok and states["completed"] > 0)
    print("\nRESULT:", "OK: every order completed or compensated, each effect exactly once"
          if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.orders", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long orders are placed")
    ap.add_argument("--hold-seconds", type=float, default=3.0,
                    help="the durable timer between reserve and capture (production: 86400)")
    ap.add_argument("--server", action="store_true",
                    help="PostgreSQL + Redis (private servers from the local binaries, or "
                         "--database-url / --broker-url)")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--broker-url", default=None)
    ap.add_argument("--break-it", action="store_true",
                    help="SIGKILL and SIGSTOP workers, beats and relays during the run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--drain-seconds", type=float, default=180.0)
    ap.add_argument("--workdir", default=str(ROOT / ".orders-demo"))
    args = ap.parse_args(argv)

    workdir = fresh_workdir(args.workdir, "broker")
    sink = Sink()
    env = demo_env(ORDERS_DIR=str(workdir), ORDERS_WEBHOOK_URL=sink.url,
                   ORDERS_HOLD_SECONDS=str(args.hold_seconds),
                   ORDERS_QUEUE=os.environ.get("ORDERS_QUEUE", f"orders-{os.getpid()}"))
    with ExitStack() as stack:
        if args.server:
            db_url, broker = private_servers(stack, args.database_url, args.broker_url)
            env.update(RELIABLE_BEAT_DATABASE_URL=db_url, ORDERS_BROKER_URL=broker)
        else:
            env["RELIABLE_BEAT_DATABASE_URL"] = f"sqlite:///{workdir / 'orders.sqlite3'}"
        subprocess.run([sys.executable, "-m", "reliable_beat.cli", "-A", APP, "db", "upgrade"],
                       env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-c",
                        "from examples.orders.app import create_app_tables; "
                        "create_app_tables()"], env=env, cwd=ROOT, check=True)
        procs = Procs(env, workdir / "logs")
        stack.callback(procs.stop_all)
        n = 2 if args.server else 1
        for i in range(n):
            procs.start(f"worker{i}", celery("worker", "--pool", "solo", "-l", "warning",
                                             "-n", f"w{i}@%h", "--without-gossip",
                                             "--without-mingle", "--without-heartbeat"))
            procs.start(f"relay{i}", relay())
        for i in range(2):
            procs.start(f"beat{i}", celery("beat", "-l", "warning", "-s",
                                           str(workdir / f"beat{i}-unused")))
        print(f"placing orders for {args.seconds:.0f} s with 2 beats, {n} worker(s) and {n} "
              f"relay(s); each order holds {args.hold_seconds:g} s on its durable timer "
              f"(logs in {workdir / 'logs'}) ...", flush=True)
        # every few seconds SIGKILL or SIGSTOP any worker, beat or relay
        faults = (functools.partial(break_it, procs, rng=random.Random(args.seed), victims=None,
                                    gap=(2, 5), pause=(3, 12), quiet=6)
                  if args.break_it else None)
        run_then_settle(procs, args.seconds, faults=faults, faults_tail=6,
                        restart=("worker", "relay"))
        wait_idle(env["RELIABLE_BEAT_DATABASE_URL"], args.drain_seconds, _in_flight)
        time.sleep(1.0)  # the last receipts' HTTP requests
        procs.stop_all()
        return report(env, sink, procs, args.seconds)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
