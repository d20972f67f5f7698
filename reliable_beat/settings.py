"""All ``reliable_beat_*`` settings, read once into one :class:`Settings` object.

Settings come from the Celery configuration (``app.conf.reliable_beat_database_url = ...``)
or any mapping. An unknown ``reliable_beat_*`` key is an error listing the valid ones, so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import difflib
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from reliable_beat.destinations import SmtpConfig, parse_webhook_destinations
from reliable_beat.errors import ConfigurationError
from reliable_beat.policies import (
    MAX_CATCH_UP_LIMIT,
    MisfirePolicy,
    OverlapPolicy,
    RetryPolicy,
    catch_up_limit_problem,
)
from reliable_beat.redaction import MASK, is_sensitive_name, redact_url, redact_value
from reliable_beat.schedules import validate_timezone
from reliable_beat.values import DEFAULT_MAX_PAYLOAD_BYTES

__all__ = [
    "DEFAULT_DATABASE_URL",
    "MAX_CLAIM_AHEAD_SECONDS",
    "PREFIX",
    "DatabaseUrlSource",
    "Settings",
    "celery_timezone",
    "database_url_from_sources",
    "host_timezone",
    "register_database_url_source",
]

PREFIX = "reliable_beat_"
#: The embedded default store: a SQLite file in the working directory.
DEFAULT_DATABASE_URL = "sqlite:///reliable_beat.sqlite3"
#: Upper bound of ``reliable_beat_claim_ahead_seconds``.
MAX_CLAIM_AHEAD_SECONDS = 60.0


#: A store-URL source: returns ``(url, origin)`` (origin: where the URL came from, for the
#: banners, e.g. ``"Django DATABASES['default']"``) or None when it has nothing to say.
DatabaseUrlSource = Callable[[], "tuple[str, str] | None"]
_sources: dict[str, DatabaseUrlSource] = {}
_sources_lock = threading.Lock()
#: The environment variable read when no ``reliable_beat_database_url`` setting is given.
DATABASE_URL_ENV = "RELIABLE_BEAT_DATABASE_URL"


def register_database_url_source(name: str, source: DatabaseUrlSource) -> None:
    """Register a framework's store-URL source (a hook: the core imports no framework).

    When no ``reliable_beat_database_url`` setting (in any of its forms) is given and
    ``$RELIABLE_BEAT_DATABASE_URL`` is not set, the store URL is the first answer of the
    registered sources (in registration order), before :data:`DEFAULT_DATABASE_URL`. The
    Django app registers one in its ``AppConfig.ready()``: the store is then the Django
    database (:func:`reliable_beat.contrib.django.conf.django_store_url`). Registering the
    same ``name`` again replaces the source. Safe from several threads.

    Args:
        name: a stable name of the source (e.g. ``"django"``).
        source: ``() -> (url, origin) | None``; it may raise ``ConfigurationError`` (e.g.
            an unsupported Django database ENGINE): that stops the process with the message.
    """
    with _sources_lock:
        _sources[name] = source


def database_url_from_sources() -> tuple[str, str] | None:
    """The first ``(url, origin)`` of the registered sources, or None.

    Raises:
        ConfigurationError: a source could not derive a URL (its message names the fix).
    """
    with _sources_lock:
        sources = list(_sources.values())
    for source in sources:
        found = source()
        if found is not None:
            return found
    return None


def _default_database_url() -> str:
    """``$RELIABLE_BEAT_DATABASE_URL``, else a registered source's URL, else the default."""
    env = os.environ.get(DATABASE_URL_ENV)
    if env:
        return env
    found = database_url_from_sources()
    return found[0] if found is not None else DEFAULT_DATABASE_URL


#: Settings whose None is a value (off / keep forever), not "use the default".
_NULLABLE = ("catch_up_window_seconds", "metrics_port", "outbox_retention_seconds",
             "runs_retention_seconds", "attempts_retention_seconds",
             "workflow_retention_seconds")


@dataclass(frozen=True, repr=False)
class Settings:
    """Every setting, with its unit in its name. Celery key = ``reliable_beat_`` + field name.

    Attributes:
        database_url: SQLAlchemy URL of the store. Default: ``$RELIABLE_BEAT_DATABASE_URL``,
            else a registered source's (:func:`register_database_url_source`: under Django,
            the Django database), else :data:`DEFAULT_DATABASE_URL`.
            :attr:`database_url_origin` says which.
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
        outbox_retention_seconds: sent outbox rows older than this are purged (7 days;
            None: never).
        runs_retention_seconds: finished runs (``succeeded``, ``skipped``, a plain task's
            ``dispatched``) not updated for this long are purged with their attempts (30
            days; None: never; at least 3600). Their idempotency keys go with them.
        attempts_retention_seconds: attempts of finished, not dead, runs older than this are
            purged (7 days; None: never).
        workflow_retention_seconds: ended workflows (``completed``, ``failed``,
            ``cancelled``) finished this long ago are purged with their events and signals,
            and continued runs' histories older than this (30 days; None: never). Never
            pending, running, waiting or blocked workflows.
        purge_batch_size: rows deleted per retention transaction.
        purge_interval_seconds: a beat or relay starts a retention pass this often; a pass
            runs until caught up (0: this process does not purge; see
            :mod:`reliable_beat.retention`). Dead letters are never purged automatically.
        outbox_batch_size: rows claimed per relay transaction.
        relay_poll_seconds: relay idle poll period when no NOTIFY arrives.
        backfill_limit: most slots one backfill creates unless forced.
        redispatch_seconds: a tracked run still ``dispatched`` (no worker claimed it) or
            ``running`` with a lease expired this long has its trigger sent again (its
            message was lost; see :mod:`reliable_beat.redispatch`).
        redispatch_backlog_check: before re-sending, ask the broker how many messages wait
            ready in the runs' queues (where the adapter can): a queue holding at least as
            many as would be re-sent, all younger than the backoff cap, is a backlog, not a
            loss, and is not re-sent (:func:`reliable_beat.redispatch.backlogged`). False:
            never ask.
        broker_consumer_timeout_seconds: the RabbitMQ broker's ``consumer_timeout`` (its
            default: 30 min). A delivery a worker holds unacknowledged longer (a retry's
            countdown, an ``acks_late`` task still running) makes RabbitMQ close the
            worker's channel and redeliver. Not readable over AMQP, so state it here when
            the broker's differs; beats and workers warn at start when
            ``retry_cap_seconds`` reaches it (:mod:`reliable_beat.celery.brokers`).
        publish_timeout_seconds: the longest a beat's or relay's publish waits on a broker
            that accepted the connection but does not answer (a hung, paused or overloaded
            broker; seconds, > 0, default 10). Applied to the publishing process's Redis
            broker connection as kombu's ``socket_timeout`` transport option when
            ``broker_transport_options`` leaves it unset (a value set there wins). A publish
            that times out counts as "broker unavailable": its rows stay pending in the
            outbox and are re-sent under the same task id (see :mod:`reliable_beat.celery.
            publishing`).
        metrics_port: serve Prometheus metrics on this port (None: off).
        metrics_host: the address the metrics server binds (default ``127.0.0.1``: loopback
            only; ``0.0.0.0`` exposes it on every interface).
        owner_id: name of this process in leases and logs (default: host:pid).
        webhook_destinations: ``{name: {"base_url", "headers"?, "timeout_seconds"?,
            "max_concurrency"?, "methods"?, "block_private_networks"?}}``: where ``webhook``
            rows may go (see :func:`reliable_beat.destinations.parse_webhook_destinations`);
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
            "allowed_from", "ca_file"}`` (see :class:`reliable_beat.destinations.SmtpConfig`).
        max_payload_bytes: the largest JSON size of an entry's args + kwargs + options and
            of an outbox row's payload + headers (bytes, checked where they enter). The
            default is :data:`reliable_beat.outbox.DEFAULT_MAX_PAYLOAD_BYTES`, the fixed limit
            of workflow values (arguments, signal payloads, activity messages).
        outbox_batch_bytes: a relay claim stops adding rows once their payloads reach this
            many bytes (at least one row is always claimed).
        key_reuse: what an IdempotentTask does when a call reuses an idempotency key with
            other arguments than the key's run: ``warn`` (default: log a WARNING, use the
            stored run) or ``refuse`` (raise ``IdempotencyKeyError``; nothing runs).
        schedule_group: the schedule group of this app's ``beat_schedule`` entries (default:
            the Celery app's main name). A beat's start-up sync only touches its own group's
            config entries (see :mod:`reliable_beat.groups`).
        dashboard_operator_token / dashboard_viewer_token: the web dashboard's tokens
            (``reliable-beat dashboard``, :mod:`reliable_beat.web.auth`): operators may act,
            viewers only look; ``$RELIABLE_BEAT_DASHBOARD_OPERATOR_TOKEN`` /
            ``$RELIABLE_BEAT_DASHBOARD_VIEWER_TOKEN`` when unset. Required to serve it off
            loopback.
        workflow_code_timeout_seconds: the longest a workflow function may run between two
            durable calls (its own code: not a step's or a transaction's body, which run
            inside a durable call), in seconds, > 0 (default 30). Past it a watchdog thread
            interrupts the advance and the workflow is parked ``blocked`` naming the
            position (see :mod:`reliable_beat.workflows.runaway`). Keep it below
            ``lease_seconds``.
        workflow_max_takeovers: how many times in a row an advance whose lease expired
            (it never returned: code stuck outside Python, a step that hangs, a worker that
            dies each time) may be taken over by another worker; the next expiry parks the
            workflow ``blocked`` instead of re-sending it (a whole number >= 1, default 3).
        workflow_pending_alarm_seconds: a workflow ``pending`` (started, or continued as
            new, and not yet claimed by any advance) this long is named by ``status`` and
            counted by the metrics: no worker consumes its queue, or all are busy (> 0,
            default 300).
    """

    database_url: str = field(default_factory=_default_database_url)
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
    outbox_retention_seconds: float | None = 7 * 24 * 3600.0
    runs_retention_seconds: float | None = 30 * 24 * 3600.0
    attempts_retention_seconds: float | None = 7 * 24 * 3600.0
    workflow_retention_seconds: float | None = 30 * 24 * 3600.0
    purge_batch_size: int = 5000
    purge_interval_seconds: float = 60.0
    outbox_batch_size: int = 200
    relay_poll_seconds: float = 1.0
    backfill_limit: int = 1000
    redispatch_seconds: float = 120.0
    redispatch_backlog_check: bool = True
    broker_consumer_timeout_seconds: float = 1800.0
    publish_timeout_seconds: float = 10.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
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
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    outbox_batch_bytes: int = 16 * 1024 * 1024
    key_reuse: str = "warn"
    schedule_group: str | None = None
    # the web dashboard's tokens (reliable_beat.web.auth); repr=False: secrets
    dashboard_operator_token: str | None = field(default=None, repr=False)
    dashboard_viewer_token: str | None = field(default=None, repr=False)
    workflow_code_timeout_seconds: float = 30.0
    workflow_max_takeovers: int = 3
    workflow_pending_alarm_seconds: float = 300.0

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
        if (isinstance(self.catch_up_limit, int) and not isinstance(self.catch_up_limit, bool)
                and self.catch_up_limit > MAX_CATCH_UP_LIMIT):
            problems.append(f"{PREFIX}{catch_up_limit_problem(self.catch_up_limit)}")
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
            if self.runs_retention_seconds is not None and self.runs_retention_seconds < 3600:
                problems.append(
                    f"{PREFIX}runs_retention_seconds={self.runs_retention_seconds!r}: at least "
                    "3600 (a purged run's idempotency key no longer stops a late duplicate "
                    "delivery); None keeps runs forever"
                )
            for name in ("batch_size", "outbox_batch_size", "retry_max_attempts",
                         "purge_batch_size", "lease_seconds", "retry_base_seconds",
                         "outbox_retry_base_seconds", "publish_timeout_seconds",
                         "workflow_code_timeout_seconds", "workflow_max_takeovers",
                         "workflow_pending_alarm_seconds"):
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

    def __repr__(self) -> str:
        """Every field, with the database URL and any secret-named value redacted (error
        reporters capture locals; a repr must never carry a password)."""
        shown = []
        for f in fields(self):
            if not f.repr:  # e.g. webhook destinations, SMTP: may hold inline secrets
                continue
            value = getattr(self, f.name)
            if f.name.endswith("_url") and isinstance(value, str):
                value = redact_url(value)
            elif is_sensitive_name(f.name) and value not in (None, ""):
                value = MASK
            else:
                value = redact_value(value)
            shown.append(f"{f.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    def _outbound_problems(self) -> list[str]:
        """Shape checks of the webhook / SMTP / size settings (secrets are read by the relay)."""
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
    def from_mapping(cls, conf: Mapping[str, Any], *, namespace: str | None = None) -> Settings:
        """Read the reliable_beat keys of ``conf`` (other keys are ignored).

        A setting ``reliable_beat_<name>`` is accepted in these forms (the name part in any
        case, so ``RELIABLE_BEAT_LEASE_SECONDS`` of a settings module counts):

        * ``reliable_beat_<name>``;
        * ``<namespace>_reliable_beat_<name>`` when ``namespace`` is given, as Celery reads a
          configuration loaded with ``config_from_object(obj, namespace="CELERY")``
          (``CELERY_RELIABLE_BEAT_DATABASE_URL``).

        The namespaced form wins over the plain one, as in Celery; the two forms with
        different values in one mapping is an error (one of them would be ignored).
        :meth:`from_celery` takes Celery's own answer for the forms Celery resolves.

        Args:
            conf: any mapping of setting name -> value.
            namespace: the Celery app's configuration namespace (``app.namespace``, e.g.
                ``"CELERY"``), or None.

        Raises:
            ConfigurationError: an unknown reliable_beat key in any form (the message names it
                and lists the valid ones), a ``<X>_RELIABLE_BEAT_*`` key whose ``X`` is not the
                namespace (Celery would ignore it), conflicting forms, or an invalid value.
        """
        return cls._from_maps([conf], namespace=namespace)

    @classmethod
    def _from_maps(cls, maps: list[Any], *, namespace: str | None,
                   celery_conf: Any = None,
                   database_url: tuple[str, str] | None = None) -> Settings:
        known = {f.name for f in fields(cls)}
        ns = namespace.rstrip("_").lower() + "_" if namespace else None
        values: dict[str, Any] = {}
        taken_from: dict[str, str] = {}
        unknown: list[str] = []
        foreign: list[str] = []
        conflicts: list[str] = []
        for mapping in maps:  # earlier maps override later ones (Celery's ChainMap order)
            found: dict[str, list[tuple[int, str, Any]]] = {}
            for key in list(mapping.keys()):
                if not isinstance(key, str):
                    continue
                lower = key.lower()
                rank = 1
                if ns and lower.startswith(ns + PREFIX):
                    rank, rest = 0, lower[len(ns) + len(PREFIX) :]
                elif lower.startswith(PREFIX):
                    rest = lower[len(PREFIX) :]
                else:
                    head, sep, _ = lower.partition("_" + PREFIX)
                    if sep and head.isidentifier() and "_" not in head and key not in foreign:
                        foreign.append(key)
                    continue
                if rest not in known:
                    if key not in unknown:
                        unknown.append(key)
                    continue
                found.setdefault(rest, []).append((rank, key, mapping[key]))
            for name, forms in found.items():
                if name in values or name in taken_from:
                    continue  # an earlier map (e.g. app.conf changes) set it
                forms.sort(key=lambda f: f[0])
                if len({repr(v) for _, _, v in forms}) > 1:
                    conflicts.append(" and ".join(f"{k}={v!r}" for _, k, v in forms))
                _, key, value = forms[0]
                taken_from[name] = key
                if value is not None or name in _NULLABLE:
                    values[name] = value
        if celery_conf is not None:
            # Where Celery itself resolves the key (its ``reliable_beat_*`` and namespaced
            # forms), take Celery's answer: its precedence between layers and forms differs
            # between Celery versions, and ours must be the one the app sees.
            for name in list(taken_from):
                try:
                    value = celery_conf[PREFIX + name]
                except KeyError:
                    continue
                if value is not None or name in _NULLABLE:
                    values[name] = value
        problems: list[str] = []
        valid = cls.valid_keys()
        if unknown:
            named = []
            for key in sorted(unknown):
                lower = key.lower()
                stem = lower[: lower.index(PREFIX)]
                close = difflib.get_close_matches(lower[len(stem) :], valid, n=1)
                hint = f"{stem}{close[0]}" if close else ""
                hint = hint.upper() if key.isupper() else hint
                named.append(f"{key} (did you mean {hint}?)" if hint else key)
            problems.append(
                f"unknown setting(s) {', '.join(named)}; valid reliable_beat "
                f"settings: {', '.join(valid)}"
                + (f" (or with the app's namespace: {namespace.rstrip('_').upper()}_"
                   f"RELIABLE_BEAT_...)" if namespace else "")
            )
        if foreign:
            where = (f"the app's configuration namespace is {namespace.rstrip('_')!r}"
                     if namespace else "the app's configuration has no namespace")
            problems.append(
                f"setting(s) {', '.join(sorted(foreign))} are not read: {where}, so Celery "
                "ignores them too. Load them with app.config_from_object(..., "
                "namespace='<their prefix>') or rename them to reliable_beat_<name>"
            )
        if conflicts:
            problems.append(
                "the same setting is given twice with different values: "
                + "; ".join(conflicts) + ". Keep one"
            )
        if problems:
            raise ConfigurationError("; ".join(problems))
        origin = None
        if database_url is not None:
            values["database_url"], origin = database_url
        elif "database_url" in values:
            origin = taken_from["database_url"]
        try:
            settings = cls(**values)
        except ConfigurationError as exc:
            # name each bad value as the user wrote it (CELERY_RELIABLE_BEAT_LEASE_SECONDS)
            message = str(exc)
            for name, key in taken_from.items():
                if key != PREFIX + name:
                    message = re.sub(rf"\b{PREFIX}{name}\b", key, message)
            if message != str(exc):
                exc.args = (message,)
            raise
        object.__setattr__(settings, "_database_url_key", taken_from.get("database_url"))
        object.__setattr__(settings, "_namespace", namespace)
        if origin is not None:
            object.__setattr__(settings, "_database_url_origin", origin)
        return settings

    @classmethod
    def from_celery(cls, app_or_conf: Any, *,
                    database_url: tuple[str, str] | None = None) -> Settings:
        """Read settings from a Celery app or its ``app.conf``, as Celery resolves them.

        The configuration is finalized first (Celery loads a ``config_from_object`` source
        lazily), then every layer of ``app.conf`` is read in Celery's order (values set on
        ``app.conf`` override the loaded object) with the app's namespace: after
        ``app.config_from_object("django.conf:settings", namespace="CELERY")`` the settings
        are ``CELERY_RELIABLE_BEAT_*`` (``RELIABLE_BEAT_*`` and ``reliable_beat_*`` are read
        too). See :meth:`from_mapping` for the forms and the errors.

        Args:
            app_or_conf: the Celery app or its ``conf``.
            database_url: ``(url, origin)`` overriding every store-URL setting (the CLI's
                ``--database-url``); ``origin`` is what :attr:`database_url_origin` says.

        Raises:
            ConfigurationError: see :meth:`from_mapping`.
        """
        conf = getattr(app_or_conf, "conf", app_or_conf)
        finalize = getattr(conf, "finalize", None)
        if callable(finalize):
            finalize()
        namespace = getattr(conf, "prefix", None) or getattr(app_or_conf, "namespace", None)
        maps = getattr(conf, "maps", None)
        if not isinstance(maps, list):
            try:
                maps = [dict(conf.items())]
            except AttributeError:
                maps = [dict(conf)]
        celery_conf = conf if callable(finalize) else None  # a Celery Settings view
        return cls._from_maps(maps, namespace=namespace if isinstance(namespace, str) else None,
                              celery_conf=celery_conf, database_url=database_url)

    @classmethod
    def with_database_url(cls, url: str, origin: str) -> Settings:
        """Default settings on store ``url``; :attr:`database_url_origin` is ``origin``."""
        settings = cls(database_url=url)
        object.__setattr__(settings, "_database_url_origin", origin)
        return settings

    @property
    def database_url_key(self) -> str:
        """The key users set for the store URL, in the form their configuration uses.

        ``CELERY_RELIABLE_BEAT_DATABASE_URL`` under a ``CELERY`` namespace, else
        ``reliable_beat_database_url`` (or the form that was given).
        """
        given = getattr(self, "_database_url_key", None)
        if given:
            return str(given)
        ns = getattr(self, "_namespace", None)
        if ns:
            return f"{ns.rstrip('_').upper()}_RELIABLE_BEAT_DATABASE_URL"
        return PREFIX + "database_url"

    @property
    def database_url_origin(self) -> str:
        """Where :attr:`database_url` came from, for banners and ``status``.

        One of: the setting's key as given (``CELERY_RELIABLE_BEAT_DATABASE_URL``,
        ``reliable_beat_database_url`` ...), ``--database-url``,
        ``$RELIABLE_BEAT_DATABASE_URL``, a registered source's origin (``Django
        DATABASES['default']``, ``Django RELIABLE_BEAT['DATABASE_URL']``), ``the embedded
        default``, or ``Settings(database_url=...)`` for a URL passed in code.
        """
        origin = getattr(self, "_database_url_origin", None)
        if origin:
            return str(origin)
        env = os.environ.get(DATABASE_URL_ENV)
        if env and env == self.database_url:
            origin = "$" + DATABASE_URL_ENV
        else:
            try:
                found = database_url_from_sources()
            except ConfigurationError:
                found = None
            if found is not None and found[0] == self.database_url:
                origin = found[1]
            elif self.is_default_store:
                origin = "the embedded default"
            else:
                origin = "Settings(database_url=...)"
        object.__setattr__(self, "_database_url_origin", origin)
        return origin

    @property
    def database_url_text(self) -> str:
        """The store URL, password hidden, and where it came from, e.g.
        ``"postgresql+psycopg://shop:***@db/shop (from Django DATABASES['default'])"``."""
        return f"{redact_url(self.database_url)} (from {self.database_url_origin})"

    @property
    def is_default_store(self) -> bool:
        """True when the store is the embedded default (:data:`DEFAULT_DATABASE_URL`)."""
        return self.database_url == DEFAULT_DATABASE_URL

    def default_store_warning(self, role: str) -> str | None:
        """The WARNING a ``role`` process (beat, worker, relay) logs on the default store.

        Returns:
            The message, or None when a store was configured.
        """
        if not self.is_default_store:
            return None
        path = os.path.abspath("reliable_beat.sqlite3")
        return (
            f"reliable_beat: this {role} uses the embedded default store {DEFAULT_DATABASE_URL} "
            f"({path}), a SQLite file of this working directory on this host only. Processes "
            "on other hosts or in other directories do not share it: slots fire once per "
            f"store, not once. Set {self.database_url_key} (or $RELIABLE_BEAT_DATABASE_URL) "
            "to the database every beat, worker and relay shares"
        )

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


def host_timezone() -> str:
    """The IANA name of this host's local time zone, the zone C's ``localtime`` uses.

    Looked up in this order: ``$TZ`` (a zone name, or a path under a ``zoneinfo``
    directory), the ``/etc/localtime`` symlink, ``/etc/timezone``.

    Raises:
        ConfigurationError: no IANA name can be found (the message says what to set).
    """
    tz = os.environ.get("TZ", "").lstrip(":")
    candidates: list[str] = []
    if tz:
        candidates.append(tz.split("zoneinfo/", 1)[-1] if "zoneinfo/" in tz else tz)
    else:
        try:
            target = os.path.realpath("/etc/localtime")
            if "zoneinfo/" in target:
                candidates.append(target.split("zoneinfo/", 1)[1])
        except OSError:  # pragma: no cover - no /etc/localtime
            pass
        try:
            with open("/etc/timezone", encoding="utf-8") as fh:
                candidates.append(fh.read().strip())
        except OSError:
            pass
        if not candidates and not os.path.exists("/etc/localtime"):
            candidates.append("UTC")  # no zone configured at all: the C library uses UTC
    for name in candidates:
        if name in ("UTC0", "UTC", "Etc/UTC", "Universal", "Zulu"):
            return "UTC"
        try:
            return validate_timezone(name)
        except ConfigurationError:
            continue
    raise ConfigurationError(
        "Celery's enable_utc is False and no timezone is set, so Celery evaluates schedules "
        f"in this host's local zone, but its IANA name cannot be found (TZ={tz!r}, "
        "/etc/localtime, /etc/timezone); set the app's timezone (e.g. "
        "app.conf.timezone = 'America/New_York') or TZ to an IANA zone name"
    )


def celery_timezone(app_or_conf: Any) -> str:
    """The IANA zone a Celery app evaluates schedules in, resolved as Celery does.

    Celery's ``app.timezone``: the ``timezone`` setting (``CELERY_TIMEZONE`` under a
    namespace, or Django's ``TIME_ZONE``); without one, UTC when ``enable_utc`` is true (the
    default) and the host's local zone (:func:`host_timezone`) when it is false. Entries that
    set no ``timezone`` of their own use this zone.

    Raises:
        ConfigurationError: ``enable_utc=False`` without ``timezone`` on a host whose local
            zone has no IANA name.
    """
    conf = getattr(app_or_conf, "conf", app_or_conf)
    zone = getattr(conf, "timezone", None)
    if zone is None and hasattr(conf, "get"):
        zone = conf.get("timezone") or conf.get("TIME_ZONE")
    if zone:
        return str(zone)
    enable_utc = getattr(conf, "enable_utc", None)
    if enable_utc is None and hasattr(conf, "get"):
        enable_utc = conf.get("enable_utc", True)
    if enable_utc is None or enable_utc:
        return "UTC"
    return host_timezone()
