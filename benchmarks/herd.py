"""7. The herd: N entries of ``0 * * * *`` all due at one instant.

A large installation where many entries share ``0 * * * *`` (or ``0 2 * * *``): the last one
fires as late as the dispatch rate allows. N cron entries are inserted with ``COPY``, every
one due at the same slot (the last top of the hour: on the cron grid, misfire policy
``fire_once`` with a 2 h grace, so every entry fires that slot once; ``end_at`` half an hour
after it, so a run that crosses the next top of the hour fires nothing more). Then, in one
run, on the same servers:

* **ours**, k = 1, 2, 4 beat processes (real processes looping exactly what
  :meth:`ReliableScheduler.tick` does minus its sleep: ``Beat.tick`` + ``publish_triggers``,
  as part 1), released together at t0: the time until the last trigger is in Redis
  (``LLEN`` of the queue reaches N);
* the **raw SQL claim ceiling** with the same k (``UPDATE ... FOR UPDATE SKIP LOCKED``
  advancing ``next_fire_at``, no runs / outbox rows, nothing published);
* the **pipelined kombu publish ceiling** with the same k (Celery-shaped messages through
  ``Producer.batch()``, one Redis pipeline per batch, no database).

During each of our runs the CPU time of every process involved is sampled from ``/proc``
(``utime + stime``): the beat processes, the PostgreSQL server (postmaster and every backend)
and the Redis server; printed as cores used (1.00 = one core busy the whole run), so the
table shows which resource binds. Each configuration runs ``REPEATS`` times per size in the
one invocation; the table gives the median and the range.

Sizes: smoke 10,000; full 100,000 and 1,000,000 (``python -m benchmarks --size full --only
herd``; on a quiet 2-core machine expect about 1.5-3 h, most of it the 1M runs of ours).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import psycopg

from benchmarks.common import Env, psycopg_dsn, table
from benchmarks.dispatch import start_workers

#: entries per size name
HERD_SIZES = {"smoke": [10_000], "full": [100_000, 1_000_000]}
BEATS = (1, 2, 4)
REPEATS = 3
BATCH = 500
CRON = "0 * * * *"
TIMEOUT_S = 3 * 3600.0

_COLUMNS = ("name", "task", "args", "kwargs", "options", "schedule_kind", "schedule",
            "timezone", "misfire_policy", "misfire_grace_seconds", "catch_up_limit",
            "overlap_policy", "enabled", "paused", "origin", "next_fire_at", "end_at",
            "created_at", "updated_at")


def seed_herd(db_url: str, n: int) -> float:
    """Empty the tables and ``COPY`` ``n`` cron entries ``herd-0 .. herd-<n-1>``, every one
    due at the last top of the hour; returns the seconds it took."""
    from reliable_beat.schedules import CronSchedule

    spec = json.dumps(CronSchedule(CRON).to_spec())
    t0 = time.perf_counter()
    with psycopg.connect(psycopg_dsn(db_url), autocommit=True) as conn:
        conn.execute("TRUNCATE reliable_beat_entries, reliable_beat_runs, reliable_beat_outbox,"
                     " reliable_beat_attempts RESTART IDENTITY")
        slot = conn.execute("SELECT date_trunc('hour', now())").fetchone()[0]  # type: ignore[index]
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        # The herd's slot is each entry's last: a run that crosses the next top of the hour
        # must not fire (and count) a second slot.
        end_at = slot + timedelta(minutes=30)
        cols = ", ".join(_COLUMNS)
        with conn.cursor() as cur, cur.copy(
                f"COPY reliable_beat_entries ({cols}) FROM STDIN") as copy:
            for i in range(n):
                copy.write_row((f"herd-{i}", "bench.noop", "[]", "{}", "{}", "cron", spec,
                                "UTC", "fire_once", 7200, 100, "allow", True, False, "runtime",
                                slot, end_at, now, now))
        conn.execute("ANALYZE reliable_beat_entries")
    return time.perf_counter() - t0


# -- CPU sampling -----------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> tuple[int, float] | None:
    """``(parent pid, utime + stime in s)`` of ``pid``; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (all cores, ``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICK


def _children(parent: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            got = _cpu_seconds(int(entry.name))
            if got is not None and got[0] == parent:
                out.append(int(entry.name))
    return out


def server_pids(env: Env, db_url: str) -> tuple[int | None, int | None]:
    """The PostgreSQL postmaster's and the Redis server's pids (None: not on this host)."""
    import redis

    pg = rd = None
    with contextlib.suppress(Exception), psycopg.connect(psycopg_dsn(db_url)) as conn:
        datadir = conn.execute("SHOW data_directory").fetchone()[0]  # type: ignore[index]
        pg = int((Path(datadir) / "postmaster.pid").read_text().split()[0])
    with contextlib.suppress(Exception):
        r = redis.Redis.from_url(env.redis_url)
        rd = int(r.info("server")["process_id"])
        r.close()
    return pg, rd


class CpuSampler:
    """Cumulative CPU seconds of groups of processes, sampled from ``/proc``.

    ``groups`` maps a name to a function returning the group's pids now (the PostgreSQL
    group is re-listed at every sample: backends come and go). A process's CPU counts from
    its first sample (or from 0 if it was born during the run) to its last.
    """

    def __init__(self, groups: dict[str, Callable[[], list[int]]]) -> None:
        self.groups = groups
        self.first: dict[tuple[str, int], float] = {}
        self.last: dict[tuple[str, int], float] = {}

    def sample(self, *, initial: bool = False) -> None:
        for name, pids in self.groups.items():
            for pid in pids():
                got = _cpu_seconds(pid)
                if got is None:
                    continue
                key = (name, pid)
                if key not in self.first:
                    self.first[key] = got[1] if initial else 0.0
                self.last[key] = got[1]

    def used(self) -> dict[str, float]:
        """CPU seconds per group since the first sample."""
        out = dict.fromkeys(self.groups, 0.0)
        for key, value in self.last.items():
            out[key[0]] += value - self.first[key]
        return out


# -- runs -------------------------------------------------------------------------------
def _run(kind: str, procs: int, env: Env, db_url: str, n: int,
         pg_pid: int | None, redis_pid: int | None) -> dict[str, float]:
    """``procs`` processes of ``kind`` (``ours``, ``sql``, ``kombu_batch``) released at once;
    seconds until ``n`` are in Redis (``sql``: claimed), and cores used per process group."""
    import redis

    ps, go, stop, counter = start_workers(kind, procs, db_url, env.redis_url, BATCH,
                                          timeout=120, label="herd")
    groups: dict[str, Callable[[], list[int]]] = {
        "beats": lambda: [p.pid for p in ps if p.pid is not None]}
    if pg_pid is not None:
        groups["postgres"] = lambda: [pg_pid, *_children(pg_pid)]
    if redis_pid is not None:
        groups["redis"] = lambda: [redis_pid]
    sampler = CpuSampler(groups)
    sampler.sample(initial=True)
    busy0 = _machine_busy_seconds()
    r = redis.Redis.from_url(env.redis_url)
    t0 = time.perf_counter()
    go.set()
    done, last_sample = 0, t0
    while time.perf_counter() - t0 < TIMEOUT_S:
        done = int(r.llen("celery")) if kind != "sql" else counter.value
        if done >= n:
            break
        now = time.perf_counter()
        if now - last_sample > 0.25:
            sampler.sample()
            last_sample = now
        time.sleep(0.002)
    elapsed = time.perf_counter() - t0
    sampler.sample()
    busy = _machine_busy_seconds() - busy0
    stop.set()
    for p in ps:
        p.join(30)
        if p.is_alive():
            p.kill()
    r.close()
    if done < n:
        raise RuntimeError(f"herd {kind} x{procs}: {done:,} of {n:,} after {elapsed:.0f} s")
    out = {"seconds": elapsed, "cpu_machine": busy / elapsed}
    for group, seconds in sampler.used().items():
        out[f"cpu_{group}"] = seconds / elapsed  # cores used
        out[f"us_{group}"] = seconds / n * 1e6  # CPU per slot
    return out


def _repeats(values: Sequence[float]) -> str:
    """``median (min-max)`` of the repeats."""
    if not values:
        return "-"
    med, lo, hi = statistics.median(values), min(values), max(values)

    def f(v: float) -> str:
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"
    return f"{f(med)} ({f(lo)}-{f(hi)})"


@contextlib.contextmanager
def _herd_database(env: Env) -> Iterator[str]:
    with env.database("herd") as db_url:
        yield db_url


def run(env: Env) -> str:
    sizes = HERD_SIZES.get(env.size.name, HERD_SIZES["smoke"])
    sections = []
    with _herd_database(env) as db_url:
        pg_pid, redis_pid = server_pids(env, db_url)
        for n in sizes:
            results: dict[tuple[str, int], list[dict[str, float]]] = {}
            seed_s: list[float] = []
            for _ in range(REPEATS):
                for procs in BEATS:
                    for kind in ("ours", "sql", "kombu_batch"):
                        env.flush_redis()
                        if kind != "kombu_batch":
                            seed_s.append(seed_herd(db_url, n))
                        results.setdefault((kind, procs), []).append(
                            _run(kind, procs, env, db_url, n, pg_pid, redis_pid))
            rows = []
            for procs in BEATS:
                ours = results[("ours", procs)]
                sql = results[("sql", procs)]
                pub = results[("kombu_batch", procs)]
                ratio_sql = [o["seconds"] and s["seconds"] / o["seconds"]
                             for o, s in zip(ours, sql, strict=True)]
                ratio_pub = [o["seconds"] and k["seconds"] / o["seconds"]
                             for o, k in zip(ours, pub, strict=True)]
                rows.append([
                    procs,
                    _repeats([o["seconds"] for o in ours]),
                    _repeats([n / o["seconds"] for o in ours]),
                    _repeats([s["seconds"] for s in sql]),
                    _repeats([k["seconds"] for k in pub]),
                    _repeats([100 * r for r in ratio_sql]) + " %",
                    _repeats([100 * r for r in ratio_pub]) + " %",
                    _repeats([o["cpu_machine"] for o in ours]),
                    *(_repeats([o.get(f"cpu_{g}", float("nan")) for o in ours]) + " / "
                      + _repeats([o.get(f"us_{g}", float("nan")) for o in ours])
                      for g in ("beats", "postgres", "redis")),
                ])
            sections.append("\n".join([
                f"#### {n:,} entries of `{CRON}` due at one instant (batch {BATCH}; "
                f"{REPEATS} runs each, median (min-max); COPY of the entries "
                f"{statistics.median(seed_s):.1f} s)",
                "",
                table(["beats (k)", "ours: last trigger in Redis after (s)", "ours slots/s",
                       "raw SQL claim, same k (s)", "raw kombu pipelined, same k (s)",
                       "ours / SQL ceiling", "ours / publish ceiling",
                       "whole machine busy (cores)", "beats: cores / CPU us per slot",
                       "PostgreSQL: cores / us per slot", "Redis: cores / us per slot"],
                      rows),
            ]))
    cores = os.cpu_count() or 1
    return "\n".join([
        "### 7. The herd",
        "",
        f"N cron entries (`{CRON}`) due at the same slot; k beat processes looping "
        "`Beat.tick` + `publish_triggers` released together; the clock stops when the "
        "last trigger is in Redis. Beside it, in the same run, the raw SQL claim loop and "
        "the pipelined kombu publish loop with the same k (time for N). CPU columns: "
        f"cores used during our run and CPU time per slot, from `/proc` (this machine has "
        f"{cores} cores). A group near its limit (a beat near 1.00 each, Redis near 1.00) "
        f"binds; when the whole machine is near {cores} busy while ours are not, other work "
        "on the machine binds. CPU per slot does not depend on the load: divide a core by "
        "it for the rate one core of that group can sustain.",
        "",
        *sections,
    ])
