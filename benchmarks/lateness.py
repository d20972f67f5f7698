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
their own lateness every run, ours does not. So stock beat runs a second time on the same
whole-second grid as ours (:class:`GridSecond`, ``LAT_GRID=1``), measured against that slot,
and, with ``Sizes.lateness_background``, ours and stock beat once more beside one busy core.
Every row is measured ``Sizes.repeats`` times, interleaved.

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
from datetime import datetime, timedelta, timezone
from typing import Any

from benchmarks.common import PY, ROOT, Env, check, median, num, pct, spread, table

TARGET_MEDIAN_MS = 2.0
TARGET_P99_MS = 10.0
ARRIVALS = "lat_arrive"
#: The scheduler name of the floor rows (:func:`floor_publisher`, no scheduler at all).
FLOOR = "floor"
EXECS = "lat_exec"
WORK_QUEUE = "lat_work"

# -- the Celery app of the beat / worker processes ----------------------------------------
_due: list[float | None] = [None]


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def _grid_slot(last_run_at: datetime) -> datetime:
    """The whole second after ``last_run_at``: the slot a grid entry fires next."""
    return _aware(last_run_at).replace(microsecond=0) + timedelta(seconds=1)


def _due_at(entry: Any) -> float:
    if isinstance(entry.schedule, GridSecond):
        return _grid_slot(entry.last_run_at).timestamp()
    return float((_aware(entry.last_run_at) + entry.schedule.run_every).timestamp())


def _grid_schedule_class() -> type:
    from celery.schedules import schedstate, schedule

    class _GridSecond(schedule):  # type: ignore[misc]
        """Every whole second, like ours (``every=1`` on a whole-second grid).

        Stock beat's ``timedelta(seconds=1)`` fires each entry one second after *its own
        last run*: every entry drifts by its own lateness, the 100 entries drift apart and
        their publishes spread over the second. With this schedule every entry is due at
        the same whole second, the slot ours measures against, so the two are compared on
        the same instant with the same burst.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(timedelta(seconds=1), *args[1:], **kwargs)

        def is_due(self, last_run_at: datetime) -> Any:
            now = _aware(self.now())
            slot = _grid_slot(last_run_at)
            if now >= slot:
                nxt = now.replace(microsecond=0) + timedelta(seconds=1)
                return schedstate(True, (nxt - now).total_seconds())
            return schedstate(False, (slot - now).total_seconds())

        def remaining_estimate(self, last_run_at: datetime) -> timedelta:
            return _grid_slot(last_run_at) - _aware(self.now())

    _GridSecond.__name__ = _GridSecond.__qualname__ = "GridSecond"
    return _GridSecond


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
    every: Any = GridSecond() if os.environ.get("LAT_GRID") else timedelta(seconds=1)
    app.conf.beat_schedule = {
        f"lat-{i}": {"task": "lat.probe", "schedule": every} for i in range(n)
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


try:
    GridSecond: Any = _grid_schedule_class()
except ImportError:  # pragma: no cover - Celery is a dependency of the bench extra
    GridSecond = None
app = _make_app() if os.environ.get("LAT_BROKER") else None
StockProbe = getattr(app, "StockProbe", None)
RedBeatProbe = getattr(app, "RedBeatProbe", None)


# -- the recorder ---------------------------------------------------------------------------
def recorder(redis_url: str) -> None:
    """``BRPOP`` ``celery``, stamp arrival, forward to ``lat_work`` (runs until killed).

    A burst (every message of one slot lands within a millisecond or two) is drained at
    once: after the ``BRPOP`` returns one message, non-blocking ``RPOP celery 1000`` calls take
    every other message already there until one comes back empty, and each message is stamped
    with the time the call that returned it came back, an upper bound of its arrival. Only
    then is the burst forwarded, raw (nothing is parsed here: the driver reads the fire time
    afterwards), with the stamp, in one pipeline. Popping, parsing and forwarding one message
    per round trip would stamp the 100th message of a burst some 40 ms after it landed, and
    parsing between pops would stamp a second beat's burst late by the first one's parse:
    both would measure the recorder instead of the scheduler.
    """
    import redis

    r = redis.Redis.from_url(redis_url)
    while True:
        item = r.brpop(["celery"], timeout=1)
        if item is None:
            continue
        stamped = [(item[1], time.time())]
        while True:
            rest = r.rpop("celery", 1000)
            if not rest:
                break
            arrived = time.time()
            stamped.extend((raw, arrived) for raw in rest)
        pipe = r.pipeline(transaction=False)
        for raw, at in stamped:
            pipe.lpush(WORK_QUEUE, raw)
            pipe.lpush(ARRIVALS, b"%.6f " % at + raw)
        pipe.execute()


def _fire_time(msg: dict[str, Any]) -> float | None:
    """A message's fire time (epoch seconds): ours carry the slot in ``reliable_beat_fire_at``,
    the probes of stock beat and RedBeat ``bench_due_at``."""
    h = msg.get("headers") or {}
    if h.get("reliable_beat_fire_at"):
        return datetime.fromisoformat(
            h["reliable_beat_fire_at"].replace("Z", "+00:00")).timestamp()
    due = h.get("bench_due_at")
    return float(due) if due is not None else None


def floor_publisher(redis_url: str, template: bytes, count: int, seconds: float) -> None:
    """The floor of this measurement: ``count`` copies of a real ``lat.probe`` message, built
    before each whole second (own id, the slot in ``reliable_beat_fire_at``), pushed to
    ``celery`` in ONE Redis pipeline the moment the second comes (spinning the last
    millisecond, as a beat holding claimed-ahead triggers does). No database, no scheduler:
    what a publisher that does nothing else gets from this machine and this recorder."""
    import uuid

    import redis

    r = redis.Redis.from_url(redis_url)
    base = json.loads(template)
    end = time.time() + seconds
    while True:
        slot = float(int(time.time()) + 1)
        if slot >= end:
            return
        fire = datetime.fromtimestamp(slot, timezone.utc).isoformat().replace("+00:00", "Z")
        pipe = r.pipeline(transaction=False)
        for _ in range(count):
            tid = str(uuid.uuid4())
            msg = {**base, "headers": {**base["headers"], "id": tid, "root_id": tid,
                                       "reliable_beat_fire_at": fire}}
            msg["properties"] = {**base["properties"], "correlation_id": tid,
                                 "delivery_tag": str(uuid.uuid4())}
            pipe.lpush("celery", json.dumps(msg))
        left = slot - time.time()
        if left > 0.001:
            time.sleep(left - 0.001)
        while time.time() < slot:
            pass
        pipe.execute()


def _probe_template(redis_url: str) -> bytes:
    """One ``lat.probe`` message as Celery's ``send_task`` writes it to Redis."""
    import redis
    from celery import Celery

    app = Celery("lat-template", broker=redis_url)
    app.conf.broker_connection_retry_on_startup = True
    app.send_task("lat.probe", queue="lat_template")
    app.close()
    r = redis.Redis.from_url(redis_url)
    raw = r.rpop("lat_template")
    r.close()
    if raw is None:
        raise RuntimeError("lateness: the template message did not reach Redis")
    msg = json.loads(raw)
    msg["properties"]["delivery_info"]["routing_key"] = "celery"
    return json.dumps(msg).encode()


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
        if scheduler == FLOOR:  # the entries split over k publishers, as over k beats
            count = size.lateness_entries // beats + (i < size.lateness_entries % beats)
            procs.append(_spawn(["-c", "import os; from benchmarks.lateness import "
                                 "floor_publisher as f; f(os.environ['LAT_BROKER'], "
                                 "os.environ['LAT_TEMPLATE'].encode(), "
                                 f"{count}, 3600.0)"], lat_env, log))
            continue
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
            if key == ARRIVALS:  # "<stamp> <the raw message>" (see recorder)
                stamp, _, message = raw.partition(b" ")
                fire, at = _fire_time(json.loads(message)), float(stamp)
            else:
                fire, at = json.loads(raw)
            if fire is not None and t_start <= fire < t_end:
                out.append((at - fire) * 1000)
        return out

    pub, exe = window(ARRIVALS), window(EXECS)
    return {"pub": pub, "exe": exe}


def _busy_core() -> subprocess.Popen[bytes]:
    """The fixed background load: one Python process spinning ``while True: pass`` (one core
    busy; nice 0, like the beats)."""
    return subprocess.Popen([PY, "-c", "while True: pass"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _stats(values: list[float]) -> dict[str, float]:
    return {"n": float(len(values)), "median": median(values), "p99": pct(values, 99),
            "max": max(values, default=float("nan"))}


def run(env: Env) -> str:
    import multiprocessing as mp

    import redis

    size = env.size
    r = redis.Redis.from_url(env.redis_url)
    env.flush_redis()
    #: name -> one dict per run: {"pub": stats, "exe": stats}
    results: dict[str, list[dict[str, dict[str, float]]]] = {}
    notes = []
    # (label, scheduler, beats, extra env, background load)
    configs: list[tuple[str, str, int, dict[str, str], bool]] = []
    ours = "reliable_beat.celery:ReliableScheduler"
    template = _probe_template(env.redis_url).decode()
    for beats in size.lateness_beats:
        configs.append((f"floor: raw pipeline at the slot x {beats}", FLOOR, beats,
                        {"LAT_TEMPLATE": template}, False))
        configs.append((f"reliable_beat x {beats}", ours, beats, {}, False))
    configs.append(("stock beat x 1 (1 s grid)", "benchmarks.lateness:StockProbe", 1,
                    {"LAT_GRID": "1"}, False))
    if size.name != "smoke":  # smoke: StockProbe once (the row above) proves the code
        configs.append(("stock beat x 1 (timedelta, own due)", "benchmarks.lateness:StockProbe",
                        1, {}, False))
    try:
        import redbeat  # noqa: F401

        configs.append(("RedBeat x 1 (timedelta, own due)", "benchmarks.lateness:RedBeatProbe",
                        1, {}, False))
    except ImportError:
        notes.append("RedBeat not installed: not measured")
    if size.lateness_background:
        configs.append(("reliable_beat x 3, one busy core", ours, 3, {}, True))
        configs.append(("stock beat x 1 (1 s grid), one busy core",
                        "benchmarks.lateness:StockProbe", 1, {"LAT_GRID": "1"}, True))
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
        # Runs interleaved (every scheduler once, then again), so a noisy minute of the
        # machine spreads over all of them instead of landing on one.
        for rep in range(size.repeats):
            for name, sched, beats, extra, busy in configs:
                tag = f"{name.split()[0]}{beats}{'b' if busy else ''}{rep}"
                load = _busy_core() if busy else None
                try:
                    if sched.startswith("reliable_beat"):
                        with env.database("lateness") as db_url:
                            got = _measure(env, r, tag, sched, beats,
                                           {"LAT_DB": db_url, **extra}, tmp)
                    else:
                        got = _measure(env, r, tag, sched, beats, extra, tmp)
                finally:
                    if load is not None:
                        load.kill()
                        load.wait()
                results.setdefault(name, []).append(
                    {"pub": _stats(got["pub"]), "exe": _stats(got["exe"])})
    r.close()

    def fig(name: str, kind: str, stat: str) -> list[float]:
        return [run_[kind][stat] for run_ in results.get(name, [])]

    rows = []
    for name in results:
        rows.append([name, spread(fig(name, "pub", "n"), digits=0),
                     *(spread(fig(name, kind, stat)) for kind in ("pub", "exe")
                       for stat in ("median", "p99", "max"))])
    m3s, p3s = fig("reliable_beat x 3", "pub", "median"), fig("reliable_beat x 3", "pub", "p99")
    m3, p3 = median(m3s), median(p3s)
    rb = median(fig("RedBeat x 1 (timedelta, own due)", "pub", "p99"))
    stock = median(fig("stock beat x 1 (1 s grid)", "pub", "median"))
    floor_m3s = fig("floor: raw pipeline at the slot x 3", "pub", "median")
    floor_p3s = fig("floor: raw pipeline at the slot x 3", "pub", "p99")
    targets = [
        ["3 beats: median publish lateness", f"{spread(m3s)} ms", "≤ 2 ms",
         check(m3 <= TARGET_MEDIAN_MS)],
        ["3 beats: p99 publish lateness", f"{spread(p3s)} ms", "≤ 10 ms",
         check(p3 <= TARGET_P99_MS)],
        ["3 beats above the floor (3 raw pipelines at the slot), median / p99",
         f"{num(m3 - median(floor_m3s))} / {num(p3 - median(floor_p3s))} ms "
         f"(floor {spread(floor_m3s)} / {spread(floor_p3s)} ms)", "what the scheduler adds",
         "n/a" if not floor_m3s else "-"],
        ["3 beats p99 vs RedBeat p99", f"{num(p3)} vs {num(rb)} ms", "better",
         check(p3 < rb) if rb == rb else "n/a"],
        ["3 beats median vs stock median (same 1 s grid)", f"{num(m3)} vs {num(stock)} ms",
         "within a few ms", check(m3 - stock <= 3.0) if stock == stock else "n/a"],
    ]
    runs_note = (f"{size.repeats} runs per scheduler, interleaved; each cell is the median of "
                 "the runs' figures and their range" if size.repeats > 1 else "one run")
    out = [
        f"### 3. Fire lateness ({size.lateness_entries} entries every 1 s, "
        f"{size.lateness_seconds:.0f} s measured per scheduler and run, real `celery beat` "
        f"processes; {runs_note})",
        "",
        "Lateness is measured from each message's slot: for ours and for stock beat on the "
        "`1 s grid` rows, the whole second the entry was due (every entry due at once); on "
        "the `timedelta, own due` rows, the instant the scheduler itself computed "
        "(`last_run_at + 1 s`), which drifts with its own lateness and spreads the entries "
        "apart. `exec start` is when the probe task's body began in one `--pool solo` "
        f"worker (the same worker for every row): a slot's {size.lateness_entries} tasks run "
        "one after another, so a burst's last task starts that many task times after the "
        "slot. `one busy core`: the same beside a `python -c 'while True: pass'` process. "
        "`floor` rows: no scheduler and no database, k processes that build real `lat.probe` "
        "messages before each second and push them in one Redis pipeline at it (spinning the "
        "last millisecond): the lateness this machine and this recorder give a publisher "
        "that does nothing else, i.e. the part of every row that is not the scheduler's.",
        "",
        table(["scheduler", "messages", "publish median ms", "publish p99 ms", "publish max ms",
               "exec start median ms", "exec start p99 ms", "exec start max ms"], rows),
        "",
        table(["ratio", "measured", "target", ""], targets),
        *(["", *[f"- {n}" for n in notes]] if notes else []),
    ]
    return "\n".join(out)
