"""Instructions per call of a real worker with tracing off and on (callgrind), load-independent.

Not part of ``python -m benchmarks`` (it takes minutes and needs valgrind and a C compiler);
the tool behind the instruction figures of part 4b in ``benchmarks/RESULTS.md``. The worker is
part 4's (``benchmarks/task_overhead.py``: ``IdempotentTask`` calls, each writing one row in
``self.transaction()``; tracing on = the SDK's ``TracerProvider``, a ``BatchSpanProcessor`` and
an exporter that drops), fed messages carrying a ``traceparent`` as a beat's trigger does.
It runs under ``valgrind --tool=callgrind --instr-atstart=no``; each process that runs tasks
switches the instrumentation on itself after ``--warm`` calls (a client request through a
tiny C shim compiled on the fly, from Celery's ``task_postrun``) and dumps its count after
``--calls`` more; a prefork worker's parent (it takes the messages and hands them to its
children) is counted over the same window through ``callgrind_control``. The export thread
of the batch processor is counted with the process that owns it.

    PYTHONPATH=. python benchmarks/profile_tracing.py                 # solo and prefork -c 2
    PYTHONPATH=. python benchmarks/profile_tracing.py --pools solo --calls 200

Prints, per pool, the instructions per call of each process with tracing off and on, and the
ratio off / on of the worker's total (parent + children): the overhead of tracing, which the
CPU-per-call ratio of part 4b estimates on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

SHIM = r"""
#include <valgrind/callgrind.h>
void rb_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void rb_cg_dump(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# -- inside the worker (``-A benchmarks.profile_tracing:app``) --------------------------------
app: Any = None
if os.environ.get("PT_SHIM"):
    from celery.signals import task_postrun

    from benchmarks import task_overhead as _to

    app = _to.app

    _lib = ctypes.CDLL(os.environ["PT_SHIM"])
    _warm, _calls, _marks = (int(os.environ["PT_WARM"]), int(os.environ["PT_CALLS"]),
                             os.environ["PT_MARKS"])
    _done = [0]

    @task_postrun.connect
    def _count(**_: Any) -> None:
        _done[0] += 1
        if _done[0] == _warm:
            _lib.rb_cg_start()
            open(os.path.join(_marks, f"started.{os.getpid()}"), "w").close()
        elif _done[0] == _warm + _calls:
            _lib.rb_cg_dump()
            open(os.path.join(_marks, f"done.{os.getpid()}"), "w").close()


# -- the driver ------------------------------------------------------------------------------
def _totals(path: str) -> int:
    with open(path) as fh:
        m = re.search(r"^totals: (\d+)", fh.read(), re.M)
    return int(m.group(1)) if m else 0


def _measure(pool: str, tracing: str, args: argparse.Namespace, env: Any, db_url: str,
             publisher: Any, eng: Any, work: str) -> dict[str, float]:
    import redis
    import sqlalchemy as sa

    from benchmarks.common import PY, ROOT

    tag = f"{pool}-{tracing}"
    marks = os.path.join(work, tag)
    os.makedirs(marks)
    queue = f"pt_{pool}_{tracing}"
    children = 1 if pool == "solo" else 2
    pool_args = ["--pool", "solo"] if pool == "solo" else ["--pool", "prefork", "-c", "2"]
    log = open(os.path.join(work, f"{tag}.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no",
         f"--callgrind-out-file={marks}/cg.%p", PY, "-m", "celery", "-A",
         "benchmarks.profile_tracing:app", "worker", "-Q", queue, *pool_args,
         "--loglevel=WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat",
         "-n", f"pt{tag}@%h"],
        env={**os.environ, "PYTHONPATH": str(ROOT), "TO_BROKER": env.redis_url, "TO_DB": db_url,
             "TO_RUN": tag, "TO_TRACING": tracing, "PT_SHIM": args.shim,
             "PT_WARM": str(args.warm), "PT_CALLS": str(args.calls), "PT_MARKS": marks},
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    r = redis.Redis.from_url(env.redis_url)

    def publish(n: int) -> None:  # the key is made here (the publisher's): one per message
        with publisher.producer_or_acquire() as producer:
            for _ in range(n):
                _SENT[0] += 1
                publisher.tasks["to.idem"].apply_async(
                    (_SENT[0],), producer=producer, queue=queue,
                    headers={"traceparent": TRACEPARENT})

    def effects() -> int:
        with eng.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM bench_effects")).scalar() or 0)

    def wait_marks(kind: str) -> None:
        deadline = time.time() + 1800
        while len(glob.glob(f"{marks}/{kind}.*")) < children:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{tag}: worker exited or stalled (log {log.name})")
            if r.llen(queue) < 20:
                publish(40)
            time.sleep(0.2)

    out: dict[str, float] = {}
    try:
        wait_marks("started")
        parent = None
        if pool != "solo":
            parent = proc.pid
            subprocess.run(["callgrind_control", "-i", "on", str(parent)], capture_output=True,
                           check=False)
            subprocess.run(["callgrind_control", "-z", str(parent)], capture_output=True,
                           check=False)
        base = effects()
        wait_marks("done")
        calls = effects() - base
        if calls < args.calls * children * 0.8:  # each call writes its row: none failed
            raise RuntimeError(f"{tag}: {calls} rows written in the window (log {log.name})")
        if parent is not None:
            subprocess.run(["callgrind_control", "-d", str(parent)], capture_output=True,
                           check=False)
            time.sleep(2)
            dumps = sorted(glob.glob(f"{marks}/cg.{parent}.*"))
            out["parent"] = _totals(dumps[-1]) / max(1, calls) if dumps else float("nan")
        for i, path in enumerate(sorted(glob.glob(f"{marks}/cg.*.1"))):
            if parent is not None and path.endswith(f".{parent}.1"):
                continue
            out[f"child {i + 1}" if pool != "solo" else "worker"] = _totals(path) / args.calls
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        r.close()
    return out


_SENT = [0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pools", default="solo,prefork")
    parser.add_argument("--warm", type=int, default=40, help="calls per process before")
    parser.add_argument("--calls", type=int, default=100, help="calls per process counted")
    parser.add_argument("--keep", help="keep the logs and callgrind files in this directory")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        sys.exit("needs valgrind (with its headers, valgrind/callgrind.h) and a C compiler")

    import sqlalchemy as sa

    from benchmarks import task_overhead
    from benchmarks.common import SIZES, servers

    with (contextlib.nullcontext(args.keep) if args.keep
          else tempfile.TemporaryDirectory(prefix="profile_tracing-")) as work:
        os.makedirs(work, exist_ok=True)
        args.shim = os.path.join(work, "shim.so")
        src = os.path.join(work, "shim.c")
        with open(src, "w") as fh:
            fh.write(SHIM)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", args.shim, src], check=True)
        with servers(None, None, SIZES["smoke"]) as env, env.database("tasks") as db_url:
            eng = sa.create_engine(db_url)
            with eng.begin() as conn:
                conn.execute(sa.text("CREATE TABLE bench_effects (id serial PRIMARY KEY, "
                                     "key varchar(200), n int)"))
            os.environ.update(TO_BROKER=env.redis_url, TO_DB=db_url, TO_RUN="publisher")
            os.environ.pop("TO_TRACING", None)
            publisher = task_overhead._make_app()
            for pool in args.pools.split(","):
                got = {t: _measure(pool, t, args, env, db_url, publisher, eng, work)
                       for t in ("0", "1")}
                total = {t: sum(v for v in got[t].values()) for t in got}
                for t, label in (("0", "off"), ("1", "on")):
                    parts = ", ".join(f"{k} {v / 1e3:,.0f} k" for k, v in got[t].items())
                    print(f"{pool} tracing {label}: {parts}", flush=True)
                if pool != "solo":  # a call runs in one child: parent + the children's mean
                    for t in got:
                        kids = [v for k, v in got[t].items() if k.startswith("child")]
                        total[t] = got[t].get("parent", 0.0) + sum(kids) / len(kids)
                print(f"{pool}: {total['0'] / 1e3:,.0f} k -> {total['1'] / 1e3:,.0f} k "
                      f"instructions per call (+{(total['1'] - total['0']) / 1e3:,.0f} k), "
                      f"off / on {total['0'] / total['1']:.3f}x", flush=True)
            eng.dispose()


if __name__ == "__main__":
    main()
