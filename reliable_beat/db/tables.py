"""SQLAlchemy Core tables of the reliable_beat store.

All tables are prefixed ``reliable_beat_`` and live on one :data:`metadata` with a naming
convention, so migrations name constraints predictably. They must live in the same database
as the effects the tasks write (design.md §3), or effect and idempotency key cannot commit
together. JSON columns are JSONB on PostgreSQL; instants are ``timestamptz`` (UTC text on
SQLite, see :class:`~reliable_beat.db.types.UTCDateTime`).

Run states (``reliable_beat_runs.state``)::

    scheduled -> dispatched -> running -> succeeded
                                  |   \\-> retrying -> running ...
                                  \\-> dead
    skipped   (a slot the misfire / overlap policy decided not to fire; recorded, never sent)
    buffered  (overlap policy buffer_one: waits, unsent, until the entry's active run ends)

Attempt outcomes: ``running``, ``succeeded``, ``failed``, ``retrying``, ``deduplicated``,
``fenced_out``, ``dead``, ``busy`` (another runner held a live lease).
Outbox states: ``pending``, ``sent``, ``dead``.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)

from reliable_beat.db.types import JSONType, UTCDateTime

__all__ = [
    "MYSQL_DIALECTS",
    "attempts",
    "beats",
    "dead_letters",
    "entries",
    "exists_on",
    "metadata",
    "operator_actions",
    "outbox",
    "runs",
    "schedule_configs",
    "store_identity",
    "workflow_events",
    "workflow_signals",
    "workflows",
]

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: Dialect names of the MySQL family (the same as :data:`reliable_beat.db.dialects.MYSQL_DIALECTS`).
MYSQL_DIALECTS = ("mysql", "mariadb")


def exists_on(obj: object, dialect: str) -> bool:
    """False for a schema item declared only for other dialects (``Index(...).ddl_if``).

    Alembic's autogenerate does not read ``ddl_if``; migrations/env.py and the drift test
    use this as ``include_object`` so a MySQL-only index is no drift on PostgreSQL.
    """
    ddl_if = getattr(obj, "_ddl_if", None)
    wanted = getattr(ddl_if, "dialect", None)
    if wanted is None:
        return True
    return dialect in ((wanted,) if isinstance(wanted, str) else tuple(wanted))

# BIGINT ids on server databases; SQLite needs INTEGER PRIMARY KEY for rowid aliasing.
BigId = BigInteger().with_variant(Integer(), "sqlite")

entries = Table(
    "reliable_beat_entries",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("task", String(255), nullable=False),
    Column("args", JSONType, nullable=False, default=list),
    Column("kwargs", JSONType, nullable=False, default=dict),
    # Celery publish options: queue, routing_key, priority, expires (seconds), headers.
    Column("options", JSONType, nullable=False, default=dict),
    Column("schedule_kind", String(16), nullable=False),  # cron | interval | once
    Column("schedule", JSONType, nullable=False),  # Schedule.to_spec()
    Column("timezone", String(64), nullable=False, server_default="UTC"),
    Column("misfire_policy", String(16), nullable=False, server_default="fire_once"),
    Column("misfire_grace_seconds", Float, nullable=False, server_default="60"),
    Column("catch_up_limit", Integer, nullable=False, server_default="100"),
    Column("catch_up_window_seconds", Float, nullable=True),
    Column("overlap_policy", String(16), nullable=False, server_default="allow"),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("paused", Boolean, nullable=False, server_default=false()),
    Column("paused_at", UTCDateTime, nullable=True),
    Column("origin", String(16), nullable=False, server_default="runtime"),  # config | runtime
    # The schedule group that owns a config entry (NULL: runtime, or stored before groups).
    Column("schedule_group", String(200), nullable=True),
    Column("disabled_at", UTCDateTime, nullable=True),  # when a sync disabled it
    Column("config_hash", String(64), nullable=True),
    Column("start_at", UTCDateTime, nullable=True),
    Column("end_at", UTCDateTime, nullable=True),
    Column("next_fire_at", UTCDateTime, nullable=True),
    Column("last_fire_at", UTCDateTime, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    # A malformed row the beat could not use: disabled (enabled = false) with the problems
    # found; cleared when the entry is rewritten (config sync, `entries update`, `resume`).
    Column("quarantine_reason", Text, nullable=True),
    Column("quarantined_at", UTCDateTime, nullable=True),
    Index(
        "ix_reliable_beat_entries_due",
        "next_fire_at",
        postgresql_where=text("enabled AND NOT paused AND next_fire_at IS NOT NULL"),
        sqlite_where=text("enabled AND NOT paused AND next_fire_at IS NOT NULL"),
    ),
    Index("ix_reliable_beat_entries_schedule_group", "schedule_group"),
    # MySQL/MariaDB have no partial indexes: the due scan (enabled AND NOT paused AND
    # next_fire_at <= now ORDER BY next_fire_at) is a range of this one, disabled and paused
    # entries outside it. Created only there (``ddl_if``; migration 0005_composite_due_index).
    Index("ix_reliable_beat_entries_due_mysql", "enabled", "paused", "next_fire_at").ddl_if(
        dialect=MYSQL_DIALECTS),  # type: ignore[arg-type]  # a tuple is documented, typed str
)

# One row per beat_schedule version a schedule group has synced: the row with
# superseded_at NULL is the group's current config; a config seen before and superseded is
# an older one (an old pod of a rolling deploy) and never syncs again unless forced.
schedule_configs = Table(
    "reliable_beat_schedule_configs",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("schedule_group", String(200), nullable=False),
    Column("config_hash", String(64), nullable=False),
    Column("entry_names", JSONType, nullable=False, default=list),
    Column("first_synced_at", UTCDateTime, nullable=False),
    Column("synced_at", UTCDateTime, nullable=False),
    Column("synced_by", String(200), nullable=True),
    Column("superseded_at", UTCDateTime, nullable=True),
    UniqueConstraint("schedule_group", "config_hash"),
)

# One row per beat or relay process (owner id): its role, its group, the config it started
# with (beats), its heartbeat. role (0011_relaywatch): "beat" (every row before 0011) or
# "relay"; a relay's row is keyed "relay:<group or *>:<owner id>" (a process may run a beat
# and relays of several apps). schedule_group NULL: a relay without an app, which claims the
# rows of every group for its destinations (0011; beats always have a group).
beats = Table(
    "reliable_beat_beats",
    metadata,
    Column("owner", String(200), primary_key=True),
    Column("schedule_group", String(200), nullable=True),
    Column("config_hash", String(64), nullable=True),
    Column("started_at", UTCDateTime, nullable=False),
    Column("seen_at", UTCDateTime, nullable=False),
    Column("stopped_at", UTCDateTime, nullable=True),
    # entry name -> task name, for config entries whose task this beat's app does not register
    Column("unregistered", JSONType, nullable=False, default=dict),
    Column("role", String(16), nullable=False, server_default="beat"),  # beat | relay (0011)
    # a relay's handler destinations (list of str, 0011); NULL: a beat (its trigger
    # destination, which its sweep publishes)
    Column("destinations", JSONType, nullable=True),
    Index("ix_reliable_beat_beats_schedule_group_seen_at", "schedule_group", "seen_at"),
)

runs = Table(
    "reliable_beat_runs",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("idempotency_key", String(400), nullable=False, unique=True),
    Column("entry_name", String(200), nullable=True),
    Column("fire_at", UTCDateTime, nullable=True),
    # schedule | catch_up | manual | backfill | adhoc
    Column("trigger", String(16), nullable=False, server_default="schedule"),
    Column("task", String(255), nullable=False),
    Column("args", JSONType, nullable=False, default=list),
    Column("kwargs", JSONType, nullable=False, default=dict),
    Column("state", String(16), nullable=False),
    Column("fence_token", BigInteger, nullable=False, server_default="0"),
    Column("leased_by", String(200), nullable=True),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("result", JSONType, nullable=True),
    Column("error", Text, nullable=True),
    Column("reason", Text, nullable=True),  # why skipped / why dead
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("dispatched_at", UTCDateTime, nullable=True),
    Column("started_at", UTCDateTime, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    # how many times the run's trigger was re-sent (reliable_beat.redispatch backs off on it);
    # back to 0 when the run becomes ``retrying`` (then: the re-sends of this wait)
    Column("redispatches", Integer, nullable=False, server_default="0"),
    # a ``retrying`` run's next try is due (its retry's countdown end, or the sweep's last
    # re-send); the run sweep re-sends it redispatch_seconds after (0015_retrysweep)
    Column("retry_at", UTCDateTime, nullable=True),
    UniqueConstraint("entry_name", "fire_at"),
    Index("ix_reliable_beat_runs_state", "state"),
    Index("ix_reliable_beat_runs_entry_name_created_at", "entry_name", "created_at"),
    Index("ix_reliable_beat_runs_created_at", "created_at"),
)

attempts = Table(
    "reliable_beat_attempts",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column(
        "run_id",
        BigId,
        ForeignKey("reliable_beat_runs.id", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    Column("attempt", Integer, nullable=False),
    Column("fence_token", BigInteger, nullable=False),
    Column("worker", String(200), nullable=True),
    Column("task_id", String(64), nullable=True),
    Column("started_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime, nullable=True),
    Column("outcome", String(16), nullable=False),
    Column("error", Text, nullable=True),
    Column("retry_in_seconds", Float, nullable=True),
)

outbox = Table(
    "reliable_beat_outbox",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    # Stable message id / idempotency key, derived from the row's origin; the far end dedupes on it.
    Column("message_id", String(400), nullable=False, unique=True),
    Column("destination", String(200), nullable=False),
    Column("payload", JSONType, nullable=False),
    Column("headers", JSONType, nullable=False, default=dict),
    Column("ordering_key", String(200), nullable=True),
    Column("run_id", BigId, nullable=True),
    Column("state", String(16), nullable=False, server_default="pending"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("available_at", UTCDateTime, nullable=False),
    Column("claimed_by", String(200), nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    Column("sent_at", UTCDateTime, nullable=True),
    Column("last_error", Text, nullable=True),
    # the schedule group whose relays / beats publish the row (0010): a workflow's messages
    # carry its group; NULL (every other row, and rows from before 0010): any publisher
    Column("schedule_group", String(200), nullable=True),
    # the W3C traceparent of the span that wrote the row (0018_tracecontext): the relay's
    # delivery span joins that trace (reliable_beat.tracing); NULL: written untraced
    Column("traceparent", String(128), nullable=True),
    Index(
        "ix_reliable_beat_outbox_pending",
        "available_at",
        postgresql_where=text("state = 'pending'"),
        sqlite_where=text("state = 'pending'"),
    ),
    Index("ix_reliable_beat_outbox_ordering_key_id", "ordering_key", "id"),
    # (state, sent_at) also serves the relay's pending scan on MySQL/MariaDB, which have no
    # partial index: state = 'pending' is a ref of it, sent rows outside (test_mariadb.py).
    Index("ix_reliable_beat_outbox_state_sent_at", "state", "sent_at"),
)

dead_letters = Table(
    "reliable_beat_dead_letters",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("kind", String(16), nullable=False),  # run | outbox
    Column("run_id", BigId, nullable=True),
    Column("outbox_id", BigId, nullable=True),
    Column("key", String(400), nullable=False),  # idempotency key or outbox message id
    Column("entry_name", String(200), nullable=True),
    Column("task", String(255), nullable=True),
    Column("destination", String(200), nullable=True),
    # What is needed to replay it: {"task", "args", "kwargs"} or the outbox row.
    Column("payload", JSONType, nullable=False),
    # permanent | exhausted | retry_unsent | undeliverable | malformed (a row that cannot be
    # read or has the wrong shape; the payload keeps its original values)
    Column("reason", String(32), nullable=False),
    Column("error", Text, nullable=True),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("created_at", UTCDateTime, nullable=False),
    Column("requeued_at", UTCDateTime, nullable=True),
    Column("requeued_by", String(200), nullable=True),
    # A failure the application handled by design (a saga whose compensations all completed,
    # 0014_parked): kept and listed, but it pages no one (status --check, metrics).
    Column("handled_at", UTCDateTime, nullable=True),
    Column("handled_by", String(200), nullable=True),
    Index("ix_reliable_beat_dead_letters_created_at", "created_at"),
)

# ------------------------------------------------------------------ durable workflows ----
# Workflow states: pending -> running <-> waiting -> completed | failed | cancelled; blocked
# (a person acts: non-determinism, unknown workflow, history cap, swallowed suspension,
# a compensation dead-lettered).
# See reliable_beat.workflows and docs/workflows.md.
workflows = Table(
    "reliable_beat_workflows",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("workflow_id", String(400), nullable=False, unique=True),  # business id
    Column("name", String(255), nullable=False),  # registered workflow name (stable)
    Column("version", String(64), nullable=True),  # @workflow(version=) at start (0007)
    Column("run_no", Integer, nullable=False, server_default="1"),
    Column("state", String(16), nullable=False),
    Column("args", JSONType, nullable=False, default=list),
    Column("kwargs", JSONType, nullable=False, default=dict),
    Column("result", JSONType, nullable=True),
    Column("error", JSONType, nullable=True),  # {"type", "message", "traceback"}
    Column("block_reason", Text, nullable=True),
    Column("queue", String(200), nullable=True),  # where advance messages go
    Column("random_seed", BigInteger, nullable=False, server_default="0"),
    Column("fence_token", BigInteger, nullable=False, server_default="0"),
    Column("leased_by", String(200), nullable=True),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    Column("wake_seq", BigInteger, nullable=False, server_default="0"),
    Column("claimed_wake_seq", BigInteger, nullable=False, server_default="0"),
    Column("history_len", Integer, nullable=False, server_default="0"),
    Column("history_bytes", BigInteger, nullable=False, server_default="0"),
    Column("advances", Integer, nullable=False, server_default="0"),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime, nullable=True),
    # claims that took over an advance whose lease expired, since an advance last finished
    # (0017_wfrunaway): past reliable_beat_workflow_max_takeovers the workflow is parked
    Column("takeovers", Integer, nullable=False, server_default="0"),
    # what a person asked for (migration 0008_sagas): NULL, "cancel" (cooperative: the code
    # sees WorkflowCancelled, sagas unwind), "compensate" / "cancel_data" (run the recorded
    # compensations from data, without the code; end failed / cancelled)
    Column("cancel_requested", String(16), nullable=True),
    Index(
        "ix_reliable_beat_workflows_active",
        "updated_at",
        postgresql_where=text("state IN ('pending', 'running', 'waiting')"),
        sqlite_where=text("state IN ('pending', 'running', 'waiting')"),
    ),
    Index("ix_reliable_beat_workflows_name_state", "name", "state"),
    # a child's parent event (0007): the child's end completes it and wakes the parent
    Column("parent_pk", BigId, nullable=True),
    Column("parent_run_no", Integer, nullable=True),
    Column("parent_seq", Integer, nullable=True),
    # started by a beat entry's slot (0007): the overlap policy reads these
    Column("entry_name", String(200), nullable=True),
    Column("fire_at", UTCDateTime, nullable=True),
    # the schedule group of the app that started it (0010): its messages go only to that
    # group's broker; NULL (started without an app, or before 0010): any publisher
    Column("schedule_group", String(200), nullable=True),
    # the W3C traceparent of the workflow's start span (0018_tracecontext): every advance is a
    # span of that trace (reliable_beat.tracing); NULL: started untraced
    Column("traceparent", String(128), nullable=True),
    Index("ix_reliable_beat_workflows_finished_at", "finished_at"),  # retention (0007)
    Index("ix_reliable_beat_workflows_entry_name_state", "entry_name", "state"),
)

# The history: one row per durable call, keyed by its position (seq) in the run.
# kind: activity | step | transaction | timer | signal | now | wait_any | compensation | cancel
# state: scheduled | completed | failed; a compensation: registered -> scheduled (dispatched)
# -> completed | failed, or released (its saga block ended without an error)
workflow_events = Table(
    "reliable_beat_workflow_events",
    metadata,
    Column(
        "workflow_pk",
        BigId,
        ForeignKey("reliable_beat_workflows.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("run_no", Integer, primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("name", String(255), nullable=True),
    Column("args_digest", String(16), nullable=False),
    Column("args", JSONType, nullable=True),
    Column("state", String(12), nullable=False),
    Column("result", JSONType, nullable=True),
    Column("error", JSONType, nullable=True),
    Column("fire_at", UTCDateTime, nullable=True),  # timers and signal timeouts
    Column("run_key", String(400), nullable=True),  # reliable_beat_runs key of an activity
    Column("fence_token", BigInteger, nullable=False),  # the advance that wrote it
    Column("created_at", UTCDateTime, nullable=False),
    Column("completed_at", UTCDateTime, nullable=True),
    # the workflow sweep's re-sends of this activity / compensation / timer's wake, and the
    # last one's instant: the k-th re-send waits redispatch_seconds * 2**k (0012_wfsweep)
    Column("redispatches", Integer, nullable=False, server_default="0"),
    Column("redispatched_at", UTCDateTime, nullable=True),
)

# Signals: an inbox row per signal, written in the sender's transaction, consumed by one event;
# ``dedup_key`` (optional) is unique per workflow.
workflow_signals = Table(
    "reliable_beat_workflow_signals",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column(
        "workflow_pk",
        BigId,
        ForeignKey("reliable_beat_workflows.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("name", String(200), nullable=False),
    Column("payload", JSONType, nullable=True),
    Column("dedup_key", String(400), nullable=True),
    Column("consumed_run_no", Integer, nullable=True),
    Column("consumed_seq", Integer, nullable=True),
    Column("created_at", UTCDateTime, nullable=False),
    # the W3C traceparent of the `signal <name>` span that stored it (0019_signaltrace): the
    # advance's `receive signal <name>` span links to it. NULL: stored without tracing
    Column("traceparent", String(128), nullable=True),
    Index("ix_reliable_beat_workflow_signals_workflow_pk_name_id", "workflow_pk", "name", "id"),
    # a dedup key is the workflow's own: two workflows may use the same key (0016_signalkey;
    # before it, one key per store)
    UniqueConstraint("workflow_pk", "dedup_key"),
)

# What a person did through the web dashboard (0013_dashboard): who (the authenticated name),
# with which role (viewer | operator), what (action + target + detail), when, from where, and
# how it ended (outcome: ok | refused | failed). Never purged automatically.
operator_actions = Table(
    "reliable_beat_operator_actions",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("at", UTCDateTime, nullable=False),
    Column("actor", String(200), nullable=False),
    Column("role", String(16), nullable=False),
    # pause | resume | trigger | backfill | requeue | lease_clear
    Column("action", String(32), nullable=False),
    Column("target", String(400), nullable=False),  # entry name, run key, dead letter id
    Column("detail", JSONType, nullable=False, default=dict),
    Column("outcome", String(16), nullable=False),
    Column("error", Text, nullable=True),
    Column("remote", String(64), nullable=True),
    Index("ix_reliable_beat_operator_actions_at", "at"),
)

#: One row: the store's identity, a random id written by the migration that created it.
#: Triggers carry it (header ``reliable_beat_store``); a worker on another store refuses them.
store_identity = Table(
    "reliable_beat_store",
    metadata,
    Column("store_id", String(64), primary_key=True),
    Column("created_at", UTCDateTime, nullable=False),
)
