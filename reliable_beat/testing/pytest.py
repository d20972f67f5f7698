"""The opt-in pytest plugin of :mod:`reliable_beat.testing` (``docs/testing.md``).

Enable it explicitly, it is not auto-loaded (installing reliable_beat must not add fixtures
and options to every test run on the machine)::

    pytest -p reliable_beat.testing.pytest
    # or, in your top-level conftest.py:
    pytest_plugins = ["reliable_beat.testing.pytest"]

Options (command line, or ``[tool.pytest.ini_options]``):

* ``--rb-database-url URL`` / ini ``reliable_beat_test_database_url`` / environment
  ``RELIABLE_BEAT_TEST_DATABASE_URL``: a PostgreSQL server to make throwaway databases on
  (each test gets a fresh database, dropped afterwards). Default: a SQLite file per test.
* ``--rb-app MODULE:ATTR`` / ini ``reliable_beat_app``: your Celery app (e.g.
  ``proj.celery:app``); :func:`rb_app` points it at the test's store. Default: a fresh app.

Fixtures (all function-scoped):

* ``rb_store``: a migrated throwaway :class:`~reliable_beat.db.dialects.Store`.
* ``rb_app``: the app on ``rb_store``, eager (``task_always_eager``; ``delay()`` runs inline).
* ``rb_worker``: the app on ``rb_store``, not eager, with an in-process worker (threads pool,
  in-memory broker and result backend): ``delay()`` goes through a real broker and worker.
* ``rb_clock``: a :class:`~reliable_beat.testing.SchedulerClock` on ``rb_store``, starting at
  2026-01-01T00:00Z (move it with ``rb_clock.set(...)`` before adding entries).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from reliable_beat.db.dialects import Store
from reliable_beat.testing.clock import SchedulerClock
from reliable_beat.testing.kit import make_app, throwaway_store, use_store

__all__ = ["rb_app", "rb_clock", "rb_store", "rb_worker"]

URL_ENV = "RELIABLE_BEAT_TEST_DATABASE_URL"
CLOCK_START = datetime(2026, 1, 1, tzinfo=timezone.utc)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("reliable_beat", "reliable_beat testing kit")
    group.addoption("--rb-database-url", default=None,
                    help="make throwaway stores on this database server (default: SQLite)")
    group.addoption("--rb-app", default=None,
                    help="your Celery app as module:attribute (default: a fresh app)")
    parser.addini("reliable_beat_test_database_url",
                  "make throwaway stores on this database server (default: SQLite)")
    parser.addini("reliable_beat_app", "your Celery app as module:attribute")


def _option(config: pytest.Config, option: str, ini: str) -> str | None:
    value = config.getoption(option) or config.getini(ini)
    return str(value) if value else None


def _load_app(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise pytest.UsageError(f"--rb-app / reliable_beat_app {spec!r}: expected "
                                "'module:attribute', e.g. 'proj.celery:app'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise pytest.UsageError(f"--rb-app / reliable_beat_app {spec!r}: {exc}") from exc


@pytest.fixture
def rb_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A migrated throwaway store: SQLite by default, a fresh PostgreSQL database with
    ``--rb-database-url``. Create your effect tables on ``rb_store.engine``."""
    url = (_option(request.config, "--rb-database-url", "reliable_beat_test_database_url")
           or os.environ.get(URL_ENV) or None)
    with throwaway_store(url) as store:
        yield store


def _app(request: pytest.FixtureRequest, store: Store) -> Any:
    spec = _option(request.config, "--rb-app", "reliable_beat_app")
    return _load_app(spec) if spec else make_app(store)


@pytest.fixture
def rb_app(request: pytest.FixtureRequest, rb_store: Store) -> Iterator[Any]:
    """Your app (``--rb-app``) or a fresh one, on ``rb_store``, eager."""
    with use_store(_app(request, rb_store), rb_store, eager=True) as app:
        yield app


@pytest.fixture
def rb_worker(request: pytest.FixtureRequest, rb_store: Store) -> Iterator[Any]:
    """Your app (``--rb-app``) or a fresh one, on ``rb_store``, with an in-process worker.

    The app's broker and result backend are replaced by in-memory ones for the test.
    Yields the app: ``task.delay(...).get(timeout=10)`` runs on the worker.
    """
    from celery.contrib.testing.worker import start_worker

    app = _app(request, rb_store)
    with use_store(app, rb_store, eager=False, broker_url="memory://",
                   result_backend="cache+memory://"), \
            start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                         loglevel="WARNING", shutdown_timeout=30):
        yield app


@pytest.fixture
def rb_clock(rb_store: Store) -> SchedulerClock:
    """A scheduler clock on ``rb_store`` starting at 2026-01-01T00:00Z."""
    return SchedulerClock(rb_store, CLOCK_START)
