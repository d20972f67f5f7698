"""The overview's alarms: the same collection as ``reliable-beat status``, kept fresh.

:func:`reliable_beat.ops.status.collect_status` reads every entry and checks each row (the
MALFORMED ENTRY check), which takes a second or more at tens of thousands of entries
(1.3-2.6 s at 20,000 entries and a million runs on PostgreSQL on a busy 2-core machine,
benchmarks/dashboard.py): too long for a page that refreshes every few seconds.
:class:`AlarmCache` keeps the last collection;
a page older than ``ttl`` seconds triggers one refresh in a background thread and is served
the previous one meanwhile (its age is shown). Only the first page ever waits for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from reliable_beat.db.dialects import Store
from reliable_beat.ops.status import collect_status
from reliable_beat.redaction import get_logger

__all__ = ["AlarmCache"]

log = get_logger(__name__)


class AlarmCache:
    """The last status collection of a store, refreshed at most every ``ttl`` seconds."""

    def __init__(self, store: Store, *, ttl: float = 5.0, **status_kwargs: Any) -> None:
        self.store = store
        self.ttl = ttl
        self.status_kwargs = status_kwargs
        self._lock = threading.Lock()
        self._value: dict[str, Any] | None = None
        self._at = 0.0
        self._refreshing = False
        self._error: str | None = None

    def _collect(self) -> None:
        try:
            value = collect_status(self.store, **self.status_kwargs)
            error = None
        except Exception as exc:  # shown on the page; the next refresh tries again
            log.warning("dashboard: the status collection failed: %s", exc)
            value, error = None, f"{type(exc).__name__}: {exc}"
        with self._lock:
            if value is not None:
                self._value = value
            self._error = error
            self._at = time.monotonic()
            self._refreshing = False

    def get(self) -> tuple[dict[str, Any] | None, float, str | None]:
        """``(status, age in seconds, error of the last refresh)``; waits only when nothing
        was ever collected."""
        with self._lock:
            fresh = self._value is not None and time.monotonic() - self._at < self.ttl
            first = self._value is None  # nothing to show yet: this request waits
            start = not fresh and not first and not self._refreshing
            if start:
                self._refreshing = True
        if first:
            self._collect()
        elif start:
            threading.Thread(target=self._collect, name="rb-dashboard-status",
                             daemon=True).start()
        with self._lock:
            return self._value, time.monotonic() - self._at, self._error
