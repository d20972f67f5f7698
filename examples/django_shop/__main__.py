"""Run the Django shop example end to end and print a report.

    python -m examples.django_shop                      # private PostgreSQL + Redis
    python -m examples.django_shop --break-it           # SIGKILL / SIGSTOP beats and workers
    python -m examples.django_shop --database-url postgresql+psycopg://... --broker-url redis://...

A Django project (``examples/django_shop``) whose ``IdempotentTask`` pays merchants through
the ORM inside ``self.transaction(using="default")`` and notifies them by webhook through the
outbox. ``manage.py migrate`` alone creates every table (Django's, the shop's, reliable_beat's).
Then two beats, two workers (prefork) and a relay (``manage.py reliable_beat relay``) run for
``--seconds``; the beats stop; workers and relay drain; the report counts payouts per
(merchant, slot) and webhook deliveries. Exit status 1 if any merchant was paid twice or not
at all for a fired slot, or a notification was lost.
"""

from __future__ import annotations

import argparse
import functools
import random
import subprocess
import sys
from collections import Counter
from contextlib import ExitStack

from examples._demo import (
    ROOT,
    Procs,
    Sink,
    break_it,
    demo_env,
    fresh_workdir,
    private_servers,
    run_then_settle,
    runs_in_flight,
    wait_idle,
)

SETTINGS = "examples.django_shop.shop.settings"


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "examples.django_shop.shop.celery", *args]


def manage(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / "django_shop" / "manage.py"), *args]


def report(store_url: str, sink: Sink, procs: Procs, seconds: float) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(store_url)
    merchants = ["acme", "globex", "initech"]
    with engine.connect() as conn:
        slots = sorted(r[0].strftime("%Y-%m-%dT%H:%M:%SZ") for r in conn.execute(text(
            "SELECT fire_at FROM reliable_beat_runs WHERE entry_name = 'pay-merchants' "
            "AND state <> 'skipped'")))
        per = Counter((m, s) for m, s in conn.execute(text(
            "SELECT merchant, slot FROM payouts_payout")))
        ledger = conn.execute(text(
            "SELECT COALESCE(SUM(delta_cents), 0) FROM payouts_ledgerline")).scalar_one()
        outcomes = Counter(o for (o,) in conn.execute(text(
            "SELECT outcome FROM reliable_beat_attempts")))
        pending = conn.execute(text(
            "SELECT count(*) FROM reliable_beat_outbox WHERE state = 'pending'")).scalar_one()
    engine.dispose()
    missing = [(m, s) for s in slots for m in merchants if per[(m, s)] == 0]
    doubled = [k for k, n in per.items() if n > 1]
    delivered = len({k for k, _ in sink.requests})
    lines = [
        "", f"django shop report ({seconds:.0f} s)", "",
        "| what | count |", "|---|---|",
        f"| slots fired | {len(slots)} |",
        f"| merchants x slots expected | {len(slots) * len(merchants)} |",
        f"| payouts written (ORM) | {sum(per.values())} |",
        f"| merchant/slot pairs paid exactly once | {sum(1 for n in per.values() if n == 1)} |",
        f"| paid twice | {len(doubled)} |",
        f"| missing (fired slot, merchant unpaid) | {len(missing)} |",
        f"| ledger balance (must be 0) | {ledger} |",
        f"| notifications delivered (distinct keys) | {delivered} of {len(per)} |",
        f"| outbox rows still pending | {pending} |",
        f"| attempts by outcome | {dict(outcomes)} |",
    ]
    if procs.faults:
        lines.append(f"| faults injected | {dict(procs.faults)} |")
    print("\n".join(lines))
    ok = bool(slots) and not doubled and not missing and ledger == 0 and delivered == len(per)
    print("\nRESULT:", "OK: every fired slot paid each merchant exactly once" if ok
          else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.django_shop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the beats run")
    ap.add_argument("--database-url", default=None,
                    help="PostgreSQL (SQLAlchemy URL); default: a private server")
    ap.add_argument("--broker-url", default=None, help="Redis; default: a private server")
    ap.add_argument("--break-it", action="store_true",
                    help="SIGKILL and SIGSTOP beats and workers during the run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=str(ROOT / ".django-shop-demo"))
    args = ap.parse_args(argv)

    workdir = fresh_workdir(args.workdir)
    sink = Sink()
    env = demo_env(DJANGO_SETTINGS_MODULE=SETTINGS, SHOP_WEBHOOK_URL=sink.url)
    if args.break_it:
        env.setdefault("SHOP_BODY_SECONDS", "1.5")
    with ExitStack() as stack:
        db_url, broker = private_servers(stack, args.database_url, args.broker_url)
        env.update(SHOP_DATABASE_URL=db_url, SHOP_BROKER_URL=broker)
        # manage.py migrate is enough: Django's tables, the shop's, reliable_beat's (Alembic)
        subprocess.run(manage("migrate", "-v", "0"), env=env, cwd=ROOT, check=True)
        procs = Procs(env, workdir / "logs")
        stack.callback(procs.stop_all)
        for i in range(2):
            procs.start(f"worker{i}", celery("worker", "--pool", "prefork", "-c", "1",
                                             "-l", "warning", "-n", f"w{i}@%h",
                                             "--without-gossip", "--without-mingle",
                                             "--without-heartbeat"))
        procs.start("relay", manage("reliable_beat", "relay"))
        for i in range(2):
            procs.start(f"beat{i}", celery("beat", "-l", "warning", "-s",
                                           str(workdir / f"beat{i}-unused")))
        print(f"running 2 beats, 2 workers and a relay for {args.seconds:.0f} s "
              f"(logs in {workdir / 'logs'}) ...", flush=True)
        faults = (functools.partial(break_it, procs, rng=random.Random(args.seed))
                  if args.break_it else None)
        run_then_settle(procs, args.seconds, faults=faults)
        store_url = subprocess.run(
            [sys.executable, "-c", "from reliable_beat.contrib.django import database_url;"
             "print(database_url())"], env=env, cwd=ROOT, check=True, capture_output=True,
            text=True).stdout.strip()
        wait_idle(store_url, 120, runs_in_flight)
        procs.stop_all()
        return report(store_url, sink, procs, args.seconds)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
