"""The dashboard's page render times at size: 20,000 entries and 1,000,000 runs on PostgreSQL.

Not part of CI (it seeds a million rows). Run::

    python -m benchmarks.dashboard                      # starts a private PostgreSQL
    python -m benchmarks.dashboard --database-url postgresql+psycopg://...  # an empty database

Seeds with set-based SQL (``generate_series``): ``--entries`` entries every 5 minutes, and
``--runs`` slot runs spread over them (newest slots first, one attempt each, one in 50 late,
one in 500 dead). Then renders each page ``--repeat`` times through Starlette's TestClient
(in process, so what is measured is the app: queries and templates) and prints the median
and the worst, in milliseconds. The overview is measured twice: with the alarms already
collected (what every refresh costs; the collection runs in the background, see
:mod:`reliable_beat.web.alarms`) and the status collection itself (what the very first page
waits for).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa

from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import upgrade
from reliable_beat.web import AuthConfig, create_app
from reliable_beat.web.alarms import collect_status

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


def seed(store: Store, n_entries: int, n_runs: int) -> None:
    per = max(n_runs // n_entries, 1)
    with store.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO reliable_beat_entries (name, task, args, kwargs, options, schedule_kind,
                schedule, timezone, schedule_group, origin, next_fire_at, last_fire_at,
                created_at, updated_at)
            SELECT 'entry-' || lpad(i::text, 6, '0'), 'bench.task' || (i % 20), '[]', '{}',
                   '{}', 'cron', '{"kind": "cron", "expr": "*/5 * * * *", "timezone": "UTC"}',
                   'UTC', 'group' || (i % 4), 'runtime',
                   date_trunc('hour', now()) + interval '5 minutes',
                   date_trunc('hour', now()), now(), now()
            FROM generate_series(1, :n) AS i"""), {"n": n_entries})
        conn.execute(sa.text("""
            INSERT INTO reliable_beat_runs (idempotency_key, entry_name, fire_at, trigger, task,
                args, kwargs, state, attempts, created_at, updated_at, dispatched_at,
                started_at, finished_at, fence_token)
            SELECT e.name || '@' || k, e.name, date_trunc('hour', now()) - k * interval '5 min',
                   'schedule', e.task, '[]', '{}',
                   CASE WHEN (e.id + k) % 500 = 0 THEN 'dead' ELSE 'succeeded' END, 1,
                   date_trunc('hour', now()) - k * interval '5 min',
                   date_trunc('hour', now()) - k * interval '5 min',
                   date_trunc('hour', now()) - k * interval '5 min'
                     + CASE WHEN (e.id + k) % 50 = 0 THEN interval '30 s' ELSE interval '1 s' END,
                   date_trunc('hour', now()) - k * interval '5 min' + interval '1 s',
                   date_trunc('hour', now()) - k * interval '5 min' + interval '2 s', 1
            FROM reliable_beat_entries e CROSS JOIN generate_series(0, :per - 1) AS k"""),
            {"per": per})
        conn.execute(sa.text("""
            INSERT INTO reliable_beat_attempts (run_id, attempt, fence_token, worker,
                started_at, finished_at, outcome)
            SELECT id, 1, 1, 'worker-' || (id % 8), started_at, finished_at,
                   CASE state WHEN 'dead' THEN 'dead' ELSE 'succeeded' END
            FROM reliable_beat_runs"""))
    with store.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(sa.text("ANALYZE"))


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), max(times)


@contextlib.contextmanager
def database(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from harness.servers import PostgresServer

    with PostgresServer() as pg:
        yield pg.url


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dashboard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", default=None, help="an empty PostgreSQL database")
    ap.add_argument("--entries", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    with database(args.database_url) as url:
        store = Store.from_url(url, role="cli")
        upgrade(store)
        t0 = time.perf_counter()
        seed(store, args.entries, args.runs)
        print(f"seeded {args.entries} entries, {args.runs} runs in "
              f"{time.perf_counter() - t0:.0f} s")
        web = create_app(store, auth=AuthConfig(), status_ttl_seconds=3600)
        with TestClient(web, client=("127.0.0.1", 1)) as c:
            def get(path: str) -> Callable[[], Any]:
                def call() -> None:
                    r = c.get(path)
                    assert r.status_code == 200, (path, r.status_code)
                return call

            rows = [("status collection (first overview only)",
                     timed(lambda: collect_status(store), 3))]
            get("/")()  # the alarms collected once
            mid = f"entry-{args.entries // 2:06d}"
            last_page = max(args.entries // 100, 1)
            for label, path in (("overview", "/"), ("entries, page 1", "/entries"),
                                ("entries, page 200", f"/entries?page={last_page}"),
                                ("entries, group filter", "/entries?group=group1&page=50"),
                                ("entries, outcome dead", "/entries?outcome=dead"),
                                ("entry page", f"/entries/{mid}"),
                                ("runs, page 1", "/runs"),
                                ("runs of one entry", f"/runs?entry={mid}")):
                rows.append((label, timed(get(path), args.repeat)))
        print(f"{'page':42} {'median ms':>10} {'worst ms':>10}")
        for label, (med, worst) in rows:
            print(f"{label:42} {med:10.1f} {worst:10.1f}")
        store.dispose()


if __name__ == "__main__":
    main()
