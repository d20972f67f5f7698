"""``reliable-beat dramatiq beat|relay --broker mod:broker``: the Dramatiq beat (the core
:class:`~reliable_beat.loop.BeatLoop`, any number at once) and a relay that delivers
Dramatiq triggers and ``dramatiq`` outbox rows and re-dispatches stuck runs; ``dramatiq
entries trigger|backfill`` (trigger rows of destination ``dramatiq``, published through the
broker) and ``dramatiq dead-letters requeue`` (a new message through the broker).

The Dramatiq adapter's commands: :data:`group` is mounted as ``reliable-beat dramatiq`` through
the entry point ``dramatiq = "reliable_beat.dramatiq.cli:group"`` of group
``reliable_beat.cli`` (:data:`reliable_beat.adapters.CLI_ENTRY_POINT_GROUP`), imported only
when ``reliable-beat dramatiq ...`` (or ``--help``) runs. Without Dramatiq installed the
import fails and the root group says so, naming the ``reliable-beat[dramatiq]`` extra.
"""

from __future__ import annotations

import getpass
import logging
import signal
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click
from sqlalchemy import select

from reliable_beat import runs, runtime
from reliable_beat.adapters import import_from_cwd
from reliable_beat.cli import CliContext, fail, pass_cli
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.dramatiq.base import TRIGGER_DESTINATION
from reliable_beat.dramatiq.periodic import beat_loop
from reliable_beat.dramatiq.publisher import DramatiqHandler, DramatiqPublisher
from reliable_beat.dramatiq.worker import _middleware
from reliable_beat.errors import ConfigurationError, EntryNotFoundError
from reliable_beat.handlers import load_handlers
from reliable_beat.loop import publish_and_mark
from reliable_beat.ops import requeue as ops_requeue
from reliable_beat.ops.actions import RequeueSendError
from reliable_beat.outbox import OutboxMessage, db_now
from reliable_beat.redispatch import redispatch_with
from reliable_beat.relay import Relay
from reliable_beat.triggers import trigger_message_id

__all__ = ["group", "relay_redispatch"]


def _load_broker(spec: str) -> tuple[Any, Any]:
    """``module:attr`` (attr default ``broker``) -> (the ReliableBeat middleware, broker).

    The current directory is importable first (as for ``dramatiq proj.actors`` and
    ``celery -A proj``), so ``--broker proj.broker`` finds ``./proj`` without PYTHONPATH.
    Exits with code 2 and one line naming ``spec`` and the fix when Dramatiq is not
    installed, the module or attribute does not exist, or the broker has no ReliableBeat.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = import_from_cwd(module_name)
    except ImportError as exc:
        fail(f"--broker {spec}: cannot import {module_name!r} ({exc}); run from the directory "
             f"that holds it, or put that directory on PYTHONPATH", 2, kind="usage")
    broker = getattr(module, attr or "broker", None)
    if broker is None:
        fail(f"--broker {spec}: {module_name!r} has no attribute {attr or 'broker'!r}", 2,
             kind="usage")
    try:
        return _middleware(broker), broker
    except ConfigurationError as exc:
        fail(f"--broker {spec}: {exc}", 2, kind="invalid")


def _stop_event(on_stop: Any = None) -> threading.Event:
    """An Event set by SIGTERM / SIGINT; ``on_stop()`` is called instead when given (the
    beat's :meth:`~reliable_beat.loop.BeatLoop.request_stop`, which sets it and ends a LISTEN
    wait at once)."""
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        if on_stop is not None:
            on_stop()
        else:
            stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return stop


@click.group("dramatiq")
def dramatiq_group() -> None:
    """The Dramatiq adapter's processes (needs `pip install reliable-beat[dramatiq]`)."""


@dramatiq_group.command("beat")
@click.option("--broker", "broker_spec", required=True, help="module:broker (ReliableBeat on it).")
@click.option("--loglevel", default="INFO", show_default=True)
@pass_cli
def beat(cli: CliContext, broker_spec: str, loglevel: str) -> None:
    """Fire the broker's periodic entries until SIGTERM / SIGINT."""
    logging.basicConfig(level=loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rb, broker = _load_broker(broker_spec)
    if not rb.schedule and not any(a.options.get("periodic") is not None
                                   for a in list(broker.actors.values())):
        module = broker_spec.partition(":")[0]
        click.echo(f"warning: dramatiq beat: {broker_spec} declares no periodic actor "
                   f"({len(broker.actors)} actors) and no ReliableBeat(schedule=...): this beat "
                   f"fires nothing new. Does {module} import the modules that declare the "
                   "actors (e.g. `import proj.actors` at its end)? See the Dramatiq quick start",
                   err=True)
    loop = beat_loop(broker)  # the core loop: waits for the database, syncs, then fires
    click.echo(f"dramatiq beat {loop.owner} on {loop.store.safe_url}", err=True)
    loop.stop_event = threading.Event()
    _stop_event(loop.request_stop)  # sets loop.stop_event, ends a LISTEN wait at once
    if loop.start():
        loop.run_forever(loop.stop_event)


@dramatiq_group.command("relay")
@click.option("--broker", "broker_spec", required=True, help="module:broker (ReliableBeat on it).")
@click.option("--loglevel", default="INFO", show_default=True)
@pass_cli
def relay(cli: CliContext, broker_spec: str, loglevel: str) -> None:
    """Deliver outbox rows (Dramatiq triggers, ``dramatiq`` destination, webhook, SMTP ...)
    and re-dispatch stuck runs of idempotent actors, until SIGTERM / SIGINT."""
    logging.basicConfig(level=loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rb, broker = _load_broker(broker_spec)
    settings = rb.settings
    store = Store.from_url(settings.database_url, role="relay")
    handler = DramatiqHandler(broker)
    redispatch = relay_redispatch(store, settings, broker)
    handlers = load_handlers(None, settings.outbox_handlers, settings=settings,
                             extra={TRIGGER_DESTINATION: handler})
    worker = Relay(store, None, handlers, settings=settings, redispatch=redispatch)
    click.echo(f"dramatiq relay {worker.owner} on {store.safe_url}; destinations: "
               + ", ".join(sorted(worker.handlers)), err=True)
    worker.run_forever(_stop_event())


def relay_redispatch(store: Any, settings: Any, broker: Any) -> Callable[[], int]:
    """The re-dispatch sweep of ``reliable-beat dramatiq relay``: re-send the triggers of
    stuck runs of the broker's idempotent actors
    (:func:`~reliable_beat.redispatch.redispatch_with`) through its
    :class:`~reliable_beat.dramatiq.DramatiqPublisher`, with the publisher's backlog check
    (:func:`reliable_beat.dramatiq.backlog.queue_depths`: a queue deep enough is a backlog,
    not a loss, and is not re-sent to)."""
    publisher = DramatiqPublisher(broker)

    def redispatch() -> int:
        return redispatch_with(store, settings, list(publisher.tracked_tasks()),
                               lambda ms, now: publisher.publish(ms, now),
                               queue_depths=publisher.queue_depths,
                               destination=publisher.destination)

    return redispatch


def _instant(value: str, what: str) -> Any:
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        fail(f"{what}={value!r}: not an ISO 8601 instant (e.g. 2026-12-01T02:00:00+01:00)",
             2, kind="usage")
    if at.tzinfo is None:
        fail(f"{what}={value!r} is naive: give a UTC offset (e.g. ...Z or +02:00)", 2,
             kind="usage")
    return at


@dramatiq_group.group("entries")
def entries_group() -> None:
    """Fire a Dramatiq actor's entry by hand or backfill it, through the broker."""


@entries_group.command("trigger")
@click.argument("name")
@click.option("--broker", "broker_spec", required=True, help="module:broker (ReliableBeat on it).")
@pass_cli
def entries_trigger(cli: CliContext, name: str, broker_spec: str) -> None:
    """Fire entry NAME once, now (a ``manual`` run, its own key), published through the
    Dramatiq broker at once; if the broker is down the trigger stays in the outbox
    (destination ``dramatiq``) for a Dramatiq beat's sweep or relay."""
    rb, broker = _load_broker(broker_spec)
    store = Store.from_url(rb.settings.database_url, role="cli")
    try:
        key = runtime.trigger(store, name, destination=TRIGGER_DESTINATION)
    except EntryNotFoundError as exc:
        fail(str(exc), 1, kind="not_found")
    except ConfigurationError as exc:
        fail(str(exc), 2, kind="invalid")
    sent = _publish_pending(store, DramatiqPublisher(broker), [key])
    how = ("published through the Dramatiq broker" if sent else
           "queued in the outbox (broker unreachable: a Dramatiq beat or relay sends it)")
    click.echo(f"triggered {name}: key {key}, {how}")


@entries_group.command("backfill")
@click.argument("name")
@click.argument("start")
@click.argument("end")
@click.option("--broker", "broker_spec", required=True, help="module:broker (ReliableBeat on it).")
@click.option("--force", is_flag=True, help="Allow more slots than reliable_beat_backfill_limit.")
@pass_cli
def entries_backfill(cli: CliContext, name: str, start: str, end: str, broker_spec: str,
                     force: bool) -> None:
    """Create runs for every slot of NAME in [START, END) that has none (ISO 8601 instants
    with offsets) and publish their triggers through the Dramatiq broker."""
    s, e = _instant(start, "START"), _instant(end, "END")
    rb, broker = _load_broker(broker_spec)
    store = Store.from_url(rb.settings.database_url, role="cli")
    try:
        result = runtime.backfill(store, name, s, e, limit=rb.settings.backfill_limit,
                                  force=force, destination=TRIGGER_DESTINATION)
    except EntryNotFoundError as exc:
        fail(str(exc), 1, kind="not_found")
    except (ConfigurationError, runtime.BackfillLimitError) as exc:
        fail(str(exc), 2, kind="invalid")
    sent = _publish_pending(store, DramatiqPublisher(broker), result.keys)
    click.echo(
        f"backfill {name}: {result.slots} slots in window, {result.created} runs created, "
        f"{result.existing} already had a run, {sent} published through the Dramatiq broker"
        + (f", {result.buffered} buffered (released one at a time)" if result.buffered else "")
        + (f", {result.future} future slots left to the beat" if result.future else ""))


def _publish_pending(store: Any, publisher: Any, keys: list[str]) -> int:
    """Publish the pending ``dramatiq`` trigger rows of ``keys`` now and mark them (the
    beat's fast path); rows the broker refused stay pending for a sweep or a relay."""
    if not keys:
        return 0
    with store.begin() as conn:
        now = db_now(conn)
        rows = conn.execute(select(outbox).where(
            outbox.c.message_id.in_([trigger_message_id(k) for k in keys]),
            outbox.c.state == "pending", outbox.c.destination == publisher.destination,
        )).mappings().all()
    messages = [OutboxMessage(id=r["id"], message_id=r["message_id"],
                              destination=r["destination"], payload=r["payload"],
                              run_id=r["run_id"]) for r in rows]
    return publish_and_mark(store, publisher, messages, now)


@dramatiq_group.group("dead-letters")
def dead_letters_group() -> None:
    """Dead letters of Dramatiq actors."""


@dead_letters_group.command("requeue")
@click.argument("dead_letter_id", type=int)
@click.option("--broker", "broker_spec", required=True, help="module:broker (ReliableBeat on it).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Requeue even if it was requeued before.")
@click.option("--by", default=None, help="Who decided (default: the current user).")
@click.option("--queue", default=None, help="Send to this queue (default: the one it died on).")
@pass_cli
def dl_requeue(cli: CliContext, dead_letter_id: int, broker_spec: str, yes: bool, force: bool,
               by: str | None, queue: str | None) -> None:
    """Run a dead Dramatiq run again under the SAME idempotency key, through the broker (or
    deliver a dead outbox row again)."""
    rb, broker = _load_broker(broker_spec)
    store = Store.from_url(rb.settings.database_url, role="cli")
    try:
        plan = ops_requeue.plan_requeue(store, dead_letter_id)
    except runs.DeadLetterNotFound as exc:
        fail(str(exc), 1, kind="not_found")
    except ops_requeue.RequeueRefused as exc:
        fail(str(exc), 1, kind="invalid")
    problem = ops_requeue.app_problem(plan, broker)
    if problem is not None:
        fail(problem, 1, kind="invalid")
    if not yes:
        click.confirm(plan.question, abort=True)
    try:
        done = ops_requeue.requeue(store, plan, app=broker, by=by or getpass.getuser(),
                                   force=force, queue=queue)
    except (ValueError, LookupError) as exc:
        fail(str(exc), 1, kind="invalid")
    except RequeueSendError as exc:
        fail(str(exc), 1, kind="store_unavailable")
    click.echo(done)


#: The ``reliable-beat dramatiq`` group (the entry point's target).
group = dramatiq_group
