"""All ``reliable_beat_*`` settings, read once into one :class:`Settings` object.

Settings come from the Celery configuration (``app.conf.reliable_beat_database_url = ...``)
or any mapping. An unknown ``reliable_beat_*`` key is an error listing the valid ones, so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from reliable_beat.errors import ConfigurationError
from reliable_beat.policies import MisfirePolicy, OverlapPolicy, RetryPolicy

__all__ = ["DEFAULT_DATABASE_URL", "MAX_CLAIM_AHEAD_SECONDS", "PREFIX", "Settings"]

PREFIX = "reliable_beat_"
#: The embedded default store: a SQLite file in the working directory.
DEFAULT_DATABASE_URL = "sqlite:///reliable_beat.sqlite3"
#: Upper bound of ``reliable_beat_claim_ahead_seconds``.
MAX_CLAIM_AHEAD_SECONDS = 60.0


@dataclass(frozen=True)
class Settings:
    """Every setting, with its unit in its name. Celery key = ``reliable_beat_`` + field name.

    Attributes:
        database_url: SQLAlchemy URL of the store. Default: ``$RELIABLE_BEAT_DATABASE_URL``,
            else :data:`DEFAULT_DATABASE_URL`.
        run_migrations: upgrade a server database's schema on start (SQLite always is).
        batch_size: entries claimed per tick transaction.
        claim_ahead_seconds: a beat claims an entry whose next slot is at most this far in
            the future (only entries with overlap policy ``allow``), commits its run and
            trigger ahead of the slot, and publishes the trigger at the slot's instant.
            0 turns it off (claim only when due). At most 60.
        misfire_policy / misfire_grace_seconds / catch_up_limit / catch_up_window_seconds /
            overlap_policy: defaults for entries that do not set their own.
        lease_seconds: how long a worker's claim on a run lasts without renewal.
        retry_max_attempts / retry_base_seconds / retry_cap_seconds: task retry defaults.
        outbox_handlers: destination name -> dotted path of a handler callable.
        outbox_max_attempts / outbox_retry_base_seconds / outbox_retry_cap_seconds: relay retry.
        outbox_retention_seconds: sent outbox rows older than this are purged (7 days).
        outbox_batch_size: rows claimed per relay transaction.
        relay_poll_seconds: relay idle poll period when no NOTIFY arrives.
        backfill_limit: most slots one backfill creates unless forced.
        redispatch_seconds: a tracked run still ``dispatched`` (no worker claimed it) or
            ``running`` with a lease expired this long has its trigger sent again (its
            message was lost; see :mod:`reliable_beat.redispatch`).
        broker_consumer_timeout_seconds: the RabbitMQ broker's ``consumer_timeout`` (its
            default: 30 min). A delivery a worker holds unacknowledged longer (a retry's
            countdown, an ``acks_late`` task still running) makes RabbitMQ close the
            worker's channel and redeliver. Not readable over AMQP, so state it here when
            the broker's differs; beats and workers warn at start when
            ``retry_cap_seconds`` reaches it (:mod:`reliable_beat.celery.brokers`).
        metrics_port: serve Prometheus metrics on this port (None: off).
        owner_id: name of this process in leases and logs (default: host:pid).
        webhook_destinations: ``{name: {"base_url", "headers"?, "timeout_seconds"?,
            "max_concurrency"?, "methods"?, "block_private_networks"?}}``: where ``webhook``
            rows may go (see :func:`reliable_beat.handlers.parse_webhook_destinations`);
            header values may be ``{"env": "NAME"}``.
        webhook_allowed_hosts: host names webhook ``base_url`` s (when not empty) and
            opted-in row URLs must use.
        webhook_allow_row_urls: deliver legacy rows that carry a full ``url`` (only to
            ``webhook_allowed_hosts``); default off: such rows are dead-lettered with the fix.
        webhook_block_private_networks: default of each destination's
            ``block_private_networks`` (refuse private, loopback, link-local addresses).
        webhook_max_timeout_seconds: the largest ``timeout_seconds`` a destination may set.
        webhook_max_response_bytes: most response-body bytes read (then dropped) per request.
        webhook_batch_seconds: no webhook request of a relay batch starts later than this
            after the batch began; the rest are handed back uncharged (keep it below the
            relay's claim lease, 60 s by default).
        smtp: the SMTP server of the ``smtp`` destination: ``{"host", "port", "starttls"
            (default True), "ssl", "username", "password", "timeout_seconds", "from",
            "allowed_from", "ca_file"}`` (see :class:`reliable_beat.handlers.SmtpConfig`).
        max_payload_bytes: the largest JSON size of an entry's args + kwargs + options and
            of an outbox row's payload + headers (bytes, checked where they enter).
        outbox_batch_bytes: a relay claim stops adding rows once their payloads reach this
            many bytes (at least one row is always claimed).
        key_reuse: what an IdempotentTask does when a call reuses an idempotency key with
            other arguments than the key's run: ``warn`` (default: log a WARNING, use the
            stored run) or ``refuse`` (raise ``IdempotencyKeyError``; nothing runs).
        schedule_group: the schedule group of this app's ``beat_schedule`` entries (default:
            the Celery app's main name). A beat's start-up sync only touches its own group's
            config entries (see :mod:`reliable_beat.groups`).
    """

    database_url: str = field(
        default_factory=lambda: os.environ.get("RELIABLE_BEAT_DATABASE_URL", DEFAULT_DATABASE_URL)
    )
    run_migrations: bool = False
    batch_size: int = 500
    claim_ahead_seconds: float = 0.5
    misfire_policy: str = MisfirePolicy.FIRE_ONCE.value
    misfire_grace_seconds: float = 60.0
    catch_up_limit: int = 100
    catch_up_window_seconds: float | None = None
    overlap_policy: str = OverlapPolicy.ALLOW.value
    lease_seconds: float = 60.0
    retry_max_attempts: int = RetryPolicy.max_attempts
    retry_base_seconds: float = RetryPolicy.base_seconds
    retry_cap_seconds: float = RetryPolicy.cap_seconds
    outbox_handlers: Mapping[str, str] = field(default_factory=dict)
    outbox_max_attempts: int = 10
    outbox_retry_base_seconds: float = 1.0
    outbox_retry_cap_seconds: float = 300.0
    outbox_retention_seconds: float = 7 * 24 * 3600.0
    outbox_batch_size: int = 200
    relay_poll_seconds: float = 1.0
    backfill_limit: int = 1000
    redispatch_seconds: float = 120.0
    broker_consumer_timeout_seconds: float = 1800.0
    metrics_port: int | None = None
    owner_id: str | None = None
    # repr=False: these may hold secrets given inline (auth headers, the SMTP password)
    webhook_destinations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict,
                                                                  repr=False)
    webhook_allowed_hosts: tuple[str, ...] = ()
    webhook_allow_row_urls: bool = False
    webhook_block_private_networks: bool = False
    webhook_max_timeout_seconds: float = 60.0
    webhook_max_response_bytes: int = 65536
    webhook_batch_seconds: float = 30.0
    smtp: Mapping[str, Any] = field(default_factory=dict, repr=False)
    max_payload_bytes: int = 1024 * 1024
    outbox_batch_bytes: int = 16 * 1024 * 1024
    key_reuse: str = "warn"
    schedule_group: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.misfire_policy not in {p.value for p in MisfirePolicy}:
            problems.append(
                f"reliable_beat_misfire_policy={self.misfire_policy!r}: expected one of "
                + ", ".join(p.value for p in MisfirePolicy)
            )
        if self.overlap_policy not in {p.value for p in OverlapPolicy}:
            problems.append(
                f"reliable_beat_overlap_policy={self.overlap_policy!r}: expected one of "
                + ", ".join(p.value for p in OverlapPolicy)
            )
        if self.key_reuse not in ("warn", "refuse"):
            problems.append(f"{PREFIX}key_reuse={self.key_reuse!r}: expected 'warn' or 'refuse'")
        for f in fields(self):
            value = getattr(self, f.name)
            key = PREFIX + f.name
            if value is None and "None" in str(f.type):
                continue
            if f.type in ("int", "int | None"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    problems.append(f"{key}={value!r}: expected a whole number >= 0")
            elif f.name.endswith("_seconds"):
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                    problems.append(f"{key}={value!r}: expected seconds as a number >= 0")
            elif f.type == "bool" and not isinstance(value, bool):
                problems.append(f"{key}={value!r}: expected True or False")
            elif f.type in ("str", "str | None") and not isinstance(value, str):
                problems.append(f"{key}={value!r}: expected a string")
        if not problems:
            for name in ("batch_size", "outbox_batch_size", "retry_max_attempts",
                         "lease_seconds", "retry_base_seconds", "outbox_retry_base_seconds"):
                if getattr(self, name) <= 0:
                    problems.append(f"{PREFIX}{name} must be > 0")
            if self.claim_ahead_seconds > MAX_CLAIM_AHEAD_SECONDS:
                problems.append(
                    f"{PREFIX}claim_ahead_seconds={self.claim_ahead_seconds!r}: at most "
                    f"{MAX_CLAIM_AHEAD_SECONDS:.0f} (a beat holds claimed triggers in memory "
                    "that long, and a graceful stop waits for them)"
                )
        if not problems:
            problems.extend(self._outbound_problems())
        if problems:
            raise ConfigurationError("; ".join(problems))

    def _outbound_problems(self) -> list[str]:
        """Shape checks of the webhook / SMTP / size settings (secrets are read by the relay)."""
        from reliable_beat.handlers import SmtpConfig, parse_webhook_destinations

        problems = []
        hosts = self.webhook_allowed_hosts
        if isinstance(hosts, (list, str)):  # a list from a config file; a str is one host
            hosts = (hosts,) if isinstance(hosts, str) else tuple(hosts)
            object.__setattr__(self, "webhook_allowed_hosts", hosts)
        if not all(isinstance(h, str) and h for h in hosts):
            problems.append(f"{PREFIX}webhook_allowed_hosts={hosts!r}: expected host names")
        elif self.webhook_allow_row_urls and not hosts:
            problems.append(f"{PREFIX}webhook_allow_row_urls needs {PREFIX}webhook_allowed_"
                            "hosts: the hosts legacy row URLs may reach")
        for name in ("webhook_max_response_bytes", "max_payload_bytes", "outbox_batch_bytes",
                     "webhook_max_timeout_seconds", "webhook_batch_seconds"):
            if getattr(self, name) <= 0:
                problems.append(f"{PREFIX}{name} must be > 0")
        if problems:
            return problems
        try:
            parse_webhook_destinations(
                self.webhook_destinations, max_timeout_seconds=self.webhook_max_timeout_seconds,
                block_private_networks=self.webhook_block_private_networks,
                allowed_hosts=tuple(h.lower() for h in hosts))
        except ConfigurationError as exc:
            problems.append(str(exc))
        if not isinstance(self.smtp, Mapping):
            problems.append(f"{PREFIX}smtp: expected a dict")
        else:
            try:
                SmtpConfig.from_setting(self.smtp, environ=None)
            except ConfigurationError as exc:
                problems.append(str(exc))
        return problems

    @classmethod
    def valid_keys(cls) -> list[str]:
        """Every accepted configuration key, prefixed."""
        return [PREFIX + f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, conf: Mapping[str, Any]) -> Settings:
        """Read the ``reliable_beat_*`` keys of ``conf`` (other keys are ignored).

        Raises:
            ConfigurationError: an unknown ``reliable_beat_*`` key (the message lists the
                valid ones) or an invalid value.
        """
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        unknown = []
        for key in list(conf.keys()):
            if not isinstance(key, str) or not key.lower().startswith(PREFIX):
                continue
            name = key.lower()[len(PREFIX) :]
            if name not in known:
                unknown.append(key)
                continue
            value = conf[key]
            if value is not None or name in ("catch_up_window_seconds", "metrics_port"):
                values[name] = value
        if unknown:
            raise ConfigurationError(
                f"unknown setting(s) {', '.join(sorted(unknown))}; valid reliable_beat settings: "
                + ", ".join(cls.valid_keys())
            )
        return cls(**values)

    @classmethod
    def from_celery(cls, app_or_conf: Any) -> Settings:
        """Read settings from a Celery app or its ``app.conf``."""
        conf = getattr(app_or_conf, "conf", app_or_conf)
        try:
            items = dict(conf.items())
        except AttributeError:
            items = dict(conf)
        return cls.from_mapping(items)

    @property
    def retry_policy(self) -> RetryPolicy:
        """The task retry defaults as a :class:`RetryPolicy`."""
        return RetryPolicy(
            max_attempts=self.retry_max_attempts,
            base_seconds=self.retry_base_seconds,
            cap_seconds=self.retry_cap_seconds,
        )

    @property
    def owner(self) -> str:
        """This process's owner id: ``owner_id`` or ``hostname:pid``."""
        if self.owner_id:
            return self.owner_id
        import socket

        return f"{socket.gethostname()}:{os.getpid()}"
