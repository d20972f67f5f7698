"""Malformed workflow rows: what a corrupted ``reliable_beat_workflows`` row or history event
looks like, the block reason that names it, and reading such rows without failing.

A row edited by SQL (or restored from a bad backup) can hold text that is not JSON in a JSON
column (SQLite stores JSON as text and checks nothing), a JSON value of the wrong shape
(``args`` an object instead of a list), an event ``kind`` or ``state`` the engine never
writes, or an ``args_digest`` that is no digest. Replaying such a history would either crash
every advance (a crash loop) or compare garbage with the code and call it non-determinism,
which sends a person to look for a code change that never happened.

The advance checks the row and the history it loaded (:func:`shape_problem`) and, when a
column cannot even be decoded, finds which one from its raw text (:func:`block_undecodable`).
Either way that workflow alone is parked ``blocked`` with a reason of the form::

    malformed row: reliable_beat_workflow_events.result of workflow 'order-7' (run 1, seq 3)
    is not valid JSON (Expecting value: line 1 column 1 (char 0)): 'garbage{'; expected any
    JSON value (the activity's result). The row was changed outside the engine: see
    `reliable-beat workflows show order-7 --events`, repair the value by SQL (from a backup),
    then `reliable-beat workflows resume order-7`; or end it without running its code:
    `reliable-beat workflows cancel order-7 --no-compensate` (terminate; undo by hand).

``workflows show`` / ``list`` read such rows leniently (:func:`lenient_select`): a value that
is not JSON is shown as ``{"malformed_json": "<the raw text>"}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Text, cast, select, update
from sqlalchemy.engine import Connection

from reliable_beat.db.tables import workflow_events, workflow_signals, workflows
from reliable_beat.outbox import db_now
from reliable_beat.redaction import get_logger

__all__ = [
    "EVENT_KINDS",
    "EVENT_STATES",
    "block_undecodable",
    "lenient_select",
    "reason",
    "shape_problem",
]

log = get_logger("reliable_beat.workflows.malformed")

#: Every ``kind`` the engine writes to a history event (anything else is a malformed row).
EVENT_KINDS = frozenset({
    "activity", "cancel", "child", "compensation", "now", "patch", "signal", "step", "timer",
    "transaction", "wait_any",
})
#: Every ``state`` the engine writes to a history event.
EVENT_STATES = frozenset({"scheduled", "completed", "failed", "registered", "released"})
_DIGEST = re.compile(r"[0-9a-f]{16}\Z")

#: JSON columns and what each must hold (the "expected" of a block reason).
_WF_JSON = {
    "args": "a JSON list (the workflow's positional arguments)",
    "kwargs": "a JSON object (the workflow's keyword arguments)",
    "result": "any JSON value (the workflow's result)",
    "error": "a JSON object {\"type\", \"message\", ...} or null",
}
_EV_JSON = {
    "args": "any JSON value (the call's arguments)",
    "result": "any JSON value (the call's result)",
    "error": "a JSON object {\"type\", \"message\", ...} or null",
}
_SIG_JSON = {"payload": "any JSON value (the signal's payload)"}


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(value), "number")


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


def fix_hint(workflow_id: str) -> str:
    """The way out of a malformed-row block, with the workflow's id filled in."""
    return (
        f"The row was changed outside the engine: see `reliable-beat workflows show "
        f"{workflow_id} --events`, repair the value by SQL (from a backup), then "
        f"`reliable-beat workflows resume {workflow_id}`; or end it without running its "
        f"code: `reliable-beat workflows cancel {workflow_id} --no-compensate` (terminate; "
        "undo by hand)"
    )


def reason(workflow_id: str, problem: str) -> str:
    """``malformed row: <problem>. <fix hint>`` (a ``block_reason``)."""
    return f"malformed row: {problem}. {fix_hint(workflow_id)}"


def _where(workflow_id: str, run_no: int | None = None, seq: int | None = None) -> str:
    at = f"workflow {workflow_id!r}"
    if seq is not None:
        at += f" (run {run_no}, seq {seq})"
    return at


def shape_problem(workflow_id: str, run_no: int, args: Any, kwargs: Any,
                  history: Mapping[int, Any]) -> str | None:
    """The first value of a decoded workflow row / history that the engine never writes, as
    ``"<table>.<column> of workflow 'ID' (run R, seq S) is ...; expected ..."``, or None.

    Args:
        workflow_id: the business id (for the message).
        run_no: the current run.
        args / kwargs: the row's decoded ``args`` / ``kwargs``.
        history: the run's events by seq (rows with ``kind``, ``state``, ``args_digest``,
            ``error``; as :func:`reliable_beat.workflows.engine.load_history` returns).
    """
    if not isinstance(args, list):
        return (f"reliable_beat_workflows.args of {_where(workflow_id)} is a JSON "
                f"{_json_kind(args)} {_show(args)}; expected {_WF_JSON['args']}")
    if not isinstance(kwargs, dict):
        return (f"reliable_beat_workflows.kwargs of {_where(workflow_id)} is a JSON "
                f"{_json_kind(kwargs)} {_show(kwargs)}; expected {_WF_JSON['kwargs']}")
    for seq, ev in history.items():
        at = _where(workflow_id, run_no, seq)
        col = "reliable_beat_workflow_events"
        if ev.kind not in EVENT_KINDS:
            return (f"{col}.kind of {at} is {ev.kind!r}; expected one of "
                    f"{', '.join(sorted(EVENT_KINDS))}")
        if ev.state not in EVENT_STATES:
            return (f"{col}.state of {at} is {ev.state!r}; expected one of "
                    f"{', '.join(sorted(EVENT_STATES))}")
        if not isinstance(ev.args_digest, str) or not _DIGEST.match(ev.args_digest):
            return (f"{col}.args_digest of {at} is {ev.args_digest!r}; expected 16 hex "
                    "digits (sha256 of the call's kind, name and arguments)")
        if ev.error is not None and not isinstance(ev.error, dict):
            return (f"{col}.error of {at} is a JSON {_json_kind(ev.error)} "
                    f"{_show(ev.error)}; expected {_EV_JSON['error']}")
    return None


def _undecodable(text: Any) -> str | None:
    """Why the raw text of a JSON column does not decode, or None."""
    if text is None or not isinstance(text, str):  # NULL, or decoded by the driver (jsonb)
        return None
    try:
        json.loads(text)
    except ValueError as exc:
        return str(exc)
    return None


def _raw(column: Any) -> Any:
    return cast(column, Text).label(column.name)


def decode_problem(conn: Connection, pk: int, workflow_id: str, run_no: int) -> str | None:
    """The first JSON column of workflow ``pk`` (its row, then its current run's events by
    seq) whose stored text is not JSON, named with what it should hold; or None."""
    row = conn.execute(select(*[_raw(workflows.c[c]) for c in _WF_JSON])
                       .where(workflows.c.id == pk)).first()
    if row is not None:
        for c, expected in _WF_JSON.items():
            why = _undecodable(row._mapping[c])
            if why:
                return (f"reliable_beat_workflows.{c} of {_where(workflow_id)} is not valid "
                        f"JSON ({why}): {_show(row._mapping[c])}; expected {expected}")
    evs = conn.execute(
        select(workflow_events.c.seq, *[_raw(workflow_events.c[c]) for c in _EV_JSON])
        .where(workflow_events.c.workflow_pk == pk, workflow_events.c.run_no == run_no)
        .order_by(workflow_events.c.seq)
    ).all()
    for ev in evs:
        for c, expected in _EV_JSON.items():
            why = _undecodable(ev._mapping[c])
            if why:
                return (f"reliable_beat_workflow_events.{c} of "
                        f"{_where(workflow_id, run_no, ev.seq)} is not valid JSON ({why}): "
                        f"{_show(ev._mapping[c])}; expected {expected}")
    return None


def block_undecodable(conn: Connection, workflow_id: str, active_states: tuple[str, ...]
                      ) -> tuple[str, str] | None:
    """After a claim failed to decode the workflow's row or history: find the column, and
    park the workflow ``blocked`` with a reason naming it (one statement, under the claim's
    own conditions: an active workflow with no live lease; the fence token is bumped so an
    advance holding an old claim writes nothing more). Joins ``conn``'s transaction.

    Returns:
        ``(state, reason)``: ``("blocked", reason)``, or the state found when another
        process holds a live lease (``"busy"``) or it is not active; None when every JSON
        column decodes (the error came from elsewhere: the caller re-raises it).
    """
    row = conn.execute(select(workflows.c.id, workflows.c.run_no, workflows.c.state)
                       .where(workflows.c.workflow_id == workflow_id)).first()
    if row is None:
        return None
    problem = decode_problem(conn, int(row.id), workflow_id, int(row.run_no))
    if problem is None:
        return None
    why = reason(workflow_id, problem)
    now = db_now(conn)
    done = conn.execute(
        update(workflows)
        .where(workflows.c.id == row.id, workflows.c.state.in_(active_states),
               (workflows.c.lease_expires_at.is_(None)) | (workflows.c.lease_expires_at < now))
        .values(state="blocked", block_reason=why[:4000], leased_by=None,
                lease_expires_at=None, fence_token=workflows.c.fence_token + 1,
                updated_at=now)
    ).rowcount
    if done != 1:
        return ("busy" if row.state in active_states else str(row.state)), why
    log.error("workflow %s blocked: %s", workflow_id, why)
    return "blocked", why


class _Row:
    """A row-like object (``._mapping``) built by :func:`lenient_select`."""

    def __init__(self, mapping: dict[str, Any]) -> None:
        self._mapping = mapping

    def __getattr__(self, name: str) -> Any:
        try:
            return self._mapping[name]
        except KeyError:
            raise AttributeError(name) from None


def _lenient_value(text: Any) -> Any:
    if text is None or not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return {"malformed_json": text}


def lenient_select(conn: Connection, stmt: Any) -> list[Any]:
    """Run ``stmt`` (a ``select`` of whole rows of the workflows, events or signals table);
    if a JSON column does not decode, run it again reading those columns as text, and give
    each value that is not JSON as ``{"malformed_json": "<raw text>"}``: a corrupted row
    stays readable (``workflows show``, ``list``) instead of failing the whole read."""
    try:
        return list(conn.execute(stmt).all())
    except ValueError:
        pass
    json_cols = set(_WF_JSON) | set(_EV_JSON) | set(_SIG_JSON)
    tables = {workflows.name, workflow_events.name, workflow_signals.name}
    cols = [_raw(c) if getattr(c, "table", None) is not None and c.table.name in tables
            and c.name in json_cols else c for c in stmt.selected_columns]
    raw = conn.execute(stmt.with_only_columns(*cols)).all()
    return [_Row({k: (_lenient_value(v) if k in json_cols else v)
                  for k, v in r._mapping.items()}) for r in raw]
