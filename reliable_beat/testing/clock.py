"""A scheduler clock for tests: drive entries through a window on a simulated database clock.

The beat takes "now" from the store (:meth:`Store.now`, invariant 4: one clock, the
database's). :class:`SimulatedClockStore` is a store whose clock is a value the test moves;
everything else (the claim transaction, the planner, misfire and overlap policy, the
UNIQUE(entry, slot) insert, grid advance) is the real code on the real database. Nothing
patches ``datetime``, and nothing waits in real time::

    clock = SchedulerClock(store, start=datetime(2026, 3, 28, 23, 0, tzinfo=timezone.utc))
    clock.sync({"report": {"task": "shop.report", "schedule": "30 2 * * *",
                           "options": {"reliable_beat": {"timezone": "Europe/Berlin"}}}})
    window = clock.run_until(datetime(2026, 3, 30, tzinfo=timezone.utc))
    assert window.fired_at("report") == [datetime(2026, 3, 29, 0, 30, tzinfo=timezone.utc)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reliable_beat import entries as rb_entries
from reliable_beat.beat import Beat, TickResult
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries as entries_table
from reliable_beat.db.tables import runs as runs_table
from reliable_beat.settings import Settings

__all__ = ["SchedulerClock", "SimulatedClockStore", "SlotSeen", "Window"]


class SimulatedClockStore(Store):
    """A :class:`Store` on the same engine whose clock (:meth:`now`) is :attr:`at`.

    Only what reads the clock through :meth:`Store.now` (the beat, entry changes) sees the
    simulated time; worker-side SQL that reads the server clock directly does not. Use it
    for scheduling, not for running tasks.
    """

    def __init__(self, store: Store, at: datetime) -> None:
        super().__init__(engine=store.engine, url=store.url)
        self.at = _utc(at, "at")

    def now(self, conn: Connection) -> datetime:
        """The simulated database clock (UTC-aware)."""
        return self.at

    def dispose(self) -> None:
        """No-op: the engine belongs to the store this one was made from."""


def _utc(value: datetime, what: str) -> datetime:
    if value.tzinfo is None:
        raise ValueError(f"{what}={value!r} is naive; pass a tz-aware instant "
                         "(e.g. datetime(..., tzinfo=timezone.utc))")
    return value.astimezone(timezone.utc)


@dataclass(frozen=True)
class SlotSeen:
    """One slot the beat decided on.

    Attributes:
        entry: the entry name.
        fire_at: the slot (UTC).
        state: ``scheduled`` (fired; ``succeeded`` once :class:`SchedulerClock` completed
            it), ``buffered`` (overlap ``buffer_one``) or ``skipped``.
        reason: why it was skipped or buffered (``misfire:skip``, ``overlap:skip``, ...).
        trigger: ``schedule`` (on time) or ``catch_up``.
        decided_at: the simulated clock at the tick that decided it.
        last / count: for a skipped *range* (a long downtime's older slots are recorded as
            one row, ``reliable_beat.planner.SKIP_RECORD_LIMIT``): its last slot and how
            many slots it stands for (None: not enumerated, a cron). A single slot:
            ``last == fire_at``, ``count == 1``.
    """

    entry: str
    fire_at: datetime
    state: str
    reason: str | None
    trigger: str | None
    decided_at: datetime
    last: datetime | None = None
    count: int | None = 1


@dataclass
class Window:
    """The slots decided while the clock moved, in decision order.

    Attributes:
        slots: every slot seen (fired, buffered and skipped).
        ticks: the simulated instants at which the beat ticked.
    """

    slots: list[SlotSeen] = field(default_factory=list)
    ticks: list[datetime] = field(default_factory=list)

    @property
    def fired(self) -> list[SlotSeen]:
        """The slots that fired (a trigger was written), in decision order."""
        return [s for s in self.slots if s.state not in ("skipped", "buffered")]

    @property
    def skipped(self) -> list[SlotSeen]:
        """The slots recorded as skipped (with :attr:`SlotSeen.reason`)."""
        return [s for s in self.slots if s.state == "skipped"]

    def fired_at(self, entry: str) -> list[datetime]:
        """The fired slots of ``entry`` (UTC), in order."""
        return [s.fire_at for s in self.fired if s.entry == entry]

    def skipped_at(self, entry: str) -> list[datetime]:
        """The skipped slots of ``entry`` (UTC), in order; a skipped range appears as its
        first slot (see :meth:`skipped_count`)."""
        return [s.fire_at for s in self.skipped if s.entry == entry]

    def skipped_count(self, entry: str) -> int | None:
        """How many slots of ``entry`` were skipped, ranges included (None: a range's count
        was not enumerated)."""
        counts = [s.count for s in self.skipped if s.entry == entry]
        return None if None in counts else sum(c for c in counts if c is not None)

    def extend(self, other: Window) -> None:
        self.slots.extend(other.slots)
        self.ticks.extend(other.ticks)


class SchedulerClock:
    """Drive a beat over the real store on a simulated database clock.

    Args:
        store: a migrated store (e.g. :func:`reliable_beat.testing.throwaway_store`).
        start: the simulated clock's first instant (tz-aware).
        settings: policy defaults for entries that set none (default: ``Settings()``).
        complete_runs: mark each fired run ``succeeded`` right after its tick, as if a
            worker ran it at once (so overlap policies see no active run). False: runs stay
            ``scheduled`` until :meth:`complete`.
        is_tracked: task name -> True when the task is an ``IdempotentTask`` (overlap
            policies apply only to those); default: every task.

    Safe to use from one thread. Only this clock's beat ticks; runs are not executed.
    """

    def __init__(
        self,
        store: Store,
        start: datetime,
        *,
        settings: Settings | None = None,
        complete_runs: bool = True,
        is_tracked: Callable[[str], bool] = lambda _task: True,
    ) -> None:
        self.store = SimulatedClockStore(store, start)
        self.settings = settings or Settings(database_url=store.url)
        self.complete_runs = complete_runs
        self.beat = Beat(store=self.store, owner="reliable_beat.testing:clock",
                         is_tracked=is_tracked, sweep_delay=timedelta(0))
        with store.engine.connect() as conn:
            self._seen = int(conn.execute(sa.select(sa.func.max(runs_table.c.id))).scalar() or 0)

    @property
    def now(self) -> datetime:
        """The simulated database clock (UTC)."""
        return self.store.at

    def set(self, at: datetime) -> None:
        """Move the clock to ``at`` (never backwards) without ticking.

        Raises:
            ValueError: ``at`` is naive or before :attr:`now`.
        """
        at = _utc(at, "at")
        if at < self.store.at:
            raise ValueError(f"the clock only moves forward: {at} < {self.store.at}")
        self.store.at = at

    # --------------------------------------------------------------------- entries ----

    def sync(self, beat_schedule: Mapping[str, Any], *, timezone: str = "UTC") -> dict[str, int]:
        """Sync a Celery ``beat_schedule`` into the store at :attr:`now`, as a starting beat
        does (new entries' first slot is the first one strictly after :attr:`now`).

        Args:
            beat_schedule: ``{name: {"task", "schedule", "args", "kwargs", "options"}}``.
            timezone: Celery's ``timezone`` setting (the zone of entries that set none).

        Returns:
            ``{"inserted", "updated", "unchanged", "disabled"}`` counts.

        Raises:
            EntryValidationError: every bad entry, each named with its fix.
        """
        definitions = rb_entries.definitions_from_beat_schedule(
            beat_schedule, default_timezone=timezone, settings=self.settings, now=self.now)
        return rb_entries.sync_config_entries(self.store, definitions)

    def add(self, definition: rb_entries.EntryDefinition) -> str:
        """Add a runtime entry at :attr:`now` (``entries add``). Returns ``inserted``."""
        return rb_entries.save_runtime_entry(self.store, definition, create=True)

    def pause(self, name: str) -> None:
        """Pause ``name`` at :attr:`now` (``entries pause``)."""
        rb_entries.pause(self.store, name)

    def resume(self, name: str) -> None:
        """Resume ``name`` at :attr:`now`; its missed slots go through its misfire policy on
        the next tick."""
        rb_entries.resume(self.store, name)

    def complete(self, entry: str | None = None) -> int:
        """Mark active runs (``scheduled``/``dispatched``/``running``/``retrying``) of
        ``entry`` (None: all) ``succeeded``, as a worker finishing them would. Returns the
        number of runs completed."""
        stmt = sa.update(runs_table).where(
            runs_table.c.state.in_(("scheduled", "dispatched", "running", "retrying")),
            runs_table.c.entry_name.is_not(None),
        )
        if entry is not None:
            stmt = stmt.where(runs_table.c.entry_name == entry)
        with self.store.begin() as conn:
            return int(conn.execute(stmt.values(state="succeeded", updated_at=self.now))
                       .rowcount or 0)

    # ------------------------------------------------------------------------ time ----

    def tick(self) -> Window:
        """One beat tick at :attr:`now`. Returns the slots it decided."""
        result: TickResult = self.beat.tick()
        if self.complete_runs and result.triggers:
            self.complete()
        window = self._collect()
        window.ticks.append(self.now)
        return window

    def next_fire_at(self) -> datetime | None:
        """The earliest ``next_fire_at`` of an enabled, unpaused entry (UTC), or None."""
        with self.store.engine.connect() as conn:
            value = conn.execute(
                sa.select(sa.func.min(entries_table.c.next_fire_at)).where(
                    entries_table.c.enabled, sa.not_(entries_table.c.paused))
            ).scalar()
        return None if value is None else _utc(value, "next_fire_at")

    def run_until(self, until: datetime, *, late_by: timedelta = timedelta(0)) -> Window:
        """A running beat from :attr:`now` to ``until`` (half-open: a slot at ``until`` is
        not reached): it ticks at every ``next_fire_at`` (plus ``late_by``, e.g. a loop that
        wakes late), then the clock stands at ``until``.

        Raises:
            ValueError: ``until`` is naive or before :attr:`now`.
        """
        until = _utc(until, "until")
        if until < self.now:
            raise ValueError(f"run_until({until}) is before the clock ({self.now})")
        window = self.tick()
        while True:
            nxt = self.next_fire_at()
            if nxt is None or nxt + late_by >= until:
                break
            self.set(max(self.now, nxt + late_by))
            window.extend(self.tick())
        self.set(until)
        return window

    def down_until(self, until: datetime) -> Window:
        """A downtime: no beat runs until ``until``; then one starts and ticks at once
        (missed slots go through each entry's misfire policy). Returns what that tick
        decided."""
        self.set(until)
        return self.tick()

    def _collect(self) -> Window:
        stmt = (
            sa.select(runs_table.c.id, runs_table.c.entry_name, runs_table.c.fire_at,
                      runs_table.c.state, runs_table.c.reason, runs_table.c.trigger,
                      runs_table.c.result)
            .where(runs_table.c.id > self._seen, runs_table.c.entry_name.is_not(None))
            .order_by(runs_table.c.id)
        )
        window = Window()
        with self.store.engine.connect() as conn:
            for r in conn.execute(stmt):
                self._seen = max(self._seen, int(r.id))
                fire_at = _utc(r.fire_at, "fire_at")
                last: datetime = fire_at
                count: int | None = 1
                rng = r.result.get("skipped_range") if isinstance(r.result, dict) else None
                if r.state == "skipped" and isinstance(rng, dict):
                    last = datetime.fromisoformat(str(rng["last"]).replace("Z", "+00:00"))
                    raw = rng.get("count")
                    count = None if raw is None else int(raw)
                window.slots.append(SlotSeen(
                    entry=r.entry_name, fire_at=fire_at, state=r.state, reason=r.reason,
                    trigger=r.trigger, decided_at=self.now, last=last, count=count))
        return window
