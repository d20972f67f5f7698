"""``reliable-beat dramatiq beat|relay --broker mod:broker``: the Dramatiq beat (the core
:class:`~reliable_beat.loop.BeatLoop`, any number at once) and a relay that delivers
Dramatiq triggers and ``dramatiq`` outbox rows and re-dispatches stuck runs.

Importing this module does not import Dramatiq (the command group is registered for every
``reliable-beat``); the commands import it when run.
"""

from __future__ import annotations

import importlib
import logging
import signal
import threading
from typing import Any

import click

from reliable_beat.cli import CliContext, fail, pass_cli
from reliable_beat.errors import ConfigurationError

__all__ = ["register"]


def _load_broker(spec: str) -> tuple[Any, Any]:
    """``module:attr`` (attr default ``broker``) -> (the ReliableBeat middleware, broker).

    Exits with code 2 and one line naming ``spec`` and the fix when Dramatiq is not
    installed, the module or attribute does not exist, or the broker has no ReliableBeat.
    """
    module_name, _, attr = spec.partition(":")
    try:
        import dramatiq  # noqa: F401
    except ImportError:
        fail('the Dramatiq adapter needs dramatiq: pip install "reliable-beat[dramatiq]"', 2,
             kind="usage")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        fail(f"--broker {spec}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?",
             2, kind="usage")
    broker = getattr(module, attr or "broker", None)
    if broker is None:
        fail(f"--broker {spec}: {module_name!r} has no attribute {attr or 'broker'!r}", 2,
             kind="usage")
    from reliable_beat.dramatiq import _middleware

    try:
        return _middleware(broker), broker
    except ConfigurationError as exc:
        fail(f"--broker {spec}: {exc}", 2, kind="invalid")


def _stop_event() -> threading.Event:
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
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
    from reliable_beat.dramatiq import beat_loop

    _rb, broker = _load_broker(broker_spec)
    loop = beat_loop(broker)  # the core loop: waits for the database, syncs, then fires
    click.echo(f"dramatiq beat {loop.owner} on {loop.store.safe_url}", err=True)
    loop.stop_event = _stop_event()
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
    from reliable_beat.db.dialects import Store
    from reliable_beat.dramatiq import TRIGGER_DESTINATION, DramatiqHandler, DramatiqPublisher
    from reliable_beat.handlers import load_handlers
    from reliable_beat.redispatch import redispatch_with
    from reliable_beat.relay import Relay

    rb, broker = _load_broker(broker_spec)
    settings = rb.settings
    store = Store.from_url(settings.database_url, role="relay")
    handler = DramatiqHandler(broker)
    publisher = DramatiqPublisher(broker)

    def redispatch() -> int:
        return redispatch_with(store, settings, list(publisher.tracked_tasks()),
                               lambda ms, now: publisher.publish(ms, now))

    handlers = load_handlers(None, settings.outbox_handlers, settings=settings,
                             extra={TRIGGER_DESTINATION: handler})
    worker = Relay(store, None, handlers, settings=settings, redispatch=redispatch)
    click.echo(f"dramatiq relay {worker.owner} on {store.safe_url}; destinations: "
               + ", ".join(sorted(worker.handlers)), err=True)
    worker.run_forever(_stop_event())


def register(group: click.Group) -> None:
    group.add_command(dramatiq_group)
