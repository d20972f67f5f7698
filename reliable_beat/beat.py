"""One beat tick: claim due entries, plan their slots, write runs + triggers, advance.

Everything that decides *whether* a slot fires happens in **one** transaction (invariant 2):

1. ``SELECT ... FROM reliable_beat_entries WHERE <due> AND next_fire_at <= now ORDER BY
   next_fire_at LIMIT n FOR UPDATE SKIP LOCKED`` (SQLite: inside ``BEGIN IMMEDIATE``); with
   a claim-ahead ``A`` > 0 also the entries of overlap policy ``allow`` whose next slot is
   at most ``now + A`` (``next_fire_at <= now + A AND (next_fire_at <= now OR
   overlap_policy = 'allow')``);
2. plan each entry's due slots (:func:`reliable_beat.planner.plan_entry`, misfire policy,
   decided against the real ``now``; an entry not due yet gets its one future slot, on
   time), then the overlap policy from run state;
3. ``INSERT`` the runs (``ON CONFLICT DO NOTHING`` on UNIQUE(entry, fire_at) and on the
   idempotency key: a slot already fired is a no-op, whatever the clocks said) and a trigger
   outbox row for each run inserted and fired ahead of its slot (claimed ahead);
4. advance ``next_fire_at`` on the grid; commit.

Only after the commit are the triggers published (by the caller), never before their slot.
A trigger due at the claim has no outbox row: its run is its record (a crash before the
publish is swept after the sweep delay: :mod:`reliable_beat.unsent`). One claimed ahead is
held until ``fire_at``; its row is swept after ``fire_at + sweep_delay`` if still unsent.

"now" is always the database's clock (invariant 4). This module knows nothing of Celery.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    Table,
    and_,
    bindparam,
    cast,
    column,
    func,
    not_,
    or_,
    select,
    true,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection
from sqlalchemy.types import JSON, BigInteger, DateTime, NullType, Text, TypeEngine

from reliable_beat import rows as rows_mod
from reliable_beat import schedules as sch
from reliable_beat import tracing
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import MYSQL_DIALECTS, entries, outbox, runs
from reliable_beat.identity import store_id as _store_id
from reliable_beat.planner import Plan, SkippedRange, plan_entry
from reliable_beat.redaction import get_logger
from reliable_beat.slots import SlotText, format_fire_at, idempotency_key
from reliable_beat.triggers import (
    ACTIVE_RUN_STATES,
    TRIGGER_DESTINATION,
    TRIGGER_DESTINATIONS,
    Trigger,
    build_trigger_payload,
    task_id_for,
    trigger_identity,
    trigger_message_id,
    trigger_outbox_row,
)
from reliable_beat.workflow_store import active_entries

__all__ = [
    "ACTIVE_RUN_STATES",
    "TRIGGER_DESTINATIONS",
    "Beat",
    "TickResult",
    "Trigger",
    "due_clause",
    "task_id_for",
    "trigger_identity",
    "trigger_message_id",
    "trigger_outbox_row",
]

log = get_logger("reliable_beat.beat")

#: Planning time one claim transaction may spend (seconds): entries claimed but not yet
#: planned when it runs out are left untouched (their row locks go at the commit) and the
#: next claim takes them at once. Keeps the transaction far below PostgreSQL's
#: ``idle_in_transaction_session_timeout`` whatever the batch size and the downtime.
PLAN_BUDGET_SECONDS = 0.5


def slot_counter(schedule: sch.Schedule) -> Callable[[datetime, datetime], int | None]:
    """``(first, last) -> n``: the due slots from ``first`` (an entry's ``next_fire_at``)
    to the slot ``last``, both included, by arithmetic for an interval; None for other
    schedules (counting a cron's slots means walking them)."""
    if isinstance(schedule, sch.IntervalSchedule):
        every = schedule.every
        anchor = schedule.anchor

        def count(first: datetime, last: datetime) -> int | None:
            return 1 + (last - anchor) // every - (first - anchor) // every

        return count
    return lambda _first, _last: None


class _PlanCalls:
    """A schedule's ``next_after`` / ``previous_at_or_before`` and the plans made with it,
    remembered for one tick (a schedule is a value: the same instant always gets the same
    answer, and :func:`plan_entry` is deterministic); errors are not remembered. Bounded by
    the instants and the distinct plan inputs one tick sees."""

    def __init__(self, schedule: sch.Schedule) -> None:
        self._schedule = schedule
        self._next: dict[datetime, datetime | None] = {}
        self._previous: dict[datetime, datetime | None] = {}
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self.count_slots = slot_counter(schedule)

    def plan(self, row: Any, now: datetime, claim_until: datetime | None) -> Plan:
        """:func:`plan_entry` of a claimed entry of this schedule, made once per distinct
        input (the herd: every entry of one schedule due at one slot shares one plan, read
        only)."""
        key = (row.next_fire_at, row.misfire_policy, row.misfire_grace_seconds,
               row.catch_up_limit, row.catch_up_window_seconds, row.end_at, now, claim_until)
        plan = self._plans.get(key)
        if plan is None:
            window = row.catch_up_window_seconds
            plan = self._plans[key] = plan_entry(
                next_fire_at=row.next_fire_at, now=now, next_after=self.next_after,
                misfire_policy=row.misfire_policy,
                misfire_grace=timedelta(seconds=row.misfire_grace_seconds),
                catch_up_limit=row.catch_up_limit,
                catch_up_window=None if window is None else timedelta(seconds=window),
                end_at=row.end_at, claim_until=claim_until,
                previous_at_or_before=self.previous_at_or_before,
                count_slots=self.count_slots)
        return plan

    def next_after(self, t: datetime) -> datetime | None:
        try:
            return self._next[t]
        except KeyError:
            answer = self._next[t] = self._schedule.next_after(t)
            return answer

    def previous_at_or_before(self, t: datetime) -> datetime | None:
        try:
            return self._previous[t]
        except KeyError:
            answer = self._previous[t] = self._schedule.previous_at_or_before(t)
            return answer


#: SQLite: how often a claim also looks for rows whose instant is not readable (rows.py).
UNREADABLE_SCAN_SECONDS = 60.0


def due_clause() -> Any:
    """The partial-index predicate of entries that can be due.

    Spelled exactly like the index predicate (``enabled AND NOT paused AND next_fire_at IS
    NOT NULL``): PostgreSQL only uses a partial index when it can prove the query's WHERE
    implies the index's, and it does not derive ``enabled`` from ``enabled IS TRUE``. With
    ``IS TRUE`` / ``IS FALSE`` every tick was a sequential scan of the whole table (found by
    ``benchmarks/scale.py``). Both columns are NOT NULL, so the rows matched are the same.
    """
    return and_(
        entries.c.enabled,
        not_(entries.c.paused),
        entries.c.next_fire_at.is_not(None),
    )


def group_clause(group: str | None) -> Any:
    """Entries a beat of schedule group ``group`` may claim: the group's own and those with
    no group (stored before groups existed). ``None``: every entry (``true()``)."""
    if group is None:
        return true()
    return or_(entries.c.schedule_group == group, entries.c.schedule_group.is_(None))


def due_clause_for_min(dialect: str) -> Any:
    """:func:`due_clause` for ``MIN(next_fire_at)``.

    On MySQL/MariaDB without ``next_fire_at IS NOT NULL`` (``MIN`` skips NULLs anyway):
    with it the optimizer reads every entry of the enabled range of
    ``ix_reliable_beat_entries_due_mysql`` (10,000 index reads for 10,000 entries),
    without it one (``Select tables optimized away``). Elsewhere exactly :func:`due_clause`,
    which PostgreSQL needs to match its partial index.
    """
    if dialect in MYSQL_DIALECTS:
        return and_(entries.c.enabled, not_(entries.c.paused))
    return due_clause()


@dataclass
class TickResult:
    """What one tick did.

    Attributes:
        triggers: committed triggers to publish now.
        skipped: slots recorded as skipped.
        claimed: entries claimed.
        more: the planning budget ran out before every claimed entry was planned (those are
            left for the next claim, which should come at once).
        quarantined: malformed entries this tick disabled with a reason (never fired; see
            :mod:`reliable_beat.rows`).
        duplicates: slots another process had already fired (insert was a no-op).
        malformed_runs: slots whose existing run row had a state outside
            :data:`reliable_beat.rows.KNOWN_RUN_STATES`: not fired, not counted as
            duplicates, dead-lettered as malformed for a person to decide
            (:func:`reliable_beat.rows.settle_unknown_states`).
        next_fire_at: the earliest ``next_fire_at`` of any due-able entry after the tick.
        next_claim_at: the earliest database instant at which a claim can find an entry
            (``next_fire_at`` less the claim-ahead for an ``allow`` entry); None: none.
        now: the database clock at the tick (``clock_timestamp()`` of the claim transaction's
            first statement).
        monotonic: ``time.monotonic()`` of this process taken right after ``now`` was read,
            so ``now + (time.monotonic() - monotonic)`` never runs ahead of the database
            clock (a trigger held until its ``fire_at`` on that estimate is never early).
    """

    triggers: list[Trigger] = field(default_factory=list)
    skipped: int = 0
    claimed: int = 0
    quarantined: int = 0
    malformed_runs: int = 0
    duplicates: int = 0
    next_fire_at: datetime | None = None
    next_claim_at: datetime | None = None
    now: datetime | None = None
    monotonic: float = 0.0
    more: bool = False

    @property
    def ahead(self) -> list[Trigger]:
        """The triggers whose slot is still after :attr:`now` (claimed ahead: hold them)."""
        assert self.now is not None
        now = self.now
        return [t for t in self.triggers if t.fire_at > now]


# --------------------------------------------------------------------------- PostgreSQL bulk
#
# A multi-row ``INSERT ... VALUES`` of 500 runs has ~6,000 bind parameters: SQLAlchemy builds
# and psycopg re-parses that statement on every batch (about half of a tick's time). On
# PostgreSQL the rows go instead as ONE JSON parameter, expanded by ``jsonb_to_recordset``:
# the statement text is short and the same every time (cached by SQLAlchemy and psycopg).


def _pg_type(coltype: TypeEngine[Any]) -> TypeEngine[Any]:
    """The recordset column type standing for a table column's type."""
    if isinstance(coltype, JSON) or isinstance(getattr(coltype, "impl", None), JSON):
        return postgresql.JSONB()
    if isinstance(coltype, BigInteger):
        return BigInteger()
    if isinstance(getattr(coltype, "impl", coltype), DateTime):
        return DateTime(timezone=True)
    return coltype


@cache
def _pg_insert_stmt(table: Table, names: tuple[str, ...], ignore: bool,
                    returning: tuple[str, ...]) -> Any:
    rows = func.jsonb_to_recordset(cast(bindparam("rows", type_=Text), postgresql.JSONB))
    tv = rows.table_valued(
        *(column(n, _pg_type(table.c[n].type)) for n in names)
    ).render_derived(name="r", with_types=True)
    ins = postgresql.insert(table).from_select(list(names), select(*(tv.c[n] for n in names)))
    if ignore:
        ins = ins.on_conflict_do_nothing()
    return ins.returning(*(table.c[n] for n in returning))


@cache
def _pg_advance_stmt() -> Any:
    rows = func.jsonb_to_recordset(cast(bindparam("rows", type_=Text), postgresql.JSONB))
    tv = rows.table_valued(
        column("b_id", BigInteger()), column("b_next", DateTime(timezone=True)),
        column("b_last", DateTime(timezone=True)), column("b_now", DateTime(timezone=True)),
    ).render_derived(name="u", with_types=True)
    return (
        update(entries)
        .where(entries.c.id == tv.c.b_id)
        .values(next_fire_at=tv.c.b_next, last_fire_at=tv.c.b_last, updated_at=tv.c.b_now)
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass a tz-aware UTC datetime")
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _rows_param(rows: Sequence[dict[str, Any]]) -> str:
    """The JSON text of ``rows`` for ``jsonb_to_recordset``; instants as ISO 8601 with offset.

    Top-level ``datetime`` values are formatted here, each distinct instant once (a batch
    shares ``now`` and often its slots), which is about twice as fast as letting
    ``json.dumps`` call back for each of them. Naive datetimes raise :class:`ValueError`.
    """
    if not rows:
        return "[]"
    # the keys that can hold an instant, from the first row (a batch's rows share their keys
    # and types); an instant elsewhere is still formatted, by json.dumps' default, the same
    instant_keys = [k for k, v in rows[0].items() if v is None or v.__class__ is datetime]
    memo: dict[datetime, str] = {}
    out = []
    for row in rows:
        converted = row.copy()
        for key in instant_keys:
            value = converted.get(key)
            if value.__class__ is datetime:
                text = memo.get(value)
                if text is None:
                    text = memo[value] = _json_default(value)
                converted[key] = text
        out.append(converted)
    return json.dumps(out, default=_json_default, separators=(",", ":"))


def _insert_rows(
    conn: Connection, store: Store, table: Table, rows: list[dict[str, Any]], *,
    ignore: bool, returning: tuple[str, ...],
) -> list[Any]:
    """Insert ``rows`` (all with the same keys) and return the ``returning`` columns of the
    rows actually inserted. ``ignore``: a conflicting row is a no-op (``ON CONFLICT DO
    NOTHING``). PostgreSQL: one statement with one JSON parameter; elsewhere executemany."""
    if store.dialect == "postgresql":
        stmt = _pg_insert_stmt(table, tuple(rows[0]), ignore, returning)
        return list(conn.execute(stmt, {"rows": _rows_param(rows)}).all())
    base = store.insert_ignore(table) if ignore else table.insert()
    return list(conn.execute(base.returning(*(table.c[n] for n in returning)), rows).all())


def _advance_entries(conn: Connection, store: Store, updates: list[dict[str, Any]]) -> None:
    """Set ``next_fire_at`` / ``last_fire_at`` / ``updated_at`` of the claimed entries."""
    if store.dialect == "postgresql":
        conn.execute(_pg_advance_stmt(), {"rows": _rows_param(updates)})
        return
    conn.execute(
        update(entries)
        .where(entries.c.id == bindparam("b_id"))
        .values(
            next_fire_at=bindparam("b_next"),
            last_fire_at=bindparam("b_last"),
            updated_at=bindparam("b_now"),
        ),
        updates,
    )


def _range_row(row: Any, rng: SkippedRange, now: datetime) -> dict[str, Any]:
    """The one ``skipped`` run row standing for a :class:`SkippedRange`: keyed by its first
    slot; ``reason`` is ``"<reason>; slots A..B skipped, n slots"`` and ``result`` holds
    ``{"skipped_range": {"first", "last", "count"}}`` (ISO 8601 UTC; count None: not
    enumerated)."""
    return {
        "idempotency_key": idempotency_key(row.name, rng.first),
        "entry_name": row.name,
        "fire_at": rng.first,
        "trigger": "schedule",
        "task": row.task,
        "args": row.args,
        "kwargs": row.kwargs,
        "state": "skipped",
        "reason": f"{rng.reason}; {rng.describe()}",
        "result": {"skipped_range": {"first": format_fire_at(rng.first),
                                     "last": format_fire_at(rng.last), "count": rng.count}},
        "created_at": now,
        "updated_at": now,
    }


@dataclass
class Beat:
    """The framework-neutral beat: :meth:`tick` does one claim transaction.

    Safe to run in any number of processes against one store.

    Args:
        store: the store.
        owner: this process's id (``host:pid``), recorded on the trigger rows.
        batch_size: entries claimed per tick transaction.
        is_tracked: task name -> True when the task keeps run state (``IdempotentTask``);
            overlap policies other than ``allow`` are only applied to tracked tasks.
        sweep_delay: how long the fast path has to publish before a relay may sweep; counted
            from the slot when the slot is still in the future.
        claim_ahead: also claim entries of overlap policy ``allow`` whose next slot is at most
            this far after ``now``; their triggers come back with ``fire_at > now`` and the
            caller must hold them until then. ``timedelta(0)``: claim only due entries.
        schedule_group: claim only the entries of this schedule group, plus entries with no
            group (rows stored before groups existed). Several apps with their own brokers
            may share one store: a beat publishes into its own app's broker, so it must
            never claim another app's entries. ``None``: claim every group (a single-app
            store driven through the API without a group).
    """

    store: Store
    owner: str
    batch_size: int = 500
    is_tracked: Callable[[str], bool] = lambda _task: True
    sweep_delay: timedelta = timedelta(seconds=10)
    claim_ahead: timedelta = timedelta(0)
    plan_budget: float = PLAN_BUDGET_SECONDS
    schedule_group: str | None = None
    #: The outbox destination of this beat's trigger rows (one of TRIGGER_DESTINATIONS).
    trigger_destination: str = TRIGGER_DESTINATION
    _schedules: dict[str, tuple[Any, sch.Schedule]] = field(default_factory=dict, repr=False)
    _schedules_by_spec: dict[Any, sch.Schedule] = field(default_factory=dict, repr=False)
    #: the claim's columns and each distinct entry config decoded and checked once
    _claimed: rows_mod.ClaimedEntries = field(default_factory=rows_mod.ClaimedEntries,
                                              repr=False)
    _sid: str | None = field(default=None, repr=False)  # the store's id, for trigger headers
    _last_scan: float = field(default=float("-inf"), repr=False)
    #: the spans of the tick in progress (reliable_beat.tracing; None: tracing off)
    _trace: tracing.BeatTrace | None = field(default=None, repr=False)

    def _due(self) -> Any:
        """:func:`due_clause`, scoped to this beat's schedule group (and group-less rows)."""
        return and_(due_clause(), group_clause(self.schedule_group))

    def _due_for_min(self) -> Any:
        """:func:`due_clause_for_min`, scoped to this beat's schedule group."""
        return and_(due_clause_for_min(self.store.dialect), group_clause(self.schedule_group))

    def _scan_due(self) -> bool:
        """True at most once per :data:`UNREADABLE_SCAN_SECONDS` (and on the first tick)."""
        if time.monotonic() - self._last_scan < UNREADABLE_SCAN_SECONDS:
            return False
        self._last_scan = time.monotonic()
        return True

    def _schedule(self, name: str, spec: Mapping[str, Any]) -> sch.Schedule:
        cached = self._schedules.get(name)
        if cached is not None and cached[0] == spec:
            return cached[1]
        # Entries with the same spec share one schedule object (the herd: 100,000 entries
        # of ``0 * * * *`` build and validate one CronSchedule and its croniter, not one
        # each). A schedule is a value: a reused one answers as a fresh one
        # (tests/unit/test_schedule_properties.py).
        try:
            key: Any = tuple(sorted(spec.items()))
            shared = self._schedules_by_spec.get(key)
        except TypeError:  # an unhashable value in a malformed spec: no sharing
            key, shared = None, None
        schedule = shared if shared is not None else sch.schedule_from_spec(spec)
        if len(self._schedules) > 10_000:  # bounded: memory must not grow with entries
            self._schedules.clear()
        if len(self._schedules_by_spec) > 10_000:
            self._schedules_by_spec.clear()
        self._schedules[name] = (spec, schedule)
        if key is not None:
            self._schedules_by_spec[key] = schedule
        return schedule

    def tick(self) -> TickResult:
        """Claim up to ``batch_size`` due entries and fire their slots, in one transaction.

        With ``claim_ahead`` > 0 some triggers are for slots after ``result.now``
        (:attr:`TickResult.ahead`): publish each no earlier than its ``fire_at``.

        Returns:
            The committed triggers (publish them, then :func:`mark_sent`), counts, and the
            earliest next fire / claim time.

        Raises:
            StoreUnavailableError: the database is down (nothing was written).
        """
        trace = self._trace = tracing.BeatTrace.start(self.trigger_destination)
        if trace is None:
            return self._tick()
        try:
            result = self._tick()
        except BaseException as exc:  # rolled back: the slots' spans end as errors
            trace.end(exc)
            raise
        trace.end()  # committed: each fired slot's span ends here
        return result

    def _tick(self) -> TickResult:
        result = TickResult()
        if self._sid is None:  # read outside the claim transaction (SQLite: one writer)
            self._sid = _store_id(self.store)
        with self.store.begin() as conn:
            now = self.store.now(conn)
            result.monotonic = time.monotonic()
            result.now = now
            ahead = self.claim_ahead > timedelta(0)
            claimable = (
                and_(entries.c.next_fire_at <= now + self.claim_ahead,
                     or_(entries.c.next_fire_at <= now, entries.c.overlap_policy == "allow"))
                if ahead else entries.c.next_fire_at <= now
            )
            if conn.dialect.name == "sqlite" and self._scan_due():
                # a garbage instant (SQLite holds any text) is never due: once a minute the
                # claim also takes such rows, to quarantine them (off the hot path: the test
                # costs a function call per enabled entry)
                claimable = or_(claimable, rows_mod.unreadable_instant(entries.c.next_fire_at))
            elif conn.dialect.name == "postgresql" and self._scan_due():
                # 'infinity' (or a year after 9999) is never due: once a minute the claim also
                # takes such rows, to quarantine them (an index range scan of the far end)
                claimable = or_(claimable, rows_mod.infinite_instant(entries.c.next_fire_at))
            stmt = (
                select(*self._claimed.columns(conn.dialect))
                .where(self._due(), claimable)
                .order_by(entries.c.next_fire_at)
                .limit(self.batch_size)
            )
            claimed = conn.execute(self.store.for_update_skip_locked(stmt)).all()
            result.claimed = len(claimed)
            rows = self._usable(conn, claimed, now, result)
            if rows:
                self._fire(conn, rows, now, result)
            self._release_buffered(conn, now, result)
            result.next_fire_at = self._min_next_fire_at(
                conn, now, result, self._due_for_min())
            result.next_claim_at = result.next_fire_at
            if ahead and result.next_fire_at is not None:
                # The earliest `allow` entry in the window [next_fire_at, + claim_ahead] can
                # be claimed claim_ahead before its slot (an index range scan of that window).
                first_allow = self._min_next_fire_at(
                    conn, now, result, and_(
                        self._due_for_min(),
                        entries.c.overlap_policy == "allow",
                        entries.c.next_fire_at <= result.next_fire_at + self.claim_ahead,
                    )
                )
                if first_allow is not None:
                    result.next_claim_at = min(result.next_fire_at,
                                               first_allow - self.claim_ahead)
        return result

    def _usable(
        self, conn: Connection, claimed: Sequence[Any], now: datetime, result: TickResult
    ) -> list[Any]:
        """The claimed rows that are well-formed; each malformed one is quarantined (disabled
        with its reason, logged at ERROR, counted in :attr:`TickResult.quarantined`) in this
        transaction, so one bad row never stops the tick (:mod:`reliable_beat.rows`)."""
        usable: list[Any] = []
        read = self._claimed.read
        for raw in claimed:
            values, problems, unreadable, schedule = read(raw._mapping, conn.dialect,
                                                          self._schedule)
            if problems:
                rows_mod.quarantine_entry(conn, values, problems, now, unreadable=unreadable)
                result.quarantined += 1
                continue
            values["schedule_obj"] = schedule
            usable.append(SimpleNamespace(**values))
        return usable

    def _min_next_fire_at(
        self, conn: Connection, now: datetime, result: TickResult, where: Any
    ) -> datetime | None:
        """``min(next_fire_at)`` of the rows matching ``where``. On SQLite a value that is not
        an instant (the column holds any text) quarantines its entries, then looks again."""
        if conn.dialect.name != "sqlite":
            value: datetime | None = conn.execute(
                select(func.min(entries.c.next_fire_at)).where(where)
            ).scalar_one_or_none()
            if rows_mod.infinity_text(value) is not None:
                # PostgreSQL '-infinity' / 'infinity' left unclaimed (more than a batch): not
                # an instant to compute with; claim again now, the claim quarantines them
                return now
            return value
        for _ in range(10):
            raw = conn.execute(
                select(type_coerce(func.min(entries.c.next_fire_at), NullType())).where(where)
            ).scalar_one_or_none()
            if raw is None:
                return None
            try:
                decoded = rows_mod.decode_value(entries.c.next_fire_at, raw, conn.dialect)
            except Exception:
                decoded = None
            if isinstance(decoded, datetime):
                return decoded
            bad = conn.execute(
                select(*rows_mod.raw_columns(entries, conn.dialect)).where(
                    where, type_coerce(entries.c.next_fire_at, NullType()) == raw
                )
            ).all()
            for row in bad:
                values, problems, unreadable = rows_mod.read_entry(row._mapping, conn.dialect)
                rows_mod.quarantine_entry(conn, values, problems or [
                    f"next_fire_at={rows_mod.raw_repr(raw)}: expected a UTC instant"
                ], now, unreadable=unreadable | {"next_fire_at"})
                result.quarantined += 1
        return None

    def _fire(self, conn: Connection, rows: list[Any], now: datetime, result: TickResult) -> None:
        run_rows: list[dict[str, Any]] = []
        range_rows: list[dict[str, Any]] = []
        entry_updates: list[dict[str, Any]] = []
        overlap_entries = [
            r.name for r in rows if r.overlap_policy != "allow" and self.is_tracked(r.task)
        ]
        active: dict[str, set[str]] = {}
        if overlap_entries:
            for name, state in conn.execute(
                select(runs.c.entry_name, runs.c.state).where(
                    runs.c.entry_name.in_(overlap_entries),
                    runs.c.state.in_((*ACTIVE_RUN_STATES, "buffered")),
                )
            ):
                active.setdefault(name, set()).add(state)
            # entries that start workflows: the previous slot's workflow, not its start run
            for name in active_entries(conn, overlap_entries):
                active.setdefault(name, set()).add("running")
        # Per tick, one memo per schedule object: entries sharing a schedule (the herd: every
        # ``0 * * * *`` entry due at the same slot) ask it the same questions.
        planners: dict[int, tuple[sch.Schedule, _PlanCalls]] = {}
        slot_text = SlotText()  # each distinct slot formatted once per tick (keys, headers)
        started = time.monotonic()
        for index, row in enumerate(rows):
            if index and time.monotonic() - started > self.plan_budget:
                # Out of planning time: leave the rest untouched (their locks go at the
                # commit); the caller claims again at once.
                result.more = True
                log.info("planning budget of %.2f s spent after %d of %d claimed entries; "
                         "the rest are claimed again at once", self.plan_budget, index,
                         len(rows))
                break
            try:
                schedule = row.schedule_obj
                memo = planners.get(id(schedule))
                if memo is None or memo[0] is not schedule:
                    memo = planners[id(schedule)] = (schedule, _PlanCalls(schedule))
                ahead_ok = self.claim_ahead > timedelta(0) and row.overlap_policy == "allow"
                plan = memo[1].plan(row, now, now + self.claim_ahead if ahead_ok else None)
            except Exception:
                # One bad entry never stops the tick: log it and push it back a minute.
                log.exception("entry %r: cannot plan its slots; retrying in 60 s", row.name)
                entry_updates.append(
                    {"b_id": row.id, "b_next": now + timedelta(seconds=60),
                     "b_last": row.last_fire_at, "b_now": now}
                )
                continue
            for rng in plan.skipped_ranges:
                log.warning("entry %r: %s (%s)", row.name, rng.describe(), rng.reason)
                range_rows.append(_range_row(row, rng, now))
            states = active.get(row.name, set())
            tracked = row.overlap_policy != "allow" and self.is_tracked(row.task)
            for d in plan.decisions:
                key = slot_text.key(row.name, d.fire_at)
                state, reason = "scheduled", None
                if not d.fire:
                    state, reason = "skipped", d.reason
                elif tracked and states & set(ACTIVE_RUN_STATES):
                    if row.overlap_policy == "buffer_one" and "buffered" not in states:
                        state, reason = "buffered", "overlap:buffer_one"
                        states.add("buffered")
                    else:
                        state, reason = "skipped", "overlap:skip"
                elif tracked:
                    states.add("scheduled")
                run_rows.append(
                    {
                        "idempotency_key": key,
                        "entry_name": row.name,
                        "fire_at": d.fire_at,
                        "trigger": d.trigger,
                        "task": row.task,
                        "args": row.args,
                        "kwargs": row.kwargs,
                        "state": state,
                        "reason": reason,
                        "created_at": now,
                        "updated_at": now,
                        "_options": row.options,
                    }
                )
            last = plan.last_slot or row.last_fire_at
            entry_updates.append(
                {"b_id": row.id, "b_next": plan.next_fire_at, "b_last": last, "b_now": now}
            )

        if range_rows:
            inserted_ranges = _insert_rows(conn, self.store, runs, range_rows, ignore=True,
                                           returning=("id",))
            result.skipped += len(inserted_ranges)
            result.duplicates += len(range_rows) - len(inserted_ranges)
        if run_rows:
            options_by_key = {r["idempotency_key"]: r.pop("_options") for r in run_rows}
            by_key = {r["idempotency_key"]: r for r in run_rows}
            inserted = _insert_rows(conn, self.store, runs, run_rows, ignore=True,
                                    returning=("id", "idempotency_key"))
            result.duplicates += len(run_rows) - len(inserted)
            if len(inserted) < len(run_rows):  # runs that existed: a state nobody knows?
                done = {k for _, k in inserted}
                malformed = rows_mod.settle_unknown_states(
                    conn, [k for k in by_key if k not in done], now)
                result.duplicates -= malformed
                result.malformed_runs += malformed
            outbox_rows: list[dict[str, Any]] = []
            pending: list[tuple[int, str, dict[str, Any], datetime]] = []
            for run_id, key in inserted:
                r = by_key[key]
                if r["state"] == "skipped":
                    result.skipped += 1
                    continue
                if r["state"] != "scheduled":
                    continue
                tp = None if self._trace is None else self._trace.fire(
                    entry=r["entry_name"], slot=slot_text.fire_at(r["fire_at"]), key=key,
                    task=r["task"], trigger=r["trigger"], task_id=task_id_for(key))
                payload = build_trigger_payload(
                    task=r["task"], args=r["args"], kwargs=r["kwargs"],
                    options=options_by_key[key], key=key, entry=r["entry_name"],
                    fire_at=r["fire_at"], trigger=r["trigger"],
                    store_id=self._sid, slot_text=slot_text,
                    destination=self.trigger_destination, traceparent=tp,
                )
                if r["fire_at"] <= now:  # due: no outbox row (see the module docstring)
                    result.triggers.append(
                        Trigger.due(run_id, key, payload, r["fire_at"], tp))
                    continue
                outbox_rows.append(
                    self._outbox_row(key, run_id, payload, now, fire_at=r["fire_at"],
                                     traceparent=tp)
                )
                pending.append((run_id, key, payload, r["fire_at"]))
            if outbox_rows:
                if any("traceparent" in row for row in outbox_rows):  # all the same keys
                    for row in outbox_rows:
                        row.setdefault("traceparent", None)
                ids = _insert_rows(conn, self.store, outbox, outbox_rows, ignore=False,
                                   returning=("id", "message_id"))
                id_by_mid = {mid: oid for oid, mid in ids}
                for run_id, key, payload, fire_at in pending:
                    result.triggers.append(
                        Trigger(id_by_mid[trigger_message_id(key)], run_id, key, payload, fire_at)
                    )
        if entry_updates:
            _advance_entries(conn, self.store, entry_updates)

    def _outbox_row(
        self, key: str, run_id: int, payload: dict[str, Any], now: datetime,
        fire_at: datetime | None = None, traceparent: str | None = None,
    ) -> dict[str, Any]:
        # A slot claimed ahead is swept no earlier than slot + sweep delay: a beat that dies
        # holding it never lets a relay publish it before its instant.
        start = max(now, fire_at) if fire_at is not None else now
        return trigger_outbox_row(key, run_id, payload, now,
                                  available_at=start + self.sweep_delay, claimed_by=self.owner,
                                  destination=self.trigger_destination,
                                  traceparent=traceparent)

    def _release_buffered(self, conn: Connection, now: datetime, result: TickResult) -> None:
        """Turn a ``buffered`` run into a trigger once its entry has no active run."""
        # Rows read value by value and checked (reliable_beat.rows): a malformed buffered run
        # is dead-lettered, an entry with malformed options quarantined; the others go on.
        buffered = rows_mod.read_buffered_runs(conn, now, limit=self.batch_size)
        if not buffered:
            return
        names = {b.entry_name for b in buffered}
        still_active = set(
            conn.execute(
                select(runs.c.entry_name).where(
                    runs.c.entry_name.in_(names), runs.c.state.in_(ACTIVE_RUN_STATES)
                )
            ).scalars()
        )
        options = rows_mod.read_entry_options(conn, names, now)
        for b in buffered:
            if b.entry_name in still_active or options.get(b.entry_name, {}) is None:
                continue
            done = conn.execute(
                update(runs)
                .where(runs.c.id == b.id, runs.c.state == "buffered")
                .values(state="scheduled", updated_at=now)
            )
            if not done.rowcount:
                continue
            still_active.add(b.entry_name)  # one released run per entry at a time
            tp = None if self._trace is None else self._trace.fire(
                entry=b.entry_name, slot=format_fire_at(b.fire_at), key=b.idempotency_key,
                task=b.task, trigger=b.trigger, task_id=task_id_for(b.idempotency_key))
            payload = build_trigger_payload(
                task=b.task, args=b.args, kwargs=b.kwargs,
                options=options.get(b.entry_name) or {},
                key=b.idempotency_key, entry=b.entry_name, fire_at=b.fire_at, trigger=b.trigger,
                store_id=self._sid, destination=self.trigger_destination, traceparent=tp,
            )
            oid = conn.execute(
                outbox.insert().returning(outbox.c.id),
                [self._outbox_row(b.idempotency_key, b.id, payload, now, traceparent=tp)],
            ).scalar_one()
            result.triggers.append(Trigger(oid, b.id, b.idempotency_key, payload, b.fire_at))
