"""3. Fire lateness: real ``celery beat`` processes, N entries every second.

For each scheduler (ours with 1 and 3 beats, stock ``PersistentScheduler``, RedBeat) in one
run, on the same servers:

* a recorder process ``BRPOP``s every message from the ``celery`` list the moment it lands
  (draining a burst with one ``RPOP celery 1000``) and records ``time.time()`` when the pop
  returned (an upper bound of the arrival in Redis), then forwards it unchanged to the
  ``lat_work`` list;
* one ``celery worker --pool solo -Q lat_work`` runs ``lat.probe``, which records
  ``time.time()`` when its body starts.

Publish lateness = arrival - fire time; execution lateness = body start - fire time (includes
the recorder's hop, well under a millisecond). The fire time of ours is the slot, from the
message's ``reliable_beat_fire_at`` header. Stock beat and RedBeat carry no fire time, so the
probe schedulers below stamp ``bench_due_at = last_run_at + run_every`` (the instant the
scheduler itself considers the entry due) into the headers at publish; their grid drifts by
their own lateness every run, ours does not.

This module is also the Celery app of those processes (``-A benchmarks.lateness:app``),
configured from ``LAT_*`` environment variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from datetime import datetime, timedelta
from typing import Any

from benchmarks.common import PY, ROOT, Env, check, median, pct, table

TARGET_MEDIAN_MS = 2.0
TARGET_P99_MS = 10.0
ARRIVALS = "lat_arrive"
EXECS = "lat_exec"
WORK_QUEUE = "lat_work"

# -- the Celery app of the beat / worker processes ----------------------------------------
_due: list[float | None] = [None]


def _due_at(entry: Any) -> float:
    last = entry.last_run_at
    if last.tzinfo is None:
        from datetime import timezone

        last = last.replace(tzinfo=timezone.utc)
    return float((last + entry.schedule.run_every).timestamp())


def _make_app() -> Any:
    from celery import Celery
    from celery.beat import PersistentScheduler
    from celery.signals import before_task_publish

    broker = os.environ["LAT_BROKER"]
    app = Celery("lat", broker=broker)
    app.conf.timezone = "UTC"
    app.conf.broker_connection_retry_on_startup = True
    app.conf.beat_max_loop_interval = 5
    app.conf.worker_hijack_root_logger = False
    if os.environ.get("LAT_DB"):
        app.conf.reliable_beat_database_url = os.environ["LAT_DB"]
    app.conf.redbeat_redis_url = broker
    n = int(os.environ.get("LAT_N", "0"))
    app.conf.beat_schedule = {
        f"lat-{i}": {"task": "lat.probe", "schedule": timedelta(seconds=1)} for i in range(n)
    }

    @before_task_publish.connect(weak=False)
    def _stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers is not None and _due[0] is not None:
            headers["bench_due_at"] = _due[0]

    r: list[Any] = []

    @app.task(name="lat.probe", bind=True)
    def probe(self: Any) -> None:
        start = time.time()
        req = self.request
        headers = getattr(req, "headers", None) or {}
        fire = getattr(req, "reliable_beat_fire_at", None) or headers.get("reliable_beat_fire_at")
        if fire:
            fire_ts = datetime.fromisoformat(fire.replace("Z", "+00:00")).timestamp()
        else:
            fire_ts = getattr(req, "bench_due_at", None) or headers.get("bench_due_at")
        if not r:
            import redis

            r.append(redis.Redis.from_url(broker))
        r[0].lpush(EXECS, json.dumps([fire_ts, start]))

    class StockProbe(PersistentScheduler):  # type: ignore[misc]
        def apply_async(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
            _due[0] = _due_at(entry)
            try:
                return super().apply_async(entry, *args, **kwargs)
            finally:
                _due[0] = None

    app.StockProbe = StockProbe
    try:
        from redbeat import RedBeatScheduler

        class RedBeatProbe(RedBeatScheduler):  # type: ignore[misc]
            def apply_async(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
                _due[0] = _due_at(entry)
                try:
                    return super().apply_async(entry, *args, **kwargs)
                finally:
                    _due[0] = None

        app.RedBeatProbe = RedBeatProbe
    except ImportError:
        pass
    return app


app = _make_app() if os.environ.get("LAT_BROKER") else None
StockProbe = getattr(app, "StockProbe", None)
RedBeatProbe = getattr(app, "RedBeatProbe", None)


# -- the recorder ---------------------------------------------------------------------------
def recorder(redis_url: str) -> None:
    """``BRPOP`` ``celery``, stamp arrival, forward to ``lat_work`` (runs until killed).

    A burst (every message of one slot lands within a millisecond or two) is drained at
    once: after the ``BRPOP`` returns one message, a non-blocking ``RPOP celery 1000`` takes
    every other message already there, and each is stamped with the time the call that
    returned it came back, an upper bound of its arrival. Popping, parsing and forwarding
    one message per round trip (about 0.3-0.5 ms each on this machine) would stamp the
    100th message of a burst some 40 ms after it landed, measuring the recorder instead.
    """
    import redis

    r = redis.Redis.from_url(redis_url)
    while True:
        item = r.brpop(["celery"], timeout=1)
        if item is None:
            continue
        stamped = [(item[1], time.time())]
        rest = r.rpop("celery", 1000) or []
        arrived = time.time()
        stamped.extend((raw, arrived) for raw in rest)
        pipe = r.pipeline(transaction=False)
        for raw, at in stamped:
            msg = json.loads(raw)
            h = msg.get("headers") or {}
            if h.get("reliable_beat_fire_at"):
                fire = datetime.fromisoformat(
                    h["reliable_beat_fire_at"].replace("Z", "+00:00")).timestamp()
            else:
                fire = h.get("bench_due_at")
            msg.setdefault("properties", {}).setdefault("delivery_info", {})
            msg["properties"]["delivery_info"]["routing_key"] = WORK_QUEUE
            pipe.lpush(WORK_QUEUE, json.dumps(msg))
            pipe.lpush(ARRIVALS, json.dumps([fire, at]))
        pipe.execute()


# -- the driver -----------------------------------------------------------------------------
def _spawn(args: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PY, *args], env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _measure(env: Env, r: Any, name: str, scheduler: str, beats: int, extra: dict[str, str],
             tmp: str) -> dict[str, Any]:
    size = env.size
    r.delete(ARRIVALS, EXECS, "celery", WORK_QUEUE)
    lat_env = {"LAT_BROKER": env.redis_url, "LAT_N": str(size.lateness_entries), **extra}
    procs = []
    log = open(os.path.join(tmp, f"{name}.log"), "ab")  # noqa: SIM115
    for i in range(beats):
        procs.append(_spawn(["-m", "celery", "-A", "benchmarks.lateness:app", "beat", "-S",
                             scheduler, "-s", os.path.join(tmp, f"{name}-{i}.db"),
                             "--pidfile=", "--loglevel=WARNING"], lat_env, log))
    try:
        deadline = time.time() + 60
        while r.llen(ARRIVALS) == 0:
            if time.time() > deadline:
                raise RuntimeError(f"lateness {name}: no message within 60 s (log {log.name})")
            time.sleep(0.05)
        warm = min(2.0, size.lateness_seconds / 2)  # every beat is up and looping by then
        t_start = time.time() + warm
        time.sleep(warm + size.lateness_seconds)
        t_end = t_start + size.lateness_seconds
    finally:
        for p in procs:
            _stop(p)
        log.close()
    time.sleep(1.0)  # let the worker drain

    def window(key: str) -> list[float]:
        out = []
        for raw in r.lrange(key, 0, -1):
            fire, at = json.loads(raw)
            if fire is not None and t_start <= fire < t_end:
                out.append((at - fire) * 1000)
        return out

    pub, exe = window(ARRIVALS), window(EXECS)
    return {"pub": pub, "exe": exe}


def run(env: Env) -> str:
    import multiprocessing as mp

    import redis

    size = env.size
    r = redis.Redis.from_url(env.redis_url)
    env.flush_redis()
    results: dict[str, dict[str, Any]] = {}
    notes = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        ctx = mp.get_context("spawn")
        rec = ctx.Process(target=recorder, args=(env.redis_url,), daemon=True)
        rec.start()
        stack.callback(rec.kill)
        wlog = open(os.path.join(tmp, "worker.log"), "ab")  # noqa: SIM115
        stack.callback(wlog.close)
        worker = _spawn(["-m", "celery", "-A", "benchmarks.lateness:app", "worker", "-Q",
                         WORK_QUEUE, "--pool", "solo", "--loglevel=WARNING", "--without-gossip",
                         "--without-mingle", "--without-heartbeat", "-n", "lat@%h"],
                        {"LAT_BROKER": env.redis_url}, wlog)
        stack.callback(_stop, worker)
        configs: list[tuple[str, str, int, dict[str, str]]] = []
        for beats in (1, 3):
            configs.append((f"reliable_beat x {beats}", "reliable_beat.celery:ReliableScheduler",
                            beats, {}))
        configs.append(("stock beat x 1", "benchmarks.lateness:StockProbe", 1, {}))
        try:
            import redbeat  # noqa: F401

            configs.append(("RedBeat x 1", "benchmarks.lateness:RedBeatProbe", 1, {}))
        except ImportError:
            notes.append("RedBeat not installed: not measured")
        for name, sched, beats, extra in configs:
            if sched.startswith("reliable_beat"):
                with env.database("lateness") as db_url:
                    results[name] = _measure(env, r, name.split()[0] + str(beats), sched,
                                             beats, {"LAT_DB": db_url}, tmp)
            else:
                results[name] = _measure(env, r, name.split()[0], sched, beats, extra, tmp)
    r.close()
    rows = []
    for name, res in results.items():
        pub, exe = res["pub"], res["exe"]
        rows.append([name, len(pub), median(pub), pct(pub, 99), max(pub, default=float("nan")),
                     median(exe), pct(exe, 99), max(exe, default=float("nan"))])
    ours3 = results.get("reliable_beat x 3", {}).get("pub", [])
    rb = results.get("RedBeat x 1", {}).get("pub", [])
    stock = results.get("stock beat x 1", {}).get("pub", [])
    m3, p3 = median(ours3), pct(ours3, 99)
    targets = [
        ["3 beats: median publish lateness", f"{m3:.2f} ms", "≤ 2 ms",
         check(m3 <= TARGET_MEDIAN_MS)],
        ["3 beats: p99 publish lateness", f"{p3:.2f} ms", "≤ 10 ms", check(p3 <= TARGET_P99_MS)],
        ["3 beats p99 vs RedBeat p99", f"{p3:.2f} vs {pct(rb, 99):.2f} ms", "better",
         check(p3 < pct(rb, 99)) if rb else "n/a"],
        ["3 beats median vs stock median", f"{m3:.2f} vs {median(stock):.2f} ms",
         "within a few ms", check(m3 - median(stock) <= 3.0) if stock else "n/a"],
    ]
    out = [
        f"### 3. Fire lateness ({size.lateness_entries} entries every 1 s, "
        f"{size.lateness_seconds:.0f} s measured per scheduler, real `celery beat` processes)",
        "",
        table(["scheduler", "messages", "publish median ms", "publish p99 ms", "publish max ms",
               "exec start median ms", "exec start p99 ms", "exec start max ms"], rows),
        "",
        table(["ratio", "measured", "target", ""], targets),
        *(["", *[f"- {n}" for n in notes]] if notes else []),
    ]
    return "\n".join(out)
