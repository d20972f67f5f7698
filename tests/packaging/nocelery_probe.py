"""Run inside a venv that has reliable_beat and its core dependencies but neither Celery nor
kombu (tests/packaging/test_nocelery.py builds it). Imports every core module, runs a core
beat tick and a relay cycle on SQLite with an in-memory handler, and checks ``sys.modules``.

Prints one JSON line: ``{"imported": [...], "skipped": [...], "tick": n, "delivered": [...],
"run_state": str, "framework_modules": [...]}``; exits non-zero on any failure.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

#: Not core: the adapters, and the Celery testing kit (``reliable_beat.testing`` re-exports
#: ``testing.kit``, which runs Celery tasks). ``reliable_beat.cli`` IS imported: the command
#: line works without Celery (``-A`` then names the missing extra).
NOT_CORE = ("reliable_beat.celery", "reliable_beat.dramatiq", "reliable_beat.contrib",
            "reliable_beat.testing",
            # the dashboard: its own extra (starlette, jinja2); `reliable-beat dashboard`
            # names the extra without it (tests/integration/test_dashboard.py)
            "reliable_beat.web")
FRAMEWORKS = ("celery", "kombu", "dramatiq", "django", "amqp")


def not_core(name: str) -> bool:
    """``name`` is one of :data:`NOT_CORE` or inside one (``reliable_beat.web`` but not
    ``reliable_beat.webhook_guard``)."""
    return any(name == p or name.startswith(p + ".") for p in NOT_CORE)


def main() -> int:
    for top in ("celery", "kombu"):  # the premise: they are not installed here
        if importlib.util.find_spec(top) is not None:
            print(f"{top} is installed in this venv: the probe proves nothing", file=sys.stderr)
            return 3

    import reliable_beat

    imported: list[str] = []
    skipped: list[str] = []

    def walk(package: object, prefix: str) -> None:
        # pkgutil.walk_packages would import the skipped packages to look inside them
        for info in pkgutil.iter_modules(package.__path__, prefix):  # type: ignore[attr-defined]
            name = info.name
            if not_core(name) or name.endswith((".__main__", ".migrations")):
                skipped.append(name)
                continue
            module = importlib.import_module(name)
            imported.append(name)
            if info.ispkg:
                walk(module, name + ".")

    walk(reliable_beat, "reliable_beat.")

    from sqlalchemy import select

    from reliable_beat import outbox as rb_outbox
    from reliable_beat import schedules as sch
    from reliable_beat import unsent
    from reliable_beat.beat import Beat
    from reliable_beat.db.dialects import Store
    from reliable_beat.db.migrate import upgrade
    from reliable_beat.db.tables import entries, runs
    from reliable_beat.entries import EntryDefinition
    from reliable_beat.relay import Relay
    from reliable_beat.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'rb.sqlite3'}"
        store = Store.from_url(url)
        upgrade(store)
        with store.begin() as conn:
            now = store.now(conn).replace(microsecond=0)
        anchor = now - timedelta(seconds=30)
        definition = EntryDefinition(name="nightly", task="proj.report", schedule=sch
                                     .IntervalSchedule(timedelta(seconds=60), anchor))
        with store.begin() as conn:
            values = definition.row_values()
            values.update(next_fire_at=anchor, created_at=now, updated_at=now, enabled=True,
                          paused=False)
            conn.execute(entries.insert().values(**values))
            rb_outbox.add(conn, "memory", {"hello": "world"}, key="plain-1")

        # the core beat tick: claims the due slot, commits its run (a due slot's trigger has
        # no outbox row); no fast path here: the sweep a beat runs for a slot committed and
        # never published writes its trigger row (sweep delay 0: at once)
        tick = Beat(store, owner="probe:1", trigger_destination="dramatiq",
                    sweep_delay=timedelta(0)).tick()
        with store.begin() as conn:
            unsent.materialise_unsent(store, conn, now=store.now(conn),
                                      sweep_delay=timedelta(0), destination="dramatiq",
                                      schedule_group=None, limit=10)

        delivered: list[tuple[str, object]] = []

        def memory(message: rb_outbox.OutboxMessage) -> None:
            delivered.append((message.destination, message.payload))

        # one relay cycle, no framework app: the in-memory handler takes both destinations
        relay = Relay(store, handlers={"memory": memory, "dramatiq": memory},
                      settings=Settings(database_url=url), owner="probe-relay")
        relay.run_once()
        with store.engine.connect() as conn:
            run_state = conn.execute(select(runs.c.state)).scalar_one()
        store.engine.dispose()

    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in FRAMEWORKS
                    or not_core(m))
    print(json.dumps({
        "imported": imported, "skipped": skipped, "tick": len(tick.triggers),
        "delivered": sorted(d for d, _ in delivered), "run_state": run_state,
        "framework_modules": loaded,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
