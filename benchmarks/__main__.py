"""``python -m benchmarks``: run every benchmark on private servers and print markdown."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shlex
import sys
import time
import traceback
from datetime import datetime, timezone

from benchmarks.common import SIZES, machine, servers

#: name -> (module, function returning the part's markdown)
PARTS = {
    "dispatch": ("benchmarks.dispatch", "run"),
    "dispatch_amqp": ("benchmarks.dispatch_amqp", "run"),
    "scale": ("benchmarks.scale", "run"),
    "lateness": ("benchmarks.lateness", "run"),
    "task_overhead": ("benchmarks.task_overhead", "run"),
    "relay": ("benchmarks.dispatch", "run_relay"),
    "workflows": ("benchmarks.workflows", "run"),
    "stacks": ("benchmarks.stacks", "run"),
    "herd": ("benchmarks.herd", "run"),
    "workflow_round_trips": ("benchmarks.workflows", "run_round_trips"),
}
#: Parts run only with ``--only``: part 6 (``stacks``: it starts its own MariaDB and RabbitMQ
#: unless given ``--mariadb-url`` / ``--amqp-url``), part 1b (``dispatch_amqp``: RabbitMQ) and
#: ``workflow_round_trips`` (the default run has its figures already).
ONLY_ON_REQUEST = {"stacks", "workflow_round_trips", "herd", "dispatch_amqp"}
DEFAULT_PARTS = [name for name in PARTS if name not in ONLY_ON_REQUEST]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="smoke")
    parser.add_argument("--only", action="append", choices=sorted(PARTS),
                        help="run only this part (repeatable)")
    parser.add_argument("--postgres-url", help="use this PostgreSQL (superuser) instead of a "
                        "private server; a database is created and dropped per part")
    parser.add_argument("--redis-url", help="use this Redis (it is FLUSHDB'd!)")
    parser.add_argument("--mariadb-url", help="part 6 (stacks): use this MariaDB (a user "
                        "that may create databases) instead of a private server")
    parser.add_argument("--amqp-url", help="parts 1b (dispatch_amqp) and 6 (stacks): use this "
                        "RabbitMQ instead of a private node")
    parser.add_argument("--repeats", type=int, help="measure each size this many times in "
                        "one invocation (lateness, task_overhead; default 3 at full size, 1 at "
                        "smoke) and print the median and the range of the runs")
    parser.add_argument("--background-load", action="store_true", help="lateness: also "
                        "measure ours and stock beat beside one busy process (a Python "
                        "`while True: pass` loop, one core); on by default at full size")
    parser.add_argument("--tracing", action="store_true", help="task_overhead: measure the "
                        "IdempotentTask with OpenTelemetry tracing off and on (SDK, an exporter "
                        "that drops) instead of against a plain task")
    args = parser.parse_args(argv)
    if args.tracing:
        os.environ["BENCH_TRACING"] = "1"
    size = SIZES[args.size]
    if args.repeats is not None:
        size = dataclasses.replace(size, repeats=max(1, args.repeats))
    if args.background_load:
        size = dataclasses.replace(size, lateness_background=True)
    started = datetime.now(timezone.utc)
    failed = False
    print("# reliable_beat benchmarks\n", flush=True)
    print(f"- command: `python -m benchmarks {shlex.join(sys.argv[1:])}`".replace(" `", " `")
          .rstrip())
    print(f"- date: {started:%Y-%m-%d %H:%M} UTC, size `{size.name}`, "
          f"{size.repeats} run(s) per size", flush=True)
    parts = args.only or DEFAULT_PARTS
    with servers(args.postgres_url, args.redis_url, size, mariadb_url=args.mariadb_url,
                 amqp_url=args.amqp_url, stacks="stacks" in parts,
                 amqp="dispatch_amqp" in parts) as env:
        print(machine(env) + "\n", flush=True)
        for name in parts:
            t0 = time.perf_counter()
            try:
                module, func = PARTS[name]
                text = getattr(importlib.import_module(module), func)(env)
            except Exception:
                failed = True
                text = f"### {name}: FAILED\n\n```\n{traceback.format_exc()}```"
            print(text, flush=True)
            print(f"\n_{name}: {time.perf_counter() - t0:.0f} s_\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
