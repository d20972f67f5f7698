"""Shared plumbing of the benchmarks: servers, fresh databases, seeding, tables, machine info.

Every benchmark gets its own fresh PostgreSQL database (``CREATE DATABASE``) migrated with
:func:`reliable_beat.db.migrate.upgrade`, and flushes Redis before it starts, so the parts
never see each other's rows or messages.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

#: The interval schedule every seeded entry gets: every ``every`` seconds on a whole-second grid.
ANCHOR = "2000-01-01T00:00:00Z"


@dataclass
class Sizes:
    """Knobs of one run; ``smoke`` keeps CI fast, ``full`` is what RESULTS.md holds."""

    name: str
    dispatch_n: int
    dispatch_batch: int
    dispatch_procs: tuple[int, ...]
    scale_sizes: list[int]
    stock_sizes: list[int]
    redbeat_sizes: list[int]
    lateness_entries: int
    lateness_seconds: float
    task_n: int
    relay_n: int
    #: How many times parts that repeat (lateness, task overhead) measure each size in one
    #: invocation; each figure is then printed as the median and the range of the runs
    #: (``--repeats`` overrides it).
    repeats: int = 1
    #: Lateness: also measure ours (3 beats) and stock beat beside one busy core.
    lateness_background: bool = False
    #: Lateness: the numbers of beats (and of raw publishers) ours and the floor run with.
    lateness_beats: tuple[int, ...] = (1, 3)
    #: Relay throughput: the numbers of relay (and raw kombu) processes.
    relay_procs: tuple[int, ...] = (1, 2)


SIZES = {
    # CI's smoke (tests/acceptance/test_benchmarks_smoke.py) only proves every part still
    # drives the library end to end and prints its table: the least of each part (one
    # process count, one lateness beat count, 1 s windows, a few calls), since process
    # start-up and fixed windows, not the work, make its time. Its figures mean nothing.
    "smoke": Sizes("smoke", 1_000, 500, (1,), [1_000], [1_000], [1_000],
                   10, 1.0, 20, 1_000, lateness_beats=(3,), relay_procs=(1,)),
    "full": Sizes("full", 20_000, 500, (1, 2, 4), [1_000, 100_000, 1_000_000, 10_000_000],
                  [1_000, 100_000], [1_000, 100_000, 1_000_000], 100, 30.0, 2_000, 20_000,
                  repeats=3, lateness_background=True),
}


@dataclass
class Env:
    """The servers one run uses."""

    postgres_url: str  # admin database URL (postgresql+psycopg://...)
    redis_url: str
    size: Sizes
    notes: list[str] = field(default_factory=list)
    #: MariaDB server (a user that may create databases) and RabbitMQ node of part 6
    #: (:mod:`benchmarks.stacks`); None: that part leaves the stacks out.
    mariadb_url: str | None = None
    amqp_url: str | None = None
    _admin: sa.Engine | None = None

    @contextlib.contextmanager
    def database(self, prefix: str = "bench") -> Iterator[str]:
        """A fresh migrated database; yields its URL and drops it afterwards."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(self.postgres_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        url = sa.engine.make_url(self.postgres_url).set(database=name).render_as_string(False)
        store = Store.from_url(url, role="cli")
        upgrade(store)
        store.dispose()
        try:
            yield url
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"
                ), {"n": name})
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
            admin.dispose()

    def flush_redis(self) -> None:
        import redis

        r = redis.Redis.from_url(self.redis_url)
        r.flushdb()
        r.close()


@contextlib.contextmanager
def servers(postgres_url: str | None, redis_url: str | None, size: Sizes, *,
            mariadb_url: str | None = None, amqp_url: str | None = None,
            stacks: bool = False, amqp: bool = False) -> Iterator[Env]:
    """Use the given servers, or start private ones from the local binaries (MariaDB and
    RabbitMQ only when ``stacks``: part 6 runs; RabbitMQ also when ``amqp``: part 1b)."""
    with contextlib.ExitStack() as stack:
        if stacks and mariadb_url is None:
            from harness.servers import MariaDBServer

            mariadb_url = stack.enter_context(MariaDBServer()).url
        if (stacks or amqp) and amqp_url is None:
            from harness.servers import RabbitMQServer

            amqp_url = stack.enter_context(RabbitMQServer()).url
        if postgres_url is None:
            from harness.servers import PostgresServer

            pg = stack.enter_context(PostgresServer(extra_conf={"max_connections": "300"}))
            postgres_url = pg.url
        if redis_url is None:
            from harness.servers import RedisServer

            redis_url = stack.enter_context(RedisServer()).url
        yield Env(postgres_url, redis_url, size, mariadb_url=mariadb_url, amqp_url=amqp_url)


def psycopg_dsn(url: str) -> str:
    """A libpq URL (``postgresql://``) from a SQLAlchemy URL."""
    return sa.engine.make_url(url).set(drivername="postgresql").render_as_string(False)


def seed_entries(url: str, start: int, stop: int, *, due_in: str, every: int = 1,
                 spread: str = "0 seconds", grace: float = 1.0) -> float:
    """Insert entries ``bench-<start>`` .. ``bench-<stop-1>`` straight into the table.

    One ``INSERT ... SELECT generate_series`` (server-side, no Python per row): interval
    schedule every ``every`` s, ``next_fire_at = now() + due_in + random() * spread``,
    misfire policy ``fire_once`` with ``grace`` s (so a backlog fires one slot per entry).
    Returns the seconds it took.
    """
    import psycopg

    spec = json.dumps({"kind": "interval", "every_seconds": every, "anchor": ANCHOR,
                       "timezone": "UTC"})
    t0 = time.perf_counter()
    with psycopg.connect(psycopg_dsn(url), autocommit=True) as conn:
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute(
            """
            INSERT INTO reliable_beat_entries
              (name, task, args, kwargs, options, schedule_kind, schedule, timezone,
               misfire_policy, misfire_grace_seconds, catch_up_limit, overlap_policy,
               enabled, paused, origin, next_fire_at, created_at, updated_at)
            SELECT 'bench-' || g, 'bench.noop', '[]'::jsonb, '{}'::jsonb, '{}'::jsonb,
                   'interval', %(spec)s::jsonb, 'UTC', 'fire_once', %(grace)s, 100, 'allow',
                   true, false, 'runtime',
                   date_trunc('second', now() + %(due)s::interval
                                        + random() * %(spread)s::interval),
                   now(), now()
            FROM generate_series(%(a)s::bigint, %(b)s::bigint) AS g
            """,
            {"spec": spec, "grace": grace, "due": due_in, "spread": spread, "a": start,
             "b": stop - 1},
        )
        conn.execute("ANALYZE reliable_beat_entries")
    return time.perf_counter() - t0


# -- stats and output -------------------------------------------------------------------
def pct(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return s[k]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def num(v: float) -> str:
    """A number as the tables print it (thousands separators; 2-3 significant decimals)."""
    if v != v:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def repeat(times: int, measure: Callable[[int], T]) -> list[T]:
    """``[measure(0), measure(1), ...]``: one size measured ``times`` times in a row."""
    return [measure(i) for i in range(max(1, times))]


def spread(values: Sequence[float], unit: str = "", digits: int | None = None) -> str:
    """The median of repeated runs and their range: ``"4.15 (3.90-4.61)"``.

    One value prints alone; NaNs (a run that measured nothing) are left out, and all-NaN
    prints ``-``. ``unit`` is appended to each number (``"x"`` for ratios); ``digits``
    fixes the decimals (default: as :func:`num`).
    """
    vals = [v for v in values if v == v]
    if not vals:
        return "-"

    def fmt(v: float) -> str:
        return (num(v) if digits is None else f"{v:.{digits}f}") + unit

    mid = fmt(median(vals))
    if len(vals) == 1:
        return mid
    return f"{mid} ({fmt(min(vals))}-{fmt(max(vals))})"


def check(ok: bool | None) -> str:
    return "n/a" if ok is None else ("✔" if ok else "✘")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return num(v)
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def machine(env: Env) -> str:
    """Cores, memory, OS, Python, PostgreSQL and Redis versions."""
    import celery
    import kombu
    import redis
    import sqlalchemy

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    eng = sa.create_engine(env.postgres_url)
    with eng.connect() as conn:
        pg = conn.execute(sa.text("SHOW server_version")).scalar_one()
    eng.dispose()
    r = redis.Redis.from_url(env.redis_url)
    rv = r.info("server")["redis_version"]
    r.close()
    try:
        from importlib.metadata import version

        import redbeat  # noqa: F401

        rb = version("celery-redbeat")
    except Exception:
        rb = "not installed"
    return (
        f"- machine: {os.cpu_count()} cores ({cpu}), {mem_gb:.1f} GiB RAM, "
        f"{platform.system()} {platform.release()}\n"
        f"- PostgreSQL {pg} (fsync off, synchronous_commit off: a private bench server), "
        f"Redis {rv}\n"
        f"- Python {platform.python_version()}, Celery {celery.__version__}, "
        f"kombu {kombu.__version__}, SQLAlchemy {sqlalchemy.__version__}, "
        f"redis-py {redis.__version__}, celery-redbeat {rb}"
    )


def rss_kib(pid: int | None = None) -> int:
    """Resident set size of ``pid`` (default: this process) in KiB."""
    path = f"/proc/{pid or 'self'}/status"
    for line in Path(path).read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_child(args: list[str], env: dict[str, str] | None = None,
              timeout: float = 1800) -> dict[str, Any]:
    """Run ``python -m benchmarks.<module> ...`` in a fresh process; parse its last JSON line."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([PY, *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]
