"""Rows are data: read each one defensively, check its shape, isolate the bad ones.

Rows of the store are written by this library, but also by a person with ``psql``, a data
migration, an older or newer version of the library, or a restore. A malformed row must
never stop the pipeline that reads it (design.md: "loops never die on one bad item"). Every
reader that serves many rows (the beat's claim, the relay's claim, the release of buffered
runs) therefore:

1. **reads each row without trusting its types** (:func:`raw_columns` + :func:`decode_row`):
   on SQLite every column may hold any value (dynamic typing) and a JSON column may hold
   text that is not JSON, which SQLAlchemy would otherwise fail to decode *while fetching
   the whole result*; here each value of each row is decoded on its own and a failure
   becomes a problem of that row only;
2. **checks the row's shape** (:func:`check_entry`, :func:`check_outbox`,
   :func:`check_run_call`): types of every column the pipeline uses, JSON shapes (``options``
   an object, ``options.expires`` a positive number, ``options.headers`` an object, ``args`` a
   list, ``kwargs`` an object, a schedule spec that rebuilds, a known time zone, ...);
3. **quarantines** a row with problems and goes on with the others: an entry is disabled
   with ``quarantine_reason`` / ``quarantined_at`` (shown by ``reliable-beat status`` and the
   ``reliable_beat_quarantined_rows`` metric); an outbox row, a buffered run, a run a
   worker's claim finds malformed (:func:`check_run_row`) or a slot's run in an unknown
   state (:func:`settle_unknown_states`) is dead-lettered with reason ``malformed`` (its
   original values are kept in the dead letter's payload). The problems are logged at
   ERROR, naming the row and the fix.

Nothing here imports a task framework.

The package: :mod:`~reliable_beat.rows.decode` (step 1), :mod:`~reliable_beat.rows.checks`
(step 2), :mod:`~reliable_beat.rows.quarantine` (step 3); :mod:`~reliable_beat.rows.next_fire`
checks an entry's ``next_fire_at`` against its schedule; :mod:`~reliable_beat.rows.claimed`
reads a beat's claimed entries through them, each distinct config once. Every name is
imported from here.
"""

from __future__ import annotations

from reliable_beat.rows.checks import (
    KNOWN_RUN_STATES,
    check_entry,
    check_options,
    check_outbox,
    check_run_call,
    check_run_row,
    column_of,
    entry_checker,
    stored_config_hashes,
)
from reliable_beat.rows.checks import MAX_SECONDS as MAX_SECONDS
from reliable_beat.rows.claimed import ClaimedEntries
from reliable_beat.rows.decode import (
    OPTIONAL_COLUMNS,
    LabelledReader,
    decode_labelled,
    decode_row,
    decode_value,
    display_rows,
    infinite_instant,
    infinity_text,
    missing_optional_columns,
    raw_columns,
    raw_labelled,
    raw_repr,
    unreadable_instant,
)
from reliable_beat.rows.next_fire import (
    inconsistent_next_fire,
    next_fire_fix,
    next_fire_problem,
    quarantine_inconsistent_next_fire,
    repaired_next_fire,
)
from reliable_beat.rows.quarantine import (
    MALFORMED,
    dead_letter_run,
    describe_problems,
    jsonable_raw,
    quarantine_counts,
    quarantine_entry,
    read_buffered_runs,
    read_entry,
    read_entry_options,
    settle_unknown_states,
)
from reliable_beat.rows.quarantine import MAX_REASON_CHARS as MAX_REASON_CHARS
from reliable_beat.rows.quarantine import RUN_FIX as RUN_FIX
from reliable_beat.rows.quarantine import STATE_FIX as STATE_FIX
from reliable_beat.rows.quarantine import unknown_state_runs as unknown_state_runs

__all__ = [
    "KNOWN_RUN_STATES",
    "MALFORMED",
    "OPTIONAL_COLUMNS",
    "ClaimedEntries",
    "LabelledReader",
    "check_entry",
    "check_options",
    "check_outbox",
    "check_run_call",
    "check_run_row",
    "column_of",
    "dead_letter_run",
    "decode_labelled",
    "decode_row",
    "decode_value",
    "describe_problems",
    "display_rows",
    "entry_checker",
    "inconsistent_next_fire",
    "infinite_instant",
    "infinity_text",
    "jsonable_raw",
    "missing_optional_columns",
    "next_fire_fix",
    "next_fire_problem",
    "quarantine_counts",
    "quarantine_entry",
    "quarantine_inconsistent_next_fire",
    "raw_columns",
    "raw_labelled",
    "raw_repr",
    "read_buffered_runs",
    "read_entry",
    "read_entry_options",
    "repaired_next_fire",
    "settle_unknown_states",
    "stored_config_hashes",
    "unreadable_instant",
]
