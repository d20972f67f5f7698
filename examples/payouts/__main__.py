"""Run the payouts example end to end and print a report.

    python -m examples.payouts                 # embedded: SQLite store, SQLite-file broker
    python -m examples.payouts --server        # private PostgreSQL + Redis (local binaries)
    python -m examples.payouts --server --break-it   # SIGKILL / SIGSTOP beats and workers
    python -m examples.payouts --framework dramatiq  # on Dramatiq (SQLite store, private Redis)
    python -m examples.payouts --framework dramatiq --server --break-it

Starts two beats, a worker (two in --server mode) and a relay as real processes, plus a local
webhook endpoint that records every notification; runs for ``--seconds``; stops the beats;
lets the workers and the relay drain; prints the report; exits non-zero if any merchant was
paid twice or not at all for a fired slot, or a notification was lost.

``--framework dramatiq`` runs the same entry, body and report with the Dramatiq adapter
(``reliable-beat dramatiq beat|relay`` and ``dramatiq`` worker processes). Dramatiq has no
broker that works across processes without a server (its ``StubBroker`` lives in one
process), so the embedded mode starts a private ``redis-server`` from the local binary
(SQLite store as for Celery) and says so; without ``redis-server`` on PATH it stops with what
to install, or takes ``--broker-url``.
"""

from __future__ import annotations

import argparse
import functools
import random
import shutil
import subprocess
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

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


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "examples.payouts.app", *args]


def dramatiq_cmds(workers: int) -> dict[str, list[str]]:
    """The Dramatiq processes: ``workers`` workers (one process, one thread each), a relay
    and two beats."""
    rb = [sys.executable, "-m", "reliable_beat.cli", "dramatiq"]
    spec = "examples.payouts.dq_app:broker"
    cmds = {f"worker{i}": [sys.executable, "-m", "dramatiq", "examples.payouts.dq_app",
                           "-p", "1", "-t", "1", "-Q", "payouts"] for i in range(workers)}
    cmds["relay"] = [*rb, "relay", "--broker", spec, "--loglevel", "WARNING"]
    for i in range(2):
        cmds[f"beat{i}"] = [*rb, "beat", "--broker", spec, "--loglevel", "WARNING"]
    return cmds


def celery_cmds(workers: int, workdir: Path) -> dict[str, list[str]]:
    cmds = {f"worker{i}": celery("worker", "--pool", "solo", "-l", "warning", "-n", f"w{i}@%h",
                                 "--without-gossip", "--without-mingle", "--without-heartbeat")
            for i in range(workers)}
    cmds["relay"] = [sys.executable, "-m", "reliable_beat.cli", "-A", "examples.payouts.app",
                     "relay"]
    for i in range(2):
        cmds[f"beat{i}"] = celery("beat", "-l", "warning", "-s", str(workdir / f"beat{i}-unused"))
    return cmds


def report(env: dict[str, str], sink: Sink, procs: Procs, seconds: float) -> int:
    from sqlalchemy import create_engine, func, select

    from reliable_beat.db.tables import attempts, outbox, runs
    sys.path.insert(0, str(ROOT))
    engine = create_engine(env["RELIABLE_BEAT_DATABASE_URL"])
    from examples.payouts.ledger import MERCHANTS, ledger, payouts

    with engine.connect() as conn:
        fired = conn.execute(
            select(runs.c.fire_at, runs.c.state).where(runs.c.entry_name == "pay-merchants",
                                                        runs.c.state != "skipped")
        ).all()
        skipped = conn.execute(
            select(func.count()).where(runs.c.state == "skipped")
        ).scalar_one()
        per = Counter(
            (m, s) for m, s in conn.execute(select(payouts.c.merchant, payouts.c.slot))
        )
        ledger_sum = conn.execute(
            select(func.coalesce(func.sum(ledger.c.delta_cents), 0))
        ).scalar_one()
        outcomes = Counter(
            o for (o,) in conn.execute(select(attempts.c.outcome))
        )
        pending = conn.execute(
            select(func.count()).where(outbox.c.state == "pending")
        ).scalar_one()
    slots = sorted({f.fire_at.strftime("%Y-%m-%dT%H:%M:%SZ") for f in fired})
    missing = [(m, s) for s in slots for m in MERCHANTS if per[(m, s)] == 0]
    doubled = [k for k, n in per.items() if n > 1]
    keys = Counter(k for k, _ in sink.requests)
    expected_keys = len(per)
    delivered = len(keys)
    states = Counter(f.state for f in fired)
    lines = [
        "",
        f"payouts demo report ({env.get('PAYOUTS_FRAMEWORK', 'celery')}, "
        f"{seconds:.0f} s, store "
        f"{env['RELIABLE_BEAT_DATABASE_URL'].split('@')[-1]})",
        "",
        "| what | count |",
        "|---|---|",
        f"| slots fired | {len(slots)} |",
        f"| runs by state | {dict(states)} |",
        f"| slots recorded as skipped | {skipped} |",
        f"| merchants x slots expected | {len(slots) * len(MERCHANTS)} |",
        f"| payouts written | {sum(per.values())} |",
        f"| merchant/slot pairs paid exactly once | {sum(1 for n in per.values() if n == 1)} |",
        f"| paid twice | {len(doubled)} |",
        f"| missing (fired slot, merchant unpaid) | {len(missing)} |",
        f"| ledger balance (must be 0) | {ledger_sum} |",
        f"| notifications delivered (distinct keys) | {delivered} of {expected_keys} |",
        f"| webhook requests in all (duplicates collapse on the key) | {len(sink.requests)} |",
        f"| outbox rows still pending | {pending} |",
        f"| attempts by outcome | {dict(outcomes)} |",
        f"| duplicates collapsed (deduplicated + fenced_out attempts) | "
        f"{outcomes['deduplicated'] + outcomes['fenced_out']} |",
    ]
    if procs.faults:
        lines.append(f"| faults injected | {dict(procs.faults)} |")
    print("\n".join(lines))
    ok = not doubled and not missing and ledger_sum == 0 and delivered == expected_keys
    ok = ok and len(slots) > 0
    print("\nRESULT:", "OK: every fired slot paid each merchant exactly once"
          if ok else "FAILED")
    engine.dispose()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.payouts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the beats run")
    ap.add_argument("--server", action="store_true",
                    help="PostgreSQL + Redis (private servers from the local binaries, or "
                         "--database-url / --broker-url)")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--broker-url", default=None)
    ap.add_argument("--break-it", action="store_true",
                    help="SIGKILL and SIGSTOP beats and workers during the run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--framework", choices=("celery", "dramatiq"), default="celery",
                    help="the adapter: Celery (default) or Dramatiq (needs redis-server or "
                         "--broker-url)")
    ap.add_argument("--workdir", default=str(ROOT / ".payouts-demo"))
    ap.add_argument("--dashboard", action="store_true",
                    help="after the run, serve the web dashboard on its store at "
                         "http://127.0.0.1:8477/ until Ctrl-C (needs reliable-beat[web])")
    args = ap.parse_args(argv)

    workdir = fresh_workdir(args.workdir, "broker")
    sink = Sink()
    env = demo_env(PAYOUTS_DIR=str(workdir), PAYOUTS_WEBHOOK_URL=sink.url,
                   PAYOUTS_FRAMEWORK=args.framework)
    with ExitStack() as stack:
        if args.server:
            db_url, broker = private_servers(stack, args.database_url, args.broker_url)
            env.update(RELIABLE_BEAT_DATABASE_URL=db_url, PAYOUTS_BROKER_URL=broker)
        else:
            env["RELIABLE_BEAT_DATABASE_URL"] = f"sqlite:///{workdir / 'payouts.sqlite3'}"
            if args.framework == "dramatiq":
                maybe = args.broker_url or _private_redis(stack)
                if maybe is None:
                    return 2
                env["PAYOUTS_BROKER_URL"] = maybe
        if args.break_it:
            env.setdefault("PAYOUTS_BODY_SECONDS", "1.5")
        app_args = ["-A", "examples.payouts.app"] if args.framework == "celery" else []
        subprocess.run(
            [sys.executable, "-m", "reliable_beat.cli", *app_args, "db", "upgrade"],
            env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            [sys.executable, "-c",
             "from examples.payouts.ledger import create_app_tables; create_app_tables()"],
            env=env, cwd=ROOT, check=True,
        )
        procs = Procs(env, workdir / "logs")
        stack.callback(procs.stop_all)
        workers = 2 if args.server else 1
        cmds = (dramatiq_cmds(workers) if args.framework == "dramatiq"
                else celery_cmds(workers, workdir))
        for name, cmd in cmds.items():  # workers and relay first, then the beats
            procs.start(name, cmd)
        print(f"{args.framework}: running 2 beats, {workers} worker(s) and a relay for "
              f"{args.seconds:.0f} s "
              f"(logs in {workdir / 'logs'}) ...", flush=True)
        faults = (functools.partial(break_it, procs, rng=random.Random(args.seed))
                  if args.break_it else None)
        run_then_settle(procs, args.seconds, faults=faults)
        wait_idle(env["RELIABLE_BEAT_DATABASE_URL"], 120, runs_in_flight)
        procs.stop_all()
        code = report(env, sink, procs, args.seconds)
        if args.dashboard:
            print("\ndashboard: http://127.0.0.1:8477/ (Ctrl-C stops it)", flush=True)
            subprocess.run([sys.executable, "-m", "reliable_beat.cli", *app_args, "dashboard",
                            "--port", "8477"], env=env, cwd=ROOT, check=False)
        return code
    return 1


def _private_redis(stack: ExitStack) -> str | None:
    """A private ``redis-server`` for the embedded Dramatiq demo, or None (and why)."""
    if shutil.which("redis-server") is None:
        print("--framework dramatiq needs a Redis broker: Dramatiq has no embedded broker "
              "that works across processes. Install redis-server (apt-get install "
              "redis-server) or pass --broker-url redis://...", file=sys.stderr)
        return None
    from harness.servers import RedisServer

    url = stack.enter_context(RedisServer()).url
    print(f"dramatiq: embedded mode uses a private redis-server at {url} (Dramatiq has no "
          "multi-process broker without a server)", flush=True)
    return url


if __name__ == "__main__":
    raise SystemExit(main())
