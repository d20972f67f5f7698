"""A worker whose store has no reliable_beat schema fails loudly and permanently (issue 11).

Before: ``no such table: reliable_beat_runs`` was a transient database error, retried
forever at INFO/WARNING and never dead-lettered.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from reliable_beat.celery.task import KEY_HEADER, IdempotentTask
from reliable_beat.errors import SchemaError


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_store_without_schema_is_a_permanent_loud_error(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'empty.sqlite3'}"
        sa.create_engine(url).connect().close()  # the file exists, the schema does not
    else:
        url = request.getfixturevalue("pg_url")  # an empty database
    app = Celery("noschema", set_as_current=False)
    app.conf.update(broker_url="memory://", reliable_beat_database_url=url,
                    task_eager_propagates=True, reliable_beat_retry_base_seconds=0.01,
                    reliable_beat_retry_cap_seconds=0.01)
    calls: list[int] = []

    @app.task(shared=False, base=IdempotentTask, bind=True, name="noschema.t")
    def t(self: IdempotentTask) -> None:
        calls.append(1)

    with caplog.at_level(logging.CRITICAL, logger="reliable_beat"), \
            pytest.raises(SchemaError, match="db upgrade") as info:
        t.apply(headers={KEY_HEADER: "k:1"})
    assert "has no reliable_beat schema" in str(info.value)
    assert not calls
    assert any(r.levelno == logging.CRITICAL and "k:1" in r.getMessage()
               for r in caplog.records)
