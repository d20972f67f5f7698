"""Runs: claim (lease + fence), fenced completion, attempts, failures and dead letters.

Framework-neutral: the Celery adapter (:mod:`reliable_beat.celery.task`) and a future
Dramatiq adapter call these functions; nothing here imports Celery.

Life of a run (``reliable_beat_runs.state``)::

    scheduled -> dispatched -> running -> succeeded
                                 |  \\-> retrying -> running ...
                                 \\-> dead  (dead-letter row; requeue -> scheduled -> dispatched)

Every try is a row in ``reliable_beat_attempts``. ``runs.attempts`` counts the tries that
*ran the body* (claims that took the lease), the first included; it is reset to 0 when a
person requeues a dead letter, so the requeued run gets a fresh retry budget. Attempt rows
that did not run the body (``deduplicated``, ``busy``) carry the run's current count.

Fencing (design.md invariant 6): every claim that takes the lease increments
``fence_token``. Every later write of the runner (renewal, completion, failure) has
``WHERE fence_token = :mine``; zero rows means a newer claim superseded it.

All instants come from the database clock (:meth:`Store.now`), never the local clock.

The run store is four modules: :mod:`~reliable_beat.runs.claim` (the claim),
:mod:`~reliable_beat.runs.complete` (completion, renewal, failures),
:mod:`~reliable_beat.runs.operator` (lease clear, requeue) and
:mod:`~reliable_beat.runs.queries` (listings); every name is importable from here.
"""

from __future__ import annotations

from reliable_beat.errors import DeadLetterNotFound, RunNotFound
from reliable_beat.runs.claim import ACQUIRED as ACQUIRED
from reliable_beat.runs.claim import ALREADY_SUCCEEDED as ALREADY_SUCCEEDED
from reliable_beat.runs.claim import BUSY as BUSY
from reliable_beat.runs.claim import DEAD as DEAD
from reliable_beat.runs.claim import MYSQL_DEADLOCK_RETRIES as MYSQL_DEADLOCK_RETRIES
from reliable_beat.runs.claim import (
    UNFINISHED_STATES,
    Claim,
    claim_run,
    db_now,
    format_error,
)
from reliable_beat.runs.claim import _pg_claim_statement as _pg_claim_statement
from reliable_beat.runs.complete import (
    complete,
    record_failure,
    record_fenced_out,
    record_refused_message,
    renew_lease,
    set_result,
)
from reliable_beat.runs.operator import NOT_RESENT as NOT_RESENT
from reliable_beat.runs.operator import REQUEUEABLE_MESSAGE_REASONS as REQUEUEABLE_MESSAGE_REASONS
from reliable_beat.runs.operator import RESEND_SKIPPED as RESEND_SKIPPED
from reliable_beat.runs.operator import RESENT as RESENT
from reliable_beat.runs.operator import UNSTORABLE as UNSTORABLE
from reliable_beat.runs.operator import (
    LeaseCleared,
    clear_lease,
    dismiss_dead_letter,
    mark_dispatched,
    release_lease,
    requeue_dead_letter,
    requeue_dead_message,
    requeue_outbox_dead_letter,
    undo_requeue,
)
from reliable_beat.runs.queries import (
    get_dead_letter,
    get_run,
    list_attempts,
    list_dead_letters,
    list_runs,
)

__all__ = [
    "UNFINISHED_STATES",
    "Claim",
    "DeadLetterNotFound",
    "LeaseCleared",
    "RunNotFound",
    "claim_run",
    "clear_lease",
    "complete",
    "db_now",
    "dismiss_dead_letter",
    "format_error",
    "get_dead_letter",
    "get_run",
    "list_attempts",
    "list_dead_letters",
    "list_runs",
    "mark_dispatched",
    "record_failure",
    "record_fenced_out",
    "record_refused_message",
    "release_lease",
    "renew_lease",
    "requeue_dead_letter",
    "requeue_dead_message",
    "requeue_outbox_dead_letter",
    "set_result",
    "undo_requeue",
]
