"""Unmanaged Django models over the reliable_beat tables (the admin reads them).

The tables belong to reliable_beat's Alembic migrations (run by this app's Django migration,
see ``migrations/0001_initial.py``), so every model is ``managed = False``: Django never
creates, alters or drops them. Writes go through reliable_beat's API (pause, resume,
trigger, backfill, requeue), never through these models, so validation, misfire rules and
fencing are the same as the CLI's.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from django.db import models

__all__ = ["Attempt", "DeadLetter", "Entry", "MalformedTimestamp", "OutboxMessage", "Process",
           "Run", "StoreDateTimeField", "Workflow", "parse_stored_timestamp"]


class MalformedTimestamp(str):
    """A stored timestamp that is not an instant Python can hold (PostgreSQL ``'infinity'``
    / ``'-infinity'``, a year after 9999 or BC, SQLite text that is no date), read by
    :class:`StoreDateTimeField` as the text ``"malformed: <value as stored>"``, so a page
    shows it instead of failing. ``stored`` is the value as the database returned it."""

    stored: str

    def __new__(cls, stored: str) -> MalformedTimestamp:
        made = super().__new__(cls, f"malformed: {stored}")
        made.stored = stored
        return made


def parse_stored_timestamp(value: Any) -> datetime | MalformedTimestamp | None:
    """A stored timestamp (text or ``datetime``) as a UTC-aware ``datetime``, None for NULL,
    or a :class:`MalformedTimestamp` holding the text when it is not an instant. A naive
    value is UTC (the store writes UTC), whatever Django's ``TIME_ZONE``."""
    if value is None:
        return None
    if isinstance(value, datetime):
        parsed = value
    else:
        text = value.decode() if isinstance(value, bytes) else str(value)
        try:
            parsed = datetime.fromisoformat(text.strip())
        except ValueError:
            return MalformedTimestamp(text)
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        return parsed.replace(tzinfo=timezone.utc)
    try:
        return parsed.astimezone(timezone.utc)
    except OverflowError:
        return MalformedTimestamp(str(value))


class StoreDateTimeField(models.DateTimeField):  # type: ignore[type-arg]
    """A reliable_beat ``UTCDateTime`` column, read so that no stored value fails a page.

    The column is selected as text (PostgreSQL: ``to_json(col) #>> '{}'``, ISO 8601 whatever
    the session's ``DateStyle``; SQLite: ``CAST(col AS TEXT)``; MySQL/MariaDB:
    ``CAST(col AS CHAR)``) and parsed by :func:`parse_stored_timestamp`: a valid value reads
    as a UTC-aware ``datetime``; ``'infinity'``, ``'-infinity'`` or garbage text reads as a
    :class:`MalformedTimestamp`. Only these unmanaged models use it: Django's connection and
    the project's own models load timestamps exactly as before (no connection-wide loader).
    Filters and ordering compare the column itself.
    """

    def get_internal_type(self) -> str:
        # not "DateTimeField": the backends' datetime converters (which raise on a value
        # they cannot parse) must not run on the text that select_format selects
        return "ReliableBeatStoreDateTimeField"

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.DateTimeField", args, kwargs  # migrations unchanged

    def select_format(self, compiler: Any, sql: str, params: Any) -> Any:
        vendor = compiler.connection.vendor
        if vendor == "postgresql":
            return f"(to_json({sql}) #>> '{{}}')", params
        if vendor == "mysql":
            return f"CAST({sql} AS CHAR)", params
        return f"CAST({sql} AS TEXT)", params

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return parse_stored_timestamp(value)


class Entry(models.Model):
    """``reliable_beat_entries``: one row per named recurring definition."""

    name = models.CharField(max_length=200, unique=True)
    task = models.CharField(max_length=255)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    options = models.JSONField(default=dict)
    schedule_kind = models.CharField(max_length=16)
    schedule = models.JSONField()
    timezone = models.CharField(max_length=64)
    misfire_policy = models.CharField(max_length=16)
    misfire_grace_seconds = models.FloatField()
    catch_up_limit = models.IntegerField()
    catch_up_window_seconds = models.FloatField(null=True)
    overlap_policy = models.CharField(max_length=16)
    enabled = models.BooleanField()
    paused = models.BooleanField()
    paused_at = StoreDateTimeField(null=True)
    origin = models.CharField(max_length=16)
    #: the schedule group whose beats fire it (NULL: runtime without a group, or pre-groups)
    schedule_group = models.CharField(max_length=200, null=True)
    disabled_at = StoreDateTimeField(null=True)
    config_hash = models.CharField(max_length=64, null=True)
    start_at = StoreDateTimeField(null=True)
    end_at = StoreDateTimeField(null=True)
    next_fire_at = StoreDateTimeField(null=True)
    last_fire_at = StoreDateTimeField(null=True)
    created_at = StoreDateTimeField()
    updated_at = StoreDateTimeField()
    #: why the beat set the row aside (a malformed stored value), or None; see reliable_beat.rows
    quarantine_reason = models.TextField(null=True)
    quarantined_at = StoreDateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "reliable_beat_entries"
        verbose_name = "entry"
        verbose_name_plural = "entries"
        ordering = ["name"]
        default_permissions = ("view",)
        permissions = [
            ("pause_entry", "Can pause and resume entries"),
            ("trigger_entry", "Can trigger an entry now"),
            ("backfill_entry", "Can backfill a window of an entry"),
            ("edit_entry", "Can add and change runtime entries"),
        ]

    def __str__(self) -> str:
        return self.name


class Run(models.Model):
    """``reliable_beat_runs``: one row per (entry, slot) and per ad-hoc idempotency key."""

    idempotency_key = models.CharField(max_length=400, unique=True)
    entry_name = models.CharField(max_length=200, null=True)
    fire_at = StoreDateTimeField(null=True)
    trigger = models.CharField(max_length=16)
    task = models.CharField(max_length=255)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    state = models.CharField(max_length=16)
    fence_token = models.BigIntegerField()
    leased_by = models.CharField(max_length=200, null=True)
    lease_expires_at = StoreDateTimeField(null=True)
    attempts = models.IntegerField()
    result = models.JSONField(null=True)
    error = models.TextField(null=True)
    reason = models.TextField(null=True)
    created_at = StoreDateTimeField()
    updated_at = StoreDateTimeField()
    dispatched_at = StoreDateTimeField(null=True)
    started_at = StoreDateTimeField(null=True)
    finished_at = StoreDateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "reliable_beat_runs"
        ordering = ["-created_at", "-id"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return self.idempotency_key


class Attempt(models.Model):
    """``reliable_beat_attempts``: one row per try of a run."""

    run = models.ForeignKey(Run, on_delete=models.DO_NOTHING, db_constraint=False,
                            related_name="attempt_rows")
    attempt = models.IntegerField()
    fence_token = models.BigIntegerField()
    worker = models.CharField(max_length=200, null=True)
    task_id = models.CharField(max_length=64, null=True)
    started_at = StoreDateTimeField()
    finished_at = StoreDateTimeField(null=True)
    outcome = models.CharField(max_length=16)
    error = models.TextField(null=True)
    retry_in_seconds = models.FloatField(null=True)

    class Meta:
        managed = False
        db_table = "reliable_beat_attempts"
        ordering = ["id"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"attempt {self.attempt} (fence {self.fence_token}): {self.outcome}"


class OutboxMessage(models.Model):
    """``reliable_beat_outbox``: messages written with the effect, delivered by a relay."""

    message_id = models.CharField(max_length=400, unique=True)
    destination = models.CharField(max_length=200)
    payload = models.JSONField()
    headers = models.JSONField(default=dict)
    ordering_key = models.CharField(max_length=200, null=True)
    run_id = models.BigIntegerField(null=True)
    state = models.CharField(max_length=16)
    attempts = models.IntegerField()
    available_at = StoreDateTimeField()
    claimed_by = models.CharField(max_length=200, null=True)
    created_at = StoreDateTimeField()
    sent_at = StoreDateTimeField(null=True)
    last_error = models.TextField(null=True)
    #: only the relays and beats of this schedule group publish the row (a workflow's
    #: messages, Alembic 0010); NULL: any relay with the destination's handler
    schedule_group = models.CharField(max_length=200, null=True)

    class Meta:
        managed = False
        db_table = "reliable_beat_outbox"
        verbose_name = "outbox message"
        ordering = ["-id"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return self.message_id


class DeadLetter(models.Model):
    """``reliable_beat_dead_letters``: work that exhausted attempts or failed permanently."""

    kind = models.CharField(max_length=16)
    run_id = models.BigIntegerField(null=True)
    outbox_id = models.BigIntegerField(null=True)
    key = models.CharField(max_length=400)
    entry_name = models.CharField(max_length=200, null=True)
    task = models.CharField(max_length=255, null=True)
    destination = models.CharField(max_length=200, null=True)
    payload = models.JSONField()
    reason = models.CharField(max_length=32)
    error = models.TextField(null=True)
    attempts = models.IntegerField()
    created_at = StoreDateTimeField()
    requeued_at = StoreDateTimeField(null=True)
    requeued_by = models.CharField(max_length=200, null=True)

    class Meta:
        managed = False
        db_table = "reliable_beat_dead_letters"
        verbose_name = "dead letter"
        ordering = ["-created_at", "-id"]
        default_permissions = ("view",)
        permissions = [("requeue_deadletter", "Can requeue a dead letter")]

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"


class Workflow(models.Model):
    """``reliable_beat_workflows``: one row per durable workflow (its current run)."""

    workflow_id = models.CharField(max_length=400, unique=True)
    name = models.CharField(max_length=255)
    version = models.CharField(max_length=64, null=True)
    run_no = models.IntegerField()
    state = models.CharField(max_length=16)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    result = models.JSONField(null=True)
    error = models.JSONField(null=True)
    block_reason = models.TextField(null=True)
    queue = models.CharField(max_length=200, null=True)
    random_seed = models.BigIntegerField()
    fence_token = models.BigIntegerField()
    leased_by = models.CharField(max_length=200, null=True)
    lease_expires_at = StoreDateTimeField(null=True)
    wake_seq = models.BigIntegerField()
    claimed_wake_seq = models.BigIntegerField()
    history_len = models.IntegerField()
    history_bytes = models.BigIntegerField()
    advances = models.IntegerField()
    created_at = StoreDateTimeField()
    updated_at = StoreDateTimeField()
    finished_at = StoreDateTimeField(null=True)
    cancel_requested = models.CharField(max_length=16, null=True)
    parent_pk = models.BigIntegerField(null=True)
    parent_run_no = models.IntegerField(null=True)
    parent_seq = models.IntegerField(null=True)
    entry_name = models.CharField(max_length=200, null=True)
    fire_at = StoreDateTimeField(null=True)
    #: the schedule group of the app that started it (Alembic 0010): only that group's
    #: relays and beats publish its messages
    schedule_group = models.CharField(max_length=200, null=True)

    class Meta:
        managed = False
        db_table = "reliable_beat_workflows"
        ordering = ["-updated_at", "-id"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return self.workflow_id


class Process(models.Model):
    """``reliable_beat_beats``: one heartbeat row per beat or relay process (``role``;
    relays since Alembic 0011_relaywatch). ``status`` counts one seen within 60 s as live."""

    #: a beat's owner id; a relay's ``relay:<group or *>:<owner id>``
    owner = models.CharField(max_length=200, primary_key=True)
    role = models.CharField(max_length=16)
    #: NULL: a relay without an app (claims the rows of every group)
    schedule_group = models.CharField(max_length=200, null=True)
    config_hash = models.CharField(max_length=64, null=True)
    started_at = StoreDateTimeField()
    seen_at = StoreDateTimeField()
    stopped_at = StoreDateTimeField(null=True)
    unregistered = models.JSONField(default=dict)
    #: a relay's handler destinations, a beat's publisher's destination (NULL: a beat row
    #: written before beats recorded it)
    destinations = models.JSONField(null=True)

    class Meta:
        managed = False
        db_table = "reliable_beat_beats"
        verbose_name = "beat or relay"
        verbose_name_plural = "beats and relays"
        ordering = ["schedule_group", "role", "owner"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.role} {self.owner}"
