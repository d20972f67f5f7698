"""Fixtures the workflow unit tests share (``test_workflows.py``, ``test_workflow_sagas.py``,
``test_workflow_versions.py``, driven in-process by ``tests/apps/wf_driver.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from reliable_beat.db.dialects import Store

#: SQLite always; MariaDB (no UPDATE ... RETURNING: the dialect layer's other path) with
#: ``-m mariadb`` when ``RELIABLE_BEAT_TEST_DIALECTS`` names it (the default does).
WF_DIALECTS = ["sqlite"] + [
    pytest.param("mariadb", marks=pytest.mark.mariadb)
    for d in os.environ.get("RELIABLE_BEAT_TEST_DIALECTS", "sqlite,postgresql,mariadb")
    .split(",") if d == "mariadb"
]


@pytest.fixture(params=WF_DIALECTS)
def wf_dialect_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A migrated store of each of :data:`WF_DIALECTS`; the workflow engine's crash hook is
    cleared after the test (a test's crash plan never leaks into the next)."""
    from reliable_beat.workflows import engine

    store: Store = request.getfixturevalue(f"{request.param}_store")
    try:
        yield store
    finally:
        engine.crash_hook = None


@pytest.fixture
def wf_celery_app() -> Callable[[str, Store], Any]:
    """``make(name, store)``: a Celery app (``memory://`` broker, not current) on ``store``
    with short retries (2 attempts, 10-20 ms apart) and a 30 s lease, for a test module to
    register its workflow tasks on."""

    def make(name: str, store: Store) -> Any:
        from celery import Celery

        app = Celery(name, set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            reliable_beat_database_url=store.engine.url.render_as_string(hide_password=False),
            reliable_beat_lease_seconds=30,
            reliable_beat_retry_max_attempts=2,
            reliable_beat_retry_base_seconds=0.01,
            reliable_beat_retry_cap_seconds=0.02,
        )
        return app

    return make
