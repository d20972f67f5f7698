"""reliable_beat.handoff: a workflow's next message published (or its wake answered in
process) by the process that committed it, the relay the safety net. On each dialect's store:
which rows are published, which are marked sent and by which transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from reliable_beat import handoff
from reliable_beat import outbox as outbox_mod
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import outbox
from reliable_beat.messages import OutboxMessage

WAKE = handoff.Wake("wf-1", "wf.name", None)
PAYLOAD = {"task": "reliable_beat.workflow.advance", "args": ["wf-1"], "kwargs": {}}


def _publisher() -> tuple[list[str], handoff.Publish]:
    published: list[str] = []

    def publish(messages: Sequence[OutboxMessage]) -> list[tuple[int, BaseException | None]]:
        published.extend(m.message_id for m in messages)
        return [(m.id, None) for m in messages]

    return published, publish


def _state(store: Store, message_id: str) -> str:
    with store.engine.connect() as conn:
        return str(conn.execute(sa.select(outbox.c.state)
                                .where(outbox.c.message_id == message_id)).scalar_one())


def _commit(store: Store, key: str, wakes: handoff.Wake | None = None) -> None:
    with handoff.after_commit(store), store.begin() as conn:
        handoff.add(conn, "celery", PAYLOAD, key=key, group=None, schedule_group=None,
                    wakes=wakes)


def test_a_wake_advanced_in_process_is_never_published_and_its_release_marks_it(
    store: Store,
) -> None:
    published, publish = _publisher()
    seen: list[tuple[handoff.Wake, str]] = []

    def advance(st: Store, wake: handoff.Wake) -> str:
        # the wake is still the relays' (pending, due after HANDOFF_DELAY) until the release
        seen.append((wake, _state(st, "wake:wf-1:1")))
        with st.begin() as conn:  # the advance's release transaction
            handoff.mark_in(conn)
        return "waiting"

    with handoff.publishing(publish, None, advance):
        _commit(store, "wake:wf-1:1", WAKE)
        assert seen == []  # advanced when the activity's execution (the block) ends
    assert seen == [(WAKE, "pending")]
    assert published == []
    assert _state(store, "wake:wf-1:1") == "sent"


@pytest.mark.parametrize("how", ["declined", "raised"])
def test_a_wake_not_advanced_here_is_published_and_marked(store: Store, how: str) -> None:
    published, publish = _publisher()

    def advance(st: Store, wake: handoff.Wake) -> str | None:
        if how == "raised":
            raise RuntimeError("store down")
        return None  # another queue, or the workflow is not registered here

    with handoff.publishing(publish, None, advance):
        _commit(store, "wake:wf-1:1", WAKE)
    assert published == ["wake:wf-1:1"]
    assert _state(store, "wake:wf-1:1") == "sent"


def test_a_block_that_raises_after_the_commit_publishes_its_wakes(store: Store) -> None:
    published, publish = _publisher()
    advanced: list[handoff.Wake] = []

    def advance(st: Store, wake: handoff.Wake) -> str:
        advanced.append(wake)
        return "waiting"

    with pytest.raises(KeyError), handoff.publishing(publish, None, advance):
        _commit(store, "wake:wf-1:1", WAKE)
        raise KeyError("after the commit")
    assert advanced == []
    assert published == ["wake:wf-1:1"]
    assert _state(store, "wake:wf-1:1") == "sent"


def test_rows_published_inside_an_advance_are_marked_by_its_release(store: Store) -> None:
    published, publish = _publisher()
    with handoff.publishing(publish, None), handoff.deferred_marks(store) as ids:
        _commit(store, "act:wf:wf-1/1#1")
        assert published == ["act:wf:wf-1/1#1"]
        assert _state(store, "act:wf:wf-1/1#1") == "pending"  # no mark of its own
        assert len(ids) == 1
        with store.begin() as conn:  # the release
            handoff.mark_in(conn)
        assert ids == []
        assert _state(store, "act:wf:wf-1/1#1") == "sent"
        _commit(store, "act:wf:wf-1/1#2")  # published after the last release
    assert _state(store, "act:wf:wf-1/1#2") == "sent"  # marked when the advance ends


def test_rows_of_an_advance_that_raises_are_left_to_the_relay(store: Store) -> None:
    published, publish = _publisher()
    with pytest.raises(RuntimeError), handoff.publishing(publish, None), \
            handoff.deferred_marks(store):
        _commit(store, "act:wf:wf-1/1#1")
        raise RuntimeError("the advance failed before its release")
    assert published == ["act:wf:wf-1/1#1"]
    assert _state(store, "act:wf:wf-1/1#1") == "pending"  # the relay sends it again


def test_an_existing_row_is_not_handed_off_again(store: Store) -> None:
    published, publish = _publisher()
    with handoff.publishing(publish, None):
        _commit(store, "act:wf:wf-1/1#1")
        _commit(store, "act:wf:wf-1/1#1")  # same id: the insert is a no-op, already sent
    assert published == ["act:wf:wf-1/1#1"]


def test_add_returns_the_inserted_row(store: Store) -> None:
    rows: list[Any] = []
    with store.begin() as conn:
        outbox_mod.add(conn, "celery", PAYLOAD, key="k1", returned=rows)
        outbox_mod.add(conn, "celery", PAYLOAD, key="k1", returned=rows)  # duplicate
    if store.dialect in ("postgresql", "sqlite"):
        assert [r.message_id for r in rows] == ["k1"]
    else:  # no RETURNING used here: handoff.add reads the row back
        assert rows == []
