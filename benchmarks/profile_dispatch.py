"""CPU per slot of the beat's dispatch path, in one process: profile it, or compare trees.

Not part of ``python -m benchmarks`` (it prints no target); the tool behind the figures of
``docs/performance.md`` (*CPU per slot of the dispatch path*). One beat process loops exactly
what part 1 (``benchmarks/dispatch.py``) loops: :meth:`Beat.tick` then ``publish_triggers``
(publish + mark: the runs dispatched; a tree whose due triggers have outbox rows marks those
sent too), over N entries due at once (interval 1 h, slot 2 s ago), on a private
PostgreSQL and Redis (or ``--postgres-url`` / ``--redis-url``). After the first tick the
heap is frozen as :class:`~reliable_beat.loop.BeatLoop` freezes it (a source tree without
:func:`reliable_beat.process.freeze_heap`: not). ``row_writes``: rows
inserted, updated or deleted in the ``reliable_beat_*`` tables per slot (PostgreSQL's
table statistics).

CPU time is load-independent where wall time is not (the machine is shared): the beat's own
CPU (``time.process_time``) per stage and the PostgreSQL server's CPU (the postmaster's
children, from ``/proc``) are reported per slot. The first tick (imports, first schedule,
first template) is left out.

    # the top-20 table (cumulative and own time) of one run
    PYTHONPATH=. python benchmarks/profile_dispatch.py --n 5000 --profile
    # A/B: the same measurement with each source tree, alternated --rounds times in one run
    PYTHONPATH=. python benchmarks/profile_dispatch.py --n 5000 --compare /tmp/old /work/new
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _pg_children_cpu(postmaster: int) -> float:
    """CPU seconds (utime + stime) of the postmaster's children (backends, writers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


_WRITES_SQL = """
    SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)
      FROM pg_stat_user_tables WHERE relname LIKE 'reliable_beat_%'
"""


def _row_writes(dsn: str) -> int:
    """Rows inserted, updated and deleted in the ``reliable_beat_*`` tables so far
    (``pg_stat_user_tables``). A backend reports its counters when idle for a second or on
    exit: the caller pauses (or closes its connections) before reading."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(conn.execute(_WRITES_SQL).fetchone()[0])  # type: ignore[index]


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """Seed a fresh database, loop tick + publish + mark until N are published, measure."""
    import psycopg
    import redis

    from benchmarks.common import SIZES, Env, psycopg_dsn, seed_entries
    from benchmarks.dispatch import _celery_app
    from reliable_beat.beat import Beat
    from reliable_beat.celery.scheduler import publish_triggers
    from reliable_beat.db.dialects import Store

    env = Env(args.postgres_url, args.redis_url, SIZES["smoke"])
    with env.database("prof") as db_url:
        env.flush_redis()
        seed_entries(db_url, 0, args.n, due_in="-2 seconds", every=3600, grace=60)
        with psycopg.connect(psycopg_dsn(db_url)) as conn:
            datadir = conn.execute("SHOW data_directory").fetchone()[0]  # type: ignore[index]
        postmaster = int((Path(datadir) / "postmaster.pid").read_text().split()[0])
        store = Store.from_url(db_url, role="beat")
        app = _celery_app(args.redis_url)
        beat = Beat(store, owner=f"prof:{os.getpid()}", batch_size=args.batch)
        with app.producer_or_acquire() as p:
            p.connection.ensure_connection()
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile(time.process_time)
        tick_cpu = publish_cpu = 0.0
        slots = 0
        first = True
        time.sleep(0.5)  # the seeding connection reports its counters as it exits
        writes0 = _row_writes(psycopg_dsn(db_url))
        pg0 = _pg_children_cpu(postmaster)
        wall0 = time.perf_counter()
        published = 0  # the warm-up tick's too: the row writes are counted from the start
        while True:
            if profiler is not None and not first:
                profiler.enable()
            c0 = time.process_time()
            res = beat.tick()
            c1 = time.process_time()
            sent = 0
            if res.triggers:
                assert res.now is not None
                sent = publish_triggers(store, app, res.triggers, res.now)
            c2 = time.process_time()
            if profiler is not None:
                profiler.disable()
            if first:  # warm-up tick: not counted
                first = False
                # what BeatLoop does after its first claim (a tree without it: nothing)
                freeze = getattr(importlib.import_module("reliable_beat.process"),
                                 "freeze_heap", None)
                if freeze is not None:
                    freeze()
                pg0 = _pg_children_cpu(postmaster)
                wall0 = time.perf_counter()
            else:
                tick_cpu += c1 - c0
                publish_cpu += c2 - c1
                slots += sent
            published += sent
            if not res.claimed and not res.triggers:
                break
        wall = time.perf_counter() - wall0
        pg = _pg_children_cpu(postmaster) - pg0
        store.dispose()  # its backends report their last counters as they exit
        time.sleep(0.5)
        writes = _row_writes(psycopg_dsn(db_url)) - writes0
        r = redis.Redis.from_url(args.redis_url)
        in_redis = int(r.llen("celery"))
        r.close()
        import reliable_beat

        out = {
            "tree": str(Path(reliable_beat.__file__).resolve().parents[1]),
            "slots": slots, "in_redis": in_redis,
            "tick_us": 1e6 * tick_cpu / max(slots, 1),
            "publish_mark_us": 1e6 * publish_cpu / max(slots, 1),
            "beat_us": 1e6 * (tick_cpu + publish_cpu) / max(slots, 1),
            "pg_us": 1e6 * pg / max(slots, 1),
            "wall_us": 1e6 * wall / max(slots, 1),
            "row_writes": writes / max(published, 1),
        }
        if profiler is not None:
            import io
            import pstats

            for key in ("cumulative", "tottime"):
                buf = io.StringIO()
                pstats.Stats(profiler, stream=buf).sort_stats(key).print_stats(args.top)
                out[f"profile_{key}"] = buf.getvalue()
        return out


def _compare(args: argparse.Namespace) -> None:
    from benchmarks.common import SIZES, servers

    with servers(args.postgres_url, args.redis_url, SIZES["smoke"]) as env:
        results: dict[str, list[dict[str, Any]]] = {t: [] for t in args.compare}
        for _ in range(args.rounds):
            for tree in args.compare:
                cmd = [sys.executable, str(HERE), "--worker", "--n", str(args.n),
                       "--batch", str(args.batch), "--postgres-url", env.postgres_url,
                       "--redis-url", env.redis_url]
                envvars = dict(os.environ, PYTHONPATH=tree)
                done = subprocess.run(cmd, env=envvars, cwd=tree, capture_output=True,
                                      text=True, check=False)
                if done.returncode:
                    sys.exit(f"{tree}: worker failed\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                results[tree].append(got)
                print(json.dumps(got), flush=True)
        print(f"\n{args.n:,} due entries, batch {args.batch}, {args.rounds} rounds alternated; "
              "per slot, median (min-max):")
        cols = ("tick_us", "publish_mark_us", "beat_us", "pg_us", "wall_us", "row_writes")
        print("| tree | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for tree, runs in results.items():
            cells = []
            for c in cols:
                v = [r[c] for r in runs]
                f = ".2f" if c == "row_writes" else ".0f"
                cells.append(f"{statistics.median(v):{f}} ({min(v):{f}}-{max(v):{f}})")
            print(f"| {tree} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=5000, help="entries due at once")
    ap.add_argument("--batch", type=int, default=500, help="Beat.batch_size")
    ap.add_argument("--postgres-url")
    ap.add_argument("--redis-url")
    ap.add_argument("--profile", action="store_true", help="cProfile (CPU time) the loop")
    ap.add_argument("--top", type=int, default=20, help="rows of each profile table")
    ap.add_argument("--compare", nargs="+", metavar="TREE",
                    help="source trees to alternate (each run with PYTHONPATH=TREE)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        _compare(args)
        return
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    from benchmarks.common import SIZES, servers

    with servers(args.postgres_url, args.redis_url, SIZES["smoke"]) as env:
        args.postgres_url, args.redis_url = env.postgres_url, env.redis_url
        out = _worker(args)
    for key in ("profile_cumulative", "profile_tottime"):
        with contextlib.suppress(KeyError):
            print(out.pop(key))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
