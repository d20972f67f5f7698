"""Prometheus metrics read from the store on each scrape (optional ``metrics`` extra).

Install with ``pip install reliable-beat[metrics]`` (``prometheus_client``). The collector
holds no state of its own: every scrape runs a few cheap queries, so any number of
processes may serve it and they all report the same numbers. Metrics (all gauges, because
they are read from the database, not counted in one process):

=================================================  ===========================================
``reliable_beat_up``                               1 when the store answered the scrape, else 0
``reliable_beat_entries{status}``                  entries by active / paused / disabled / ended
                                                   / quarantined (malformed row, disabled)
``reliable_beat_quarantined_rows{table}``          malformed rows isolated: entries quarantined,
                                                   outbox rows / runs dead-lettered as malformed
``reliable_beat_entries_late``                     enabled entries overdue by more than their
                                                   misfire_grace + margin: **no beat running**
``reliable_beat_runs{state}``                      runs by state
``reliable_beat_dead_letters{kind}``               dead letters not requeued (run / outbox /
                                                   message), except those handled by design
``reliable_beat_dead_letters_handled``             dead letters of failures handled by design
                                                   (a saga's step whose compensations
                                                   completed): no alarm
``reliable_beat_runs_retry_overdue``               runs in ``retrying`` that re-sending did not
                                                   move on (status: RETRY OVERDUE)
``reliable_beat_outbox_pending{destination}``      outbox rows waiting for the relay now: due
                                                   (``available_at`` passed) or failed and
                                                   waiting for their retry; delayed rows not
                                                   yet due and rows a beat or relay holds (a
                                                   trigger being published, a claim) do not
``reliable_beat_outbox_scheduled{destination}``    delayed rows not yet due, never attempted
                                                   and unclaimed (a workflow timer's wake):
                                                   not backlog
``reliable_beat_outbox_oldest_pending_age_seconds``  age of the oldest due row, per
                                                   destination, from its available_at (a
                                                   failed row: its created_at); delayed
                                                   rows not yet due do not count
``reliable_beat_outbox_dead{destination}``         outbox rows given up on
``reliable_beat_attempts_recent{outcome}``         attempts started in the window by outcome:
                                                   deduplicated (duplicates collapsed),
                                                   fenced_out (fence rejections), retrying
``reliable_beat_fire_lateness_seconds``            gauge histogram of ``dispatched_at - fire_at``
                                                   over scheduled runs dispatched in the last
                                                   ``window_seconds`` (default 1 h)
``reliable_beat_slots_recent{outcome}``            scheduled slots written in the window:
                                                   fired / skipped (misfire or overlap policy)
``reliable_beat_claim_batch_slots``                gauge histogram of slots written per claim
                                                   transaction in the window (the runs of one
                                                   tick share its ``created_at``)
``reliable_beat_run_duration_seconds``             gauge histogram of ``finished_at -
                                                   started_at`` of runs finished in the window
``reliable_beat_workflows{state}``                 workflows by state
``reliable_beat_workflows_advances_expiring``      ``running`` workflows whose advance's lease
                                                   expired twice in a row without finishing
                                                   (stuck code, or a worker that dies)
``reliable_beat_workflows_pending_late``           workflows ``pending`` longer than
                                                   ``pending_alarm_seconds``: no worker
                                                   took their wake
=================================================  ===========================================

Alert on ``reliable_beat_entries_late > 0`` (the "missed slot" alarm),
``reliable_beat_dead_letters > 0``, ``reliable_beat_runs_retry_overdue > 0``, a growing
``reliable_beat_outbox_oldest_pending_age_seconds``, ``reliable_beat_workflows{state="blocked"}
> 0``, ``reliable_beat_workflows_advances_expiring > 0`` and
``reliable_beat_workflows_pending_late > 0``.

Serve them with :func:`serve`, ``reliable-beat metrics serve --port 9808``, or write a
node-exporter textfile with ``reliable-beat metrics textfile PATH``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from sqlalchemy import func, select, type_coerce
from sqlalchemy.types import NullType

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import attempts, dead_letters, entries, runs, workflows
from reliable_beat.policies import is_missed
from reliable_beat.redaction import get_logger
from reliable_beat.relay import outbox_status
from reliable_beat.retry_watch import overdue_retries
from reliable_beat.rows import decode_value, infinity_text, quarantine_counts
from reliable_beat.settings import Settings
from reliable_beat.workflows import runaway

__all__ = [
    "DEFAULT_METRICS_HOST",
    "LATENESS_BUCKETS",
    "MetricsServer",
    "StoreCollector",
    "make_registry",
    "serve",
    "write_textfile",
]

log = get_logger("reliable_beat.metrics")

#: Upper bounds (seconds) of the fire lateness histogram buckets.
LATENESS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Most recent runs one scrape reads for the lateness histogram.
LATENESS_SAMPLE = 10_000
#: Upper bounds (slots) of the claim batch histogram buckets.
BATCH_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 5000)
#: Upper bounds (seconds) of the run duration histogram buckets.
DURATION_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: Runs written by the scheduler (as opposed to manual triggers and backfills).
SCHEDULED_TRIGGERS = ("schedule", "catch_up")


def _gauge_histogram(name: str, doc: str, values: list[float],
                     bounds: tuple[float, ...]) -> Any:
    from prometheus_client.core import GaugeHistogramMetricFamily

    buckets = [(str(float(b)), float(sum(1 for v in values if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(len(values))))
    return GaugeHistogramMetricFamily(name, doc, buckets=buckets, gsum_value=float(sum(values)))


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "reliable_beat metrics need prometheus_client: pip install 'reliable-beat[metrics]'"
        ) from exc
    return prometheus_client


class StoreCollector:
    """A Prometheus collector that reads the store on every scrape.

    Args:
        store: the store.
        margin_seconds: slack beyond an entry's ``misfire_grace`` before it counts as late.
        window_seconds: how far back the lateness histogram looks (dispatch time).
        redispatch_seconds / retry_cap_seconds: the settings the re-dispatch sweep runs
            with (``reliable_beat_runs_retry_overdue``; default the settings' defaults).
        pending_alarm_seconds: a workflow ``pending`` longer counts in
            ``reliable_beat_workflows_pending_late``
            (``reliable_beat_workflow_pending_alarm_seconds``).

    A scrape never raises: if the database is down it reports ``reliable_beat_up 0``.
    """

    def __init__(
        self, store: Store, *, margin_seconds: float = 60.0, window_seconds: float = 3600.0,
        redispatch_seconds: float = Settings.redispatch_seconds,
        retry_cap_seconds: float = Settings.retry_cap_seconds,
        pending_alarm_seconds: float = runaway.DEFAULT_PENDING_ALARM_SECONDS,
    ) -> None:
        self.store = store
        self.margin_seconds = margin_seconds
        self.window_seconds = window_seconds
        self.redispatch_seconds = redispatch_seconds
        self.retry_cap_seconds = retry_cap_seconds
        self.pending_alarm_seconds = pending_alarm_seconds

    def describe(self) -> list[Any]:
        """Nothing up front: the registry then does not scrape at registration time."""
        return []

    def collect(self) -> Iterator[Any]:
        """Yield the metric families (called by ``prometheus_client`` on each scrape)."""
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("reliable_beat_up", "1 when the reliable_beat store answered")
        try:
            data = self._read()
        except Exception as exc:
            log.warning("metrics scrape failed: %s", self.store.describe_failure(exc))
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up

        fam = GaugeMetricFamily("reliable_beat_entries", "Entries by status", labels=["status"])
        for status in ("active", "paused", "disabled", "ended", "quarantined"):
            fam.add_metric([status], float(data["entries"].get(status, 0)))
        yield fam
        yield GaugeMetricFamily(
            "reliable_beat_entries_late",
            "Enabled entries overdue by more than misfire_grace + margin (no beat claiming)",
            value=float(data["late"]),
        )
        fam = GaugeMetricFamily(
            "reliable_beat_quarantined_rows",
            "Malformed rows isolated: entries quarantined (disabled with a reason), outbox "
            "rows and runs dead-lettered as malformed (not requeued)", labels=["table"],
        )
        for table, n in sorted(data["quarantined"].items()):
            fam.add_metric([table], float(n))
        yield fam
        fam = GaugeMetricFamily("reliable_beat_runs", "Runs by state", labels=["state"])
        for state, n in sorted(data["runs"].items()):
            fam.add_metric([state], float(n))
        yield fam
        yield GaugeMetricFamily(
            "reliable_beat_runs_retry_overdue",
            "Runs waiting in retrying that the re-dispatch sweep's re-sends did not move on "
            "(status: RETRY OVERDUE)", value=float(data["retry_overdue"]),
        )
        fam = GaugeMetricFamily(
            "reliable_beat_dead_letters", "Dead letters not requeued", labels=["kind"]
        )
        for kind in ("run", "outbox"):
            fam.add_metric([kind], float(data["dead"].get(kind, 0)))
        yield fam
        yield GaugeMetricFamily(
            "reliable_beat_dead_letters_handled",
            "Dead letters of failures the application handled by design (a saga's step "
            "whose compensations completed), not requeued; not an alarm",
            value=float(data["handled"]))
        pending = GaugeMetricFamily(
            "reliable_beat_outbox_pending",
            "Outbox rows waiting for a relay: due (available_at passed) or failed and waiting "
            "for their retry; delayed rows not yet due are not counted",
            labels=["destination"],
        )
        scheduled = GaugeMetricFamily(
            "reliable_beat_outbox_scheduled",
            "Delayed outbox rows not yet due (never attempted, unclaimed): not backlog",
            labels=["destination"],
        )
        oldest = GaugeMetricFamily(
            "reliable_beat_outbox_oldest_pending_age_seconds",
            "Age of the oldest due (or failed) pending outbox row, from when it came due "
            "(a failed row: from its creation; store clock); delayed rows not yet due "
            "are not counted", labels=["destination"],
        )
        dead = GaugeMetricFamily(
            "reliable_beat_outbox_dead", "Outbox rows given up on", labels=["destination"]
        )
        for o in data["outbox"]:
            pending.add_metric([o["destination"]], float(o["backlog"]))
            scheduled.add_metric([o["destination"]], float(o["scheduled"]))
            oldest.add_metric([o["destination"]], float(o["oldest_pending_age_seconds"] or 0.0))
            dead.add_metric([o["destination"]], float(o["dead"]))
        yield pending
        yield scheduled
        yield oldest
        yield dead
        fam = GaugeMetricFamily(
            "reliable_beat_attempts_recent",
            "Attempts started in the recent window by outcome: deduplicated = duplicates "
            "collapsed, fenced_out = fence rejections, retrying = retries",
            labels=["outcome"],
        )
        for outcome in ("succeeded", "deduplicated", "fenced_out", "retrying", "failed",
                        "dead", "busy", "running"):
            fam.add_metric([outcome], float(data["attempts"].get(outcome, 0)))
        yield fam
        yield _gauge_histogram(
            "reliable_beat_fire_lateness_seconds",
            "dispatched_at - fire_at of scheduled runs dispatched in the recent window",
            data["lateness"], LATENESS_BUCKETS,
        )
        fam = GaugeMetricFamily(
            "reliable_beat_slots_recent",
            "Scheduled slots written in the recent window: fired, or skipped by a policy",
            labels=["outcome"],
        )
        for outcome in ("fired", "skipped"):
            fam.add_metric([outcome], float(data["slots"].get(outcome, 0)))
        yield fam
        yield _gauge_histogram(
            "reliable_beat_claim_batch_slots",
            "Slots written per claim transaction in the recent window",
            data["batches"], BATCH_BUCKETS,
        )
        yield _gauge_histogram(
            "reliable_beat_run_duration_seconds",
            "finished_at - started_at of runs finished in the recent window",
            data["durations"], DURATION_BUCKETS,
        )
        fam = GaugeMetricFamily("reliable_beat_workflows", "Workflows by state",
                                labels=["state"])
        for state, n in sorted(data["workflows"].items()):
            fam.add_metric([state], float(n))
        yield fam
        yield GaugeMetricFamily(
            "reliable_beat_workflows_advances_expiring",
            "Running workflows whose advance's lease expired twice in a row without the "
            "advance finishing (stuck code, or a worker that dies each time)",
            value=float(data["wf_expiring"]),
        )
        yield GaugeMetricFamily(
            "reliable_beat_workflows_pending_late",
            "Workflows pending longer than reliable_beat_workflow_pending_alarm_seconds (no "
            "worker took their wake)", value=float(data["wf_pending_late"]),
        )

    def _read(self) -> dict[str, Any]:
        with self.store.engine.connect() as conn:
            now = self.store.now(conn)
            counts: dict[str, int] = {}
            quarantined = entries.c.quarantine_reason.is_not(None)
            # flags read untyped: a malformed row (SQLite: any value) never fails the scrape
            flags = (type_coerce(entries.c.enabled, NullType()),
                     type_coerce(entries.c.paused, NullType()))
            for enabled, paused, has_next, bad, n in conn.execute(
                select(*flags, entries.c.next_fire_at.is_not(None), quarantined, func.count())
                .group_by(*flags, entries.c.next_fire_at.is_not(None), quarantined)
            ):
                status = ("quarantined" if bad else "disabled" if enabled not in (True, 1)
                          else "paused" if paused not in (False, 0) else "active" if has_next
                          else "ended")
                counts[status] = counts.get(status, 0) + int(n)
            margin = timedelta(seconds=self.margin_seconds)
            late = sum(
                1
                for nfa, grace in conn.execute(
                    select(type_coerce(entries.c.next_fire_at, NullType()),
                           type_coerce(entries.c.misfire_grace_seconds, NullType())).where(
                        entries.c.enabled.is_(True), entries.c.paused.is_(False),
                        entries.c.next_fire_at < now - margin,
                    )
                )
                if _late(nfa, grace, now, margin, conn.dialect)
            )
            by_state = {
                str(s): int(n)
                for s, n in conn.execute(
                    select(runs.c.state, func.count()).group_by(runs.c.state)
                )
            }
            dead = {
                str(k): int(n)
                for k, n in conn.execute(
                    select(dead_letters.c.kind, func.count())
                    .where(dead_letters.c.requeued_at.is_(None),
                           dead_letters.c.handled_at.is_(None))
                    .group_by(dead_letters.c.kind)
                )
            }
            handled = int(conn.execute(
                select(func.count()).select_from(dead_letters)
                .where(dead_letters.c.requeued_at.is_(None),
                       dead_letters.c.handled_at.is_not(None))
            ).scalar_one())
            backlog = outbox_status(conn)
            quarantined_rows = quarantine_counts(conn)
            since = now - timedelta(seconds=self.window_seconds)
            lateness = [
                max(0.0, (d - f).total_seconds())
                for f, d in _instant_pairs(conn, runs.c.fire_at, runs.c.dispatched_at, lambda q: q
                    .where(runs.c.dispatched_at >= since, runs.c.fire_at.is_not(None),
                           runs.c.trigger.in_(("schedule", "catch_up")))
                    .order_by(runs.c.id.desc())
                    .limit(LATENESS_SAMPLE))
            ]
            outcomes = {
                str(o): int(n)
                for o, n in conn.execute(
                    select(attempts.c.outcome, func.count())
                    .where(attempts.c.started_at >= since)
                    .group_by(attempts.c.outcome)
                )
            }
            slots: dict[str, int] = {}
            per_claim: dict[Any, int] = {}
            for created, state, n in conn.execute(
                select(type_coerce(runs.c.created_at, NullType()), runs.c.state, func.count())
                .where(runs.c.created_at >= since, runs.c.trigger.in_(SCHEDULED_TRIGGERS))
                .group_by(runs.c.created_at, runs.c.state)
            ):  # created_at untyped: only grouped on, never read (a malformed row is harmless)
                key = "skipped" if state == "skipped" else "fired"
                slots[key] = slots.get(key, 0) + int(n)
                per_claim[created] = per_claim.get(created, 0) + int(n)
            batches = [float(n) for n in per_claim.values()]
            wf_states = {str(s): int(n) for s, n in conn.execute(
                select(workflows.c.state, func.count()).group_by(workflows.c.state))}
            wf_expiring = runaway.expiring_advances(conn, now, limit=0)[0]
            wf_pending_late = runaway.late_pending(
                conn, now, after=timedelta(seconds=self.pending_alarm_seconds), limit=0)[0]
            durations = [
                max(0.0, (f - s).total_seconds())
                for s, f in _instant_pairs(conn, runs.c.started_at, runs.c.finished_at, lambda q: q
                    .where(runs.c.finished_at >= since, runs.c.started_at.is_not(None))
                    .order_by(runs.c.id.desc())
                    .limit(LATENESS_SAMPLE))
            ]
            retry_overdue, _ = overdue_retries(
                conn, now, redispatch_seconds=self.redispatch_seconds,
                retry_cap_seconds=self.retry_cap_seconds, limit=0)
        return {"entries": counts, "late": late, "runs": by_state, "dead": dead,
                "handled": handled,
                "retry_overdue": retry_overdue,
                "outbox": backlog, "lateness": lateness, "attempts": outcomes, "slots": slots,
                "batches": batches, "durations": durations, "quarantined": quarantined_rows,
                "workflows": wf_states, "wf_expiring": wf_expiring,
                "wf_pending_late": wf_pending_late}


def _instant_pairs(conn: Any, first: Any, second: Any, where: Any) -> list[tuple[Any, Any]]:
    """``(first, second)`` instants of the rows ``where(select(...))`` finds, read value by
    value: a row whose values are not instants (malformed, see :mod:`reliable_beat.rows`)
    is left out instead of failing the scrape."""
    out: list[tuple[Any, Any]] = []
    stmt = where(select(type_coerce(first, NullType()), type_coerce(second, NullType())))
    for a, b in conn.execute(stmt):
        try:
            pair = (decode_value(first, a, conn.dialect), decode_value(second, b, conn.dialect))
        except Exception:
            continue
        if all(isinstance(v, datetime) and infinity_text(v) is None for v in pair):
            out.append(pair)  # not a PostgreSQL 'infinity' (a malformed row) either
    return out


def _late(raw_next: Any, raw_grace: Any, now: Any, margin: timedelta, dialect: Any) -> bool:
    """Whether an entry is overdue by more than its grace + margin (the MISSED check of
    ``status``: :func:`reliable_beat.policies.is_missed`); a value that cannot be read (a
    malformed row, see :mod:`reliable_beat.rows`) counts as not late."""
    try:
        nfa = decode_value(entries.c.next_fire_at, raw_next, dialect)
    except Exception:
        return False
    return is_missed(nfa, raw_grace, now, margin.total_seconds())


def make_registry(store: Store, **kwargs: Any) -> Any:
    """A fresh ``CollectorRegistry`` holding only a :class:`StoreCollector` for ``store``.

    Raises:
        ImportError: ``prometheus_client`` is not installed (the message names the extra).
    """
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, **kwargs))
    return registry


#: Default bind address of the metrics server: loopback only. Expose it deliberately
#: (``reliable_beat_metrics_host = "0.0.0.0"`` or ``--addr``) behind a firewall.
DEFAULT_METRICS_HOST = "127.0.0.1"
#: Seconds a metrics connection may stay silent (request line, headers, body) before it is
#: closed; each connection has its own thread, so a slow one never blocks a scrape.
REQUEST_TIMEOUT_SECONDS = 10.0


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_SECONDS  # socket timeout per connection (socketserver)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics: " + format, *args)


#: Most metrics connections served at once; a connection past it is answered
#: ``503 Service Unavailable`` at once and closed, so a flood of clients can neither grow
#: threads without bound nor queue scrapes against the store.
MAX_CONNECTIONS = 8


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One daemon thread per connection, at most :data:`MAX_CONNECTIONS` at once: an idle or
    slow client holds only its own, and one past the cap is refused without a thread."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\nRetry-After: 1\r\n\r\n")
            self.shutdown_request(request)
            log.warning("metrics: %d connections already open; refused %s (503)",
                        MAX_CONNECTIONS, client_address[0] if client_address else "?")
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


@dataclass
class MetricsServer:
    """A running metrics HTTP server (``GET /metrics``) in a daemon thread.

    Attributes:
        port: the bound TCP port (useful when started with port 0).
    """

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.server.server_port)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(
    port: int, store: Store, *, addr: str = DEFAULT_METRICS_HOST, **kwargs: Any
) -> MetricsServer:
    """Serve the store's metrics over HTTP at ``http://addr:port/metrics``, in a thread.

    Each connection is served in a daemon thread of its own with a socket timeout of
    :data:`REQUEST_TIMEOUT_SECONDS`, so an idle or slow client never blocks other scrapes; at
    most :data:`MAX_CONNECTIONS` at once (more are answered 503 and closed).
    The default address is loopback (:data:`DEFAULT_METRICS_HOST`): nothing is exposed
    unless the operator says so.

    Args:
        port: TCP port (0 picks a free one; read :attr:`MetricsServer.port`).
        store: the store to read on each scrape.
        addr: the address to bind.
        **kwargs: passed to :class:`StoreCollector` (``margin_seconds``, ``window_seconds``).

    Returns:
        The running server; call :meth:`MetricsServer.stop` to end it.

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        OSError: the port is taken.
    """
    prom = _prometheus()
    app = prom.make_wsgi_app(make_registry(store, **kwargs))
    server = make_server(addr, port, app, _ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="rb-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)


def write_textfile(path: str, store: Store, **kwargs: Any) -> None:
    """Write the metrics once to ``path`` (node-exporter textfile format, atomic rename).

    Raises:
        ImportError: ``prometheus_client`` is not installed.
    """
    prom = _prometheus()
    prom.write_to_textfile(path, make_registry(store, **kwargs))
