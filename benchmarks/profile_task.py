"""CPU per call of an ``IdempotentTask`` against a plain task writing the same row, in-process.

Not part of ``python -m benchmarks`` (it prints no target); the tool behind the figures of
``docs/performance.md`` (*CPU per call of an IdempotentTask*). Both tasks insert one row into
``bench_effects`` (as in part 4, ``benchmarks/task_overhead.py``), called through Celery's
tracer in-process (``task.apply``: no broker, so the worker's per-message cost is left out)
on a private PostgreSQL. Per call: the worker's CPU (``time.process_time``) and the
PostgreSQL cluster's (the postmaster's children, from ``/proc``; 10 ms clock ticks, so read
the server figure over blocks of 100 calls or more).

    # A/B of source trees, each tree in its own process, alternated --rounds times
    PYTHONPATH=. python benchmarks/profile_task.py --n 600 --rounds 5 /path/to/old /path/to/new
    # + cProfile tables (written to /tmp/profile_task-<tree>-<mode>.txt)
    PYTHONPATH=. python benchmarks/profile_task.py --n 400 --rounds 1 --profile .
    # one process, blocks of 100 calls alternated: plain task, the claim and completion
    # through SQLAlchemy Core (conn.execute), and on the psycopg connection (the default)
    PYTHONPATH=. python benchmarks/profile_task.py --toggle --n 1600 .
    # one process, blocks of AB_BLOCK (200) calls alternating plain / old / new of an
    # experiment (noattempt: no attempt row for a first try; indexes: partial state / entry
    # indexes on the runs table), + row writes per call from pg_stat_user_tables
    PYTHONPATH=. python benchmarks/profile_task.py --ab noattempt --n 3200 .
    # + the server's side per statement (pg_stat_statements: calls, execution time, WAL
    # records and bytes per call), printed after the runs
    PYTHONPATH=. python benchmarks/profile_task.py --n 1000 --rounds 1 --statements .
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def pg_children_cpu(postmaster: int) -> float:
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


def child(tree, url, mode, n, profile, postmaster, tag):
    sys.path.insert(0, tree)
    import sqlalchemy as sa
    from celery import Celery

    from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
    from reliable_beat.execution import store_for

    app = Celery("perf", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_database_url=url,
                    task_ignore_result=True)
    effects = sa.Table("bench_effects", sa.MetaData(),
                       sa.Column("id", sa.Integer, primary_key=True),
                       sa.Column("key", sa.String(200)), sa.Column("n", sa.Integer))
    store = store_for(url)

    @app.task(name="p.plain", shared=False)
    def plain(i):
        with store.begin() as conn:
            conn.execute(effects.insert().values(key=f"plain:{i}", n=i))

    runs_t = sa.Table("reliable_beat_runs", sa.MetaData(), autoload_with=store.engine)

    @app.task(name="p.keyed", shared=False)
    def keyed(i, key):
        # --ab floor: the plain task plus a succeeded run row in the effect's transaction:
        # what any design recording a key with the effect writes, without claim or lease
        with store.begin() as conn:
            conn.execute(effects.insert().values(key=key, n=i))
            conn.execute(runs_t.insert().values(
                idempotency_key=key, task="p.keyed", args=[i], kwargs={}, state="succeeded",
                fence_token=1, attempts=1, created_at=sa.func.now(),
                updated_at=sa.func.now(), started_at=sa.func.now(), finished_at=sa.func.now()))

    key_sql = ("INSERT INTO reliable_beat_runs (idempotency_key, task, args, kwargs, state,"
               " fence_token, attempts, created_at, updated_at, started_at, finished_at)"
               " VALUES (%s, 'p.keyed', %s, '{}', 'succeeded', 1, 1, now(), now(), now(),"
               " now())")

    @app.task(name="p.keyed_driver", shared=False)
    def keyed_driver(i, key):
        # --ab floor_driver: the same key row, on the psycopg cursor (prepared), no Core
        from psycopg.types.json import Jsonb
        with store.begin() as conn:
            conn.execute(effects.insert().values(key=key, n=i))
            cur = conn.connection.dbapi_connection.cursor()
            cur.execute(key_sql, (key, Jsonb([i])), prepare=True)

    @app.task(base=IdempotentTask, bind=True, name="p.idem", shared=False)
    def idem(self, i):
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key, n=i))

    def call(i, key):
        if mode == "plain":
            plain.apply((i,))
        else:
            idem.apply((i,), headers={KEY_HEADER: key})

    if mode.startswith("ab:"):
        ab(mode[3:], n, url, postmaster, tag, plain, idem,
           keyed_driver if mode == "ab:floor_driver" else keyed, KEY_HEADER)
        return
    if mode == "toggle":
        import statistics

        from reliable_beat.runs import claim as cl
        from reliable_beat.runs import complete as co
        real = cl.uses_psycopg
        def setpath(driver):
            f = real if driver else (lambda c: False)
            cl.uses_psycopg = f
            co.uses_psycopg = f
        for i in range(20):
            idem.apply((i,), headers={KEY_HEADER: f"warm{tag}:{i}"})
            plain.apply((i,))
        res = {"plain": [], "sqla": [], "driver": [], "replay_sqla": [], "replay_driver": []}
        blk = 100
        for b in range(n // blk):
            order = [("plain", None), ("sqla", False), ("driver", True)]
            if b % 2:
                order.reverse()
            for name, drv in order:
                if drv is not None:
                    setpath(drv)
                keys = [f"{tag}:{name}:{b}:{i}" for i in range(blk)]
                for sub, ks in ((name, keys), ("replay_" + name, keys)):
                    if sub == "replay_plain":
                        continue
                    pg0 = pg_children_cpu(postmaster)
                    c0 = time.process_time()
                    for i, k in enumerate(ks):
                        if name == "plain":
                            plain.apply((i,))
                        else:
                            idem.apply((i,), headers={KEY_HEADER: k})
                    c1 = time.process_time()
                    pg1 = pg_children_cpu(postmaster)
                    res[sub].append(((c1 - c0) / blk * 1e6, (pg1 - pg0) / blk * 1e6))
        out = {}
        for k, v in res.items():
            w = [a for a, _ in v]
            p = [b for _, b in v]
            out[k] = {"cpu_med": statistics.median(w), "cpu_min": min(w), "cpu_max": max(w),
                      "pg_med": statistics.median(p), "pg_min": min(p), "pg_max": max(p)}
        print(json.dumps(out))
        return
    keys = [f"{tag}:{i}" for i in range(n)]
    for i in range(20):  # warm
        call(i, f"warm{tag}:{i}")
    if mode == "replay":
        pass  # keys used by prior 'idem' run with same tag
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile(time.process_time)
    pg0 = pg_children_cpu(postmaster)
    c0 = time.process_time()
    w0 = time.perf_counter()
    if prof:
        prof.enable()
    for i in range(n):
        call(i, keys[i])
    if prof:
        prof.disable()
    c1 = time.process_time()
    w1 = time.perf_counter()
    pg1 = pg_children_cpu(postmaster)
    if prof:
        import pstats
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    print(json.dumps({"cpu_us": (c1 - c0) / n * 1e6, "pg_us": (pg1 - pg0) / n * 1e6,
                      "wall_us": (w1 - w0) / n * 1e6}))


#: ``--ab``: what "old" and "new" mean for each experiment (set before each block; nothing
#: of it ships). indexes: the runs table's state and entry indexes full, or partial (DDL
#: between blocks). noattempt: the claim and completion with or without their attempt-row
#: CTEs (the happy path of a first try recorded on the run row alone). floor: the
#: IdempotentTask against the plain task that also inserts a succeeded run row with its
#: effect (no claim, no lease, no fence: the least any keyed design writes); floor_driver:
#: the same row inserted on the psycopg cursor (prepared) instead of through Core.
_PARTIAL_INDEXES = [
    "CREATE INDEX ix_ab_state ON reliable_beat_runs (state) WHERE state <> 'succeeded'",
    "CREATE INDEX ix_ab_entry_created ON reliable_beat_runs (entry_name, created_at)"
    " WHERE entry_name IS NOT NULL",
    "CREATE UNIQUE INDEX ix_ab_entry_fire ON reliable_beat_runs (entry_name, fire_at)"
    " WHERE entry_name IS NOT NULL",
]
_FULL_INDEXES = [
    "CREATE INDEX ix_reliable_beat_runs_state ON reliable_beat_runs (state)",
    "CREATE INDEX ix_reliable_beat_runs_entry_name_created_at ON reliable_beat_runs"
    " (entry_name, created_at)",
    "ALTER TABLE reliable_beat_runs ADD CONSTRAINT uq_reliable_beat_runs_entry_name_fire_at"
    " UNIQUE (entry_name, fire_at)",
]


def ab(variant, n, url, postmaster, tag, plain, idem, keyed, key_header):
    """Blocks of ``--block`` calls alternating plain / old / new (order flipped every other
    block); per block the worker's CPU, the server's CPU, and (at the end, in a separate
    phase of 300 calls each) the row writes per call from pg_stat_user_tables."""
    import statistics

    import sqlalchemy as sa

    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    state = {"indexes": "old"}

    def ddl(stmts):
        with admin.connect() as c:
            for q in stmts:
                c.execute(sa.text(q))

    import importlib
    cl = importlib.import_module("reliable_beat.runs.claim")
    co = importlib.import_module("reliable_beat.runs.complete")  # runs.complete: a function
    real_stmts = (cl._PG_CLAIM, co._PG_COMPLETE)
    if variant == "noattempt":
        # the same claim and completion minus their attempt-row CTEs (the happy path of a
        # first try recorded on the run row alone): what not writing that row saves
        claim_join = cl._pg_claim_statement().get_final_froms()[0]
        got = claim_join.left
        done_join = co._pg_complete_statement().get_final_froms()[0]
        bare = (cl.DriverStatement(lambda: sa.select(
                    got, sa.literal_column("0").label("attempt_id"))),
                co.DriverStatement(lambda: sa.select(
                    done_join.left.c.id, done_join.right.c.prev_state).select_from(done_join)))

    def setup(which):
        if variant == "noattempt":
            cl._PG_CLAIM, co._PG_COMPLETE = real_stmts if which == "old" else bare
        if variant == "indexes" and state["indexes"] != which:
            if which == "new":
                ddl(["DROP INDEX ix_reliable_beat_runs_state",
                     "DROP INDEX ix_reliable_beat_runs_entry_name_created_at",
                     "ALTER TABLE reliable_beat_runs DROP CONSTRAINT"
                     " uq_reliable_beat_runs_entry_name_fire_at", *_PARTIAL_INDEXES])
            else:
                ddl(["DROP INDEX ix_ab_state", "DROP INDEX ix_ab_entry_created",
                     "DROP INDEX ix_ab_entry_fire", *_FULL_INDEXES])
            state["indexes"] = which

    def run(name, keys):
        for i, k in enumerate(keys):
            if name == "plain":
                plain.apply((i,))
            elif variant.startswith("floor") and name == "new":
                keyed.apply((i, k))
            else:
                idem.apply((i,), headers={key_header: k})

    for which in ("old", "new"):  # warm both paths
        setup(which)
        run(which, [f"warm{tag}:{which}:{i}" for i in range(20)])
    run("plain", range(20))
    blk = int(os.environ.get("AB_BLOCK", "200"))
    res = {"plain": [], "old": [], "new": [], "replay_old": [], "replay_new": []}
    for b in range(n // blk):
        order = ["plain", "old", "new"]
        if b % 2:
            order.reverse()
        for name in order:
            setup(name if name != "plain" else "old")
            keys = [f"{tag}:{name}:{b}:{i}" for i in range(blk)]
            replays = name != "plain" and not (variant.startswith("floor") and name == "new")
            for sub in ((name, "replay_" + name) if replays else (name,)):
                pg0 = pg_children_cpu(postmaster)
                c0 = time.process_time()
                run(name, keys)
                c1 = time.process_time()
                pg1 = pg_children_cpu(postmaster)
                res[sub].append(((c1 - c0) / blk * 1e6, (pg1 - pg0) / blk * 1e6))
    stats_q = sa.text(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE relname IN ('reliable_beat_runs', 'reliable_beat_attempts', 'bench_effects')")

    def stats():
        time.sleep(11)  # backends flush their table counters within PGSTAT_IDLE_INTERVAL
        with admin.connect() as c:
            c.execute(sa.text("SET stats_fetch_consistency = none"))
            return {r[0]: r[1:] for r in c.execute(stats_q)}

    rows = {}
    calls = 300
    for name in ("old", "new"):
        setup(name)
        before = stats()
        run(name, [f"{tag}:rows:{name}:{i}" for i in range(calls)])
        after = stats()
        rows[name] = {t: {k: (after[t][j] - before[t][j]) / calls
                          for j, k in enumerate(("ins", "upd", "hot_upd"))} for t in after}
    setup("old")
    out = {}
    for k, v in res.items():
        if not v:
            continue
        w = [a for a, _ in v]
        p = [b for _, b in v]
        out[k] = {"cpu_med": statistics.median(w), "cpu_min": min(w), "cpu_max": max(w),
                  "pg_med": statistics.median(p), "pg_min": min(p), "pg_max": max(p)}
    for name in ("old", "new"):
        out["ratio_" + name] = {
            "total": (out["plain"]["cpu_med"] + out["plain"]["pg_med"])
            / (out[name]["cpu_med"] + out[name]["pg_med"]),
            "worker": out["plain"]["cpu_med"] / out[name]["cpu_med"]}
        out["rows_" + name] = rows[name]
    print(json.dumps(out))


def main():
    if sys.argv[1] == "--child":
        tree, url, mode, n, profile, pm, tag = sys.argv[2:9]
        child(tree, url, mode, int(n), profile == "1", int(pm), tag)
        return
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--toggle", action="store_true")
    ap.add_argument("--ab", choices=("indexes", "noattempt", "floor", "floor_driver"),
                    help="one process, blocks alternating plain / old / new of an experiment")
    ap.add_argument("--statements", action="store_true",
                    help="load pg_stat_statements and print its per-statement table at the end")
    ap.add_argument("trees", nargs="+")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import sqlalchemy as sa

    from harness.servers import PostgresServer
    conf = ({"shared_preload_libraries": "pg_stat_statements"} if args.statements else {})
    with PostgresServer(extra_conf=conf) as pg:
        from reliable_beat.db.dialects import Store
        from reliable_beat.db.migrate import upgrade
        st = Store.from_url(pg.url)
        upgrade(st)
        with st.engine.begin() as c:
            c.execute(sa.text("CREATE TABLE bench_effects "
                              "(id serial PRIMARY KEY, key varchar(200), n int)"))
            if args.statements:
                c.execute(sa.text("CREATE EXTENSION pg_stat_statements"))
        st.dispose()
        pm = int((pg.datadir / "data" / "postmaster.pid").read_text().split()[0])
        res = {}
        if args.toggle or args.ab:
            mode = f"ab:{args.ab}" if args.ab else "toggle"
            out = subprocess.run([sys.executable, __file__, "--child", args.trees[0], pg.url,
                                  mode, str(args.n), "0", str(pm), "tg"],
                                 capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": args.trees[0]})
            print(out.stderr[-3000:])
            d = json.loads(out.stdout.strip().splitlines()[-1])
            for k, v in d.items():
                if k.startswith("rows_"):
                    print(k, {t: {a: round(b, 2) for a, b in c.items()} for t, c in v.items()})
                elif k.startswith("ratio_"):
                    print(k, {a: round(b, 2) for a, b in v.items()})
                else:
                    print(k, {a: round(b) for a, b in v.items()})
            return
        for r in range(args.rounds):
            for ti, tree in enumerate(args.trees):
                for mode in ("plain", "idem", "replay"):
                    tag = f"r{r}t{ti}"
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", tree, pg.url, mode, str(args.n),
                         "1" if args.profile else "0", str(pm), tag],
                        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
                    if out.returncode:
                        print(out.stderr[-3000:])
                        raise SystemExit(1)
                    if args.profile:
                        Path(f"/tmp/profile_task-{ti}-{mode}.txt").write_text(out.stderr)
                    d = json.loads(out.stdout.strip().splitlines()[-1])
                    res.setdefault((tree, mode), []).append(d)
                    print(r, tree, mode, {k: round(v) for k, v in d.items()}, flush=True)
        import statistics
        print("\nsummary (median [min-max]) per call")
        for tree in args.trees:
            for mode in ("plain", "idem", "replay"):
                ds = res[(tree, mode)]
                line = []
                for k in ("cpu_us", "pg_us", "wall_us"):
                    v = [d[k] for d in ds]
                    line.append(f"{k} {statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]")
                print(tree, mode, "; ".join(line))
            tot = {m: [d["cpu_us"] + d["pg_us"] for d in res[(tree, m)]]
                   for m in ("plain", "idem")}
            ratios = [p / i for p, i in zip(tot["plain"], tot["idem"], strict=True)]
            print(tree, "plain/idem total-CPU ratio per round:", [round(x, 2) for x in ratios])
        if args.statements:
            print_statements(pg.url)


def print_statements(url):
    """pg_stat_statements over every run above (all trees and modes together): per
    statement its calls, mean execution time, and WAL records / bytes per call."""
    import sqlalchemy as sa
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    q = sa.text(
        "SELECT calls, total_exec_time / calls * 1000 AS exec_us, wal_records::float / calls,"
        " wal_bytes::float / calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 90)"
        " FROM pg_stat_statements WHERE calls >= 100 ORDER BY total_exec_time DESC LIMIT 15")
    print("\npg_stat_statements: calls, exec us/call, WAL records/call, WAL bytes/call, query")
    with engine.connect() as c:
        for calls, us, recs, wal, query in c.execute(q):
            print(f"{calls:7d} {us:7.1f} {recs:6.1f} {wal:8.0f}  {query}")
    engine.dispose()


if __name__ == "__main__":
    main()
