"""4. Task overhead: an ``IdempotentTask`` against a plain task doing the same insert.

Both tasks insert one row into ``bench_effects``: the plain one in its own transaction
(``store.begin()``), the idempotent one in ``self.transaction()`` (claim: lease + fence in a
short transaction, then effect + fenced completion in one). N messages are queued first,
then one real ``celery worker`` (``--pool solo``, then ``--pool prefork -c 2``) drains them;
the clock runs from the first message taken to the queue empty and every effect committed,
so worker start-up is left out. The replay row re-sends the same N keys after the
idempotent run: every execution is a deduplicated no-op (the key is already ``succeeded``).

This module is also the Celery app of the worker (``-A benchmarks.task_overhead:app``),
configured from ``TO_BROKER`` / ``TO_DB``; ``TO_TRACING=1``: the worker runs with the
OpenTelemetry SDK's ``TracerProvider`` and a ``BatchSpanProcessor`` whose exporter drops
every span (the cost of making the spans, none of shipping them).

``python -m benchmarks --only task_overhead --tracing`` measures the ``IdempotentTask`` with
tracing off and on instead (target: at most 5 % more CPU per call with tracing on): two
workers kept running, one per setting, in alternating blocks (:func:`_tracing_rows`); the
load-independent count is ``benchmarks/profile_tracing.py``'s (instructions per call).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from typing import Any

from benchmarks.common import PY, ROOT, Env, check, spread, table

QUEUE = "to_q"
TARGET = 0.7  # IdempotentTask / plain task, in every run
TRACING_TARGET = 0.95  # tracing on: at most 5 % slower than off


def _make_app() -> Any:
    import sqlalchemy as sa
    from celery import Celery

    from reliable_beat.celery.task import IdempotentTask
    from reliable_beat.db.dialects import Store

    if os.environ.get("TO_TRACING") == "1":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class _Drop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(_Drop()))
        trace.set_tracer_provider(provider)

    app = Celery("to", broker=os.environ["TO_BROKER"])
    app.conf.update(
        broker_connection_retry_on_startup=True, task_ignore_result=True,
        worker_hijack_root_logger=False, reliable_beat_database_url=os.environ["TO_DB"],
        task_default_queue=QUEUE,
    )
    effects = sa.Table("bench_effects", sa.MetaData(),
                       sa.Column("id", sa.Integer, primary_key=True),
                       sa.Column("key", sa.String(200)), sa.Column("n", sa.Integer))
    stores: dict[int, Store] = {}

    def store() -> Store:
        pid = os.getpid()
        if pid not in stores:
            stores[pid] = Store.from_url(os.environ["TO_DB"], role="worker")
        return stores[pid]

    @app.task(name="to.plain")
    def plain(i: int) -> None:
        with store().begin() as conn:
            conn.execute(effects.insert().values(key=f"plain:{i}", n=i))

    class Keyed(IdempotentTask):  # type: ignore[misc]
        def idempotency_key_for(self, i: int, *args: Any, **kwargs: Any) -> str | None:
            return f"to:{os.environ.get('TO_RUN', '')}:{i}"

    @app.task(base=Keyed, bind=True, name="to.idem")
    def idem(self: Any, i: int) -> None:
        with self.transaction() as tx:
            tx.execute(effects.insert().values(key=self.idempotency_key, n=i))

    return app


app = _make_app() if os.environ.get("TO_BROKER") else None
_publishers: dict[tuple[str, str], Any] = {}


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its living descendants (a prefork
    worker's pool), from ``/proc``; 0.0 where ``/proc`` is missing."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return 0.0
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, total = {pid}, 0.0
    for _ in range(4):  # worker -> pool children (-> their threads' processes, none)
        tree |= {p for p, parent in parents.items() if parent in tree}
    for p in tree:
        total += cpu.get(p, 0.0)
    return total


def _drain(env: Env, db_url: str, task: str, n: int, pool: list[str], run_tag: str,
           expect_effects: int, tmp: str, cpu: list[float] | None = None) -> float:
    """Queue ``n`` calls of ``task``, start a worker, return calls/s of the drain.

    ``cpu``: append the worker's CPU per call (µs: the worker process and its pool's
    children, from the first message taken to the queue drained; sound on a loaded machine,
    where the rate is not)."""
    import redis
    import sqlalchemy as sa

    os.environ["TO_BROKER"], os.environ["TO_DB"], os.environ["TO_RUN"] = (
        env.redis_url, db_url, run_tag)
    key = (env.redis_url, db_url)
    if key not in _publishers:  # one app per servers: tasks register once per process
        _publishers[key] = _make_app()
    local = _publishers[key]
    r = redis.Redis.from_url(env.redis_url)
    r.delete(QUEUE)
    with local.producer_or_acquire() as producer:
        for i in range(n):
            local.tasks[task].apply_async((i,), producer=producer, queue=QUEUE)
    eng = sa.create_engine(db_url)
    log = open(os.path.join(tmp, f"worker-{task}.log"), "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [PY, "-m", "celery", "-A", "benchmarks.task_overhead:app", "worker", "-Q", QUEUE,
         *pool, "--loglevel=WARNING", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-n", f"to{run_tag}@%h"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while r.llen(QUEUE) >= n:
            if time.time() > deadline:
                raise RuntimeError(f"worker took nothing from {QUEUE} (log {log.name})")
            time.sleep(0.002)
        t0 = time.perf_counter()
        cpu0 = _tree_cpu(proc.pid)
        while True:
            if time.time() > deadline + 600:
                raise RuntimeError(f"{task}: queue not drained (log {log.name})")
            if r.llen(QUEUE) == 0 and r.hlen("unacked") == 0:
                with eng.connect() as conn:
                    done = conn.execute(sa.text("SELECT count(*) FROM bench_effects")).scalar()
                if done is not None and done >= expect_effects:
                    break
            time.sleep(0.005)
        elapsed = time.perf_counter() - t0
        if cpu is not None:
            cpu.append((_tree_cpu(proc.pid) - cpu0) / n * 1e6)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        eng.dispose()
        r.close()
    return n / elapsed


#: the ``traceparent`` of the tracing part's messages: a beat's trigger carries its slot's
#: (the worker's ``process`` span joins that trace); ignored with tracing off
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Worker:
    """A ``celery worker`` kept running across the blocks of the tracing part, on a queue of
    its own (``TO_TRACING`` fixed for its life), warmed up before it is measured."""

    def __init__(self, env: Env, db_url: str, pool: list[str], tracing: str, tag: str,
                 tmp: str) -> None:
        import redis

        self.queue = f"{QUEUE}_{tag}"
        self.redis = redis.Redis.from_url(env.redis_url)
        self.log = open(os.path.join(tmp, f"worker-{tag}.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [PY, "-m", "celery", "-A", "benchmarks.task_overhead:app", "worker", "-Q",
             self.queue, *pool, "--loglevel=WARNING", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-n", f"to{tag}@%h"],
            env={**os.environ, "PYTHONPATH": str(ROOT), "TO_BROKER": env.redis_url,
                 "TO_DB": db_url, "TO_RUN": tag, "TO_TRACING": tracing},
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.redis.close()


class _Blocks:
    """Blocks of calls drained by one of the workers at a time: the messages are queued on a
    staging list first, then renamed onto the worker's queue at once (its clock starts there;
    publishing is left out), and each block records calls/s and the CPU per call of the
    worker's process tree (``/proc``; the CPU a call costs, whatever else the machine runs)."""

    def __init__(self, app: Any, eng: Any) -> None:
        self.app = app
        self.eng = eng
        self.sent = 0

    def run(self, worker: _Worker, n: int) -> tuple[float, float]:
        import sqlalchemy as sa

        r = worker.redis
        stage = f"{worker.queue}_stage"
        with self.app.producer_or_acquire() as producer:
            for _ in range(n):
                self.sent += 1
                self.app.tasks["to.idem"].apply_async(
                    (self.sent,), producer=producer, queue=stage,
                    headers={"traceparent": TRACEPARENT})
        cpu0 = _tree_cpu(worker.proc.pid)
        t0 = time.perf_counter()
        r.rename(stage, worker.queue)
        deadline = time.time() + 600
        while True:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker exited (log {worker.log.name})")
            if time.time() > deadline:
                raise RuntimeError(f"{worker.queue}: not drained (log {worker.log.name})")
            if r.llen(worker.queue) == 0 and r.hlen("unacked") == 0:
                with self.eng.connect() as conn:
                    done = conn.execute(sa.text("SELECT count(*) FROM bench_effects")).scalar()
                if done is not None and done >= self.sent:
                    break
            time.sleep(0.003)
        elapsed = time.perf_counter() - t0
        return n / elapsed, (_tree_cpu(worker.proc.pid) - cpu0) / n * 1e6


def _tracing_rows(env: Env, eng: Any, db_url: str, n: int, tmp: str,
                  pools: list[tuple[str, list[str]]]) -> list[list[Any]]:
    """Per pool: one worker with tracing off and one with it on, both warmed up, then
    ``repeats`` runs of four blocks of ``n / 2`` calls in the order off, on, on, off (or the
    reverse), so a drift of the machine's load falls on both alike. Per run: the throughput
    ratio on/off and the CPU-per-call ratio off/on (the overhead: 0.95 = 5 % more CPU)."""
    os.environ["TO_BROKER"], os.environ["TO_DB"] = env.redis_url, db_url
    os.environ.pop("TO_TRACING", None)
    key = (env.redis_url, db_url)
    if key not in _publishers:
        _publishers[key] = _make_app()
    blocks = _Blocks(_publishers[key], eng)
    half = max(1, n // 2)
    rows = []
    for label, pool in pools[:1] if env.size.name == "smoke" else pools:
        load0 = os.getloadavg()[0]
        env.flush_redis()
        workers = {t: _Worker(env, db_url, pool, t, f"{label[:4]}t{t}", tmp) for t in "01"}
        try:
            for w in workers.values():
                blocks.run(w, min(200, n))  # start-up, connections, first calls: not measured
            rates: dict[str, list[float]] = {"0": [], "1": []}
            cpus: dict[str, list[float]] = {"0": [], "1": []}
            for rep in range(env.size.repeats):
                got: dict[str, list[tuple[float, float]]] = {"0": [], "1": []}
                for t in ("0", "1", "1", "0") if rep % 2 == 0 else ("1", "0", "0", "1"):
                    got[t].append(blocks.run(workers[t], half))
                for t, pairs in got.items():
                    rates[t].append(len(pairs) / sum(1 / rate for rate, _ in pairs))
                    cpus[t].append(sum(cpu for _, cpu in pairs) / len(pairs))
        finally:
            for w in workers.values():
                w.stop()
        ratios = [on / off for off, on in zip(rates["0"], rates["1"], strict=True)]
        cpu_ratios = [off / on for off, on in zip(cpus["0"], cpus["1"], strict=True)]
        load = f"{load0:.1f} → {os.getloadavg()[0]:.1f}"
        rows.append([label, load, spread(cpus["0"], digits=0), spread(cpus["1"], digits=0),
                     spread(cpu_ratios, "x", 3), ", ".join(f"{x:.3f}x" for x in cpu_ratios),
                     spread(rates["0"]), spread(rates["1"]), spread(ratios, "x", 3),
                     f"≥ {TRACING_TARGET}x (CPU, median)",
                     check(sorted(cpu_ratios)[len(cpu_ratios) // 2] >= TRACING_TARGET)])
    os.environ.pop("TO_TRACING", None)
    return rows


def run(env: Env) -> str:
    try:
        from reliable_beat.celery.task import IdempotentTask  # noqa: F401
    except ImportError:
        return ("### 4. Task overhead\n\npending: `reliable_beat/celery/task.py` "
                "(`IdempotentTask`) has not landed on main yet.")
    import sqlalchemy as sa

    n = env.size.task_n
    rows = []
    saved = {k: os.environ.get(k) for k in ("TO_BROKER", "TO_DB", "TO_RUN")}
    try:
        with tempfile.TemporaryDirectory() as tmp, env.database("tasks") as db_url:
            eng = sa.create_engine(db_url)
            with eng.begin() as conn:
                conn.execute(sa.text("CREATE TABLE bench_effects (id serial PRIMARY KEY, "
                                     "key varchar(200), n int)"))
            pools = [("solo", ["--pool", "solo"]),
                     ("prefork -c 2", ["--pool", "prefork", "-c", "2"])]
            if os.environ.get("BENCH_TRACING") == "1":
                rows = _tracing_rows(env, eng, db_url, n, tmp, pools)
                eng.dispose()
                return "\n".join([
                    f"### 4b. Task overhead of tracing ({n:,} IdempotentTask calls per run in "
                    f"four alternating blocks, {env.size.repeats} run(s); each cell the median "
                    "and the range; tracing on = OpenTelemetry SDK, BatchSpanProcessor, an "
                    "exporter that drops; each message carries a traceparent)",
                    "",
                    table(["worker pool", "load avg", "worker CPU µs/call off", "on",
                           "CPU off / on", "each run", "tracing off /s", "tracing on /s",
                           "on / off (throughput)", "target", ""], rows),
                ])
            measured: dict[str, list[tuple[float, float, float]]] = {}
            for rep in range(env.size.repeats):
                for label, pool in pools[:1] if env.size.name == "smoke" else pools:
                    tag = f"{label[:4]}{rep}"  # fresh keys per run: none deduplicated
                    env.flush_redis()
                    with eng.begin() as conn:
                        conn.execute(sa.text("TRUNCATE bench_effects"))
                    plain = _drain(env, db_url, "to.plain", n, pool, tag, n, tmp)
                    with eng.begin() as conn:
                        conn.execute(sa.text("TRUNCATE bench_effects"))
                    idem = _drain(env, db_url, "to.idem", n, pool, tag, n, tmp)
                    replay = _drain(env, db_url, "to.idem", n, pool, tag, n, tmp)
                    measured.setdefault(label, []).append((plain, idem, replay))
            for label, got in measured.items():
                ratios = [i / p for p, i, _ in got]
                rows.append([label, spread([p for p, _, _ in got]),
                             spread([i for _, i, _ in got]), spread([r for _, _, r in got]),
                             spread(ratios, "x", 2), ", ".join(f"{x:.2f}x" for x in ratios),
                             f"≥ {TARGET}x in every run", check(min(ratios) >= TARGET)])
            eng.dispose()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "\n".join([
        f"### 4. Task overhead ({n:,} queued calls drained by one worker; "
        + (f"{env.size.repeats} runs in a row, each cell the median and the range)"
           if env.size.repeats > 1 else "one run)"),
        "",
        table(["worker pool", "plain task /s", "IdempotentTask /s",
               "deduplicated replay /s", "idempotent / plain", "each run", "target", ""],
              rows),
    ])
