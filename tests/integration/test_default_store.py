"""A worker or relay on the embedded default store says so at WARNING, naming the key to set
(issue 11). The beat's banner and log are covered with real processes in
tests/acceptance/test_django_settings.py.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
from celery import Celery
from click.testing import CliRunner

from reliable_beat.celery.commands import reliable_beat as cli
from reliable_beat.celery.task import IdempotentTask, _on_worker_setup, _warned_default_store


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RELIABLE_BEAT_DATABASE_URL", raising=False)
    _warned_default_store.clear()
    return tmp_path


def test_worker_on_the_default_store_warns_at_start(
        in_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("dflt", set_as_current=False, namespace="CELERY")
    app.conf.update(CELERY_BROKER_URL="memory://")

    @app.task(shared=False, base=IdempotentTask, bind=True, name="dflt.t")
    def t(self: IdempotentTask) -> None:
        return None

    with caplog.at_level(logging.WARNING, logger="reliable_beat"):
        _on_worker_setup(instance=types.SimpleNamespace(app=app))
    text = caplog.text
    assert "this worker uses the embedded default store" in text
    assert "CELERY_RELIABLE_BEAT_DATABASE_URL" in text


def test_relay_on_the_default_store_warns(in_tmp: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["db", "upgrade"]).exit_code == 0
    assert (in_tmp / "reliable_beat.sqlite3").exists()
    with caplog.at_level(logging.WARNING):
        out = runner.invoke(cli, ["relay", "--once"])
    assert out.exit_code == 0, out.output
    assert "this relay uses the embedded default store" in caplog.text
    assert "reliable_beat_database_url" in caplog.text
