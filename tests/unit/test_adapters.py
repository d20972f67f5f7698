"""The adapter hook (reliable_beat.adapters): an app is answered by its framework's adapter,
found by the top-level package of its class; a Celery app by the built-in Celery adapter."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from celery import Celery

from reliable_beat import adapters
from reliable_beat.errors import ConfigurationError


class _FakeAdapter:
    name = "fakefw"

    def tracked_tasks(self, app: Any) -> list[str]:
        return ["fakefw.tracked"]


@pytest.fixture
def fakefw(monkeypatch: pytest.MonkeyPatch) -> type:
    module = types.ModuleType("fakefw_adapter_mod")
    module.ADAPTER = _FakeAdapter()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fakefw_adapter_mod", module)
    monkeypatch.setattr(adapters, "_registered", {})
    monkeypatch.setattr(adapters, "_loaded", {})
    adapters.register_adapter("fakefw", "fakefw_adapter_mod:ADAPTER")
    app_class = type("App", (), {"__module__": "fakefw.app"})
    return app_class


def test_an_app_goes_to_the_adapter_of_its_package(fakefw: type) -> None:
    assert adapters.adapter_for(fakefw()).tracked_tasks(None) == ["fakefw.tracked"]
    # a subclass defined elsewhere still has the framework's class in its MRO
    sub = type("MyApp", (fakefw,), {"__module__": "proj.app"})
    assert adapters.adapter_for(sub()).name == "fakefw"


def test_a_celery_app_gets_the_celery_adapter() -> None:
    from reliable_beat.celery.adapter import ADAPTER
    from reliable_beat.celery.task import IdempotentTask

    app = Celery("proj", set_as_current=False)

    @app.task(base=IdempotentTask, bind=True, name="proj.idem")
    def idem(self: Any) -> None: ...

    @app.task(name="proj.plain")
    def plain() -> None: ...

    adapter = adapters.adapter_for(app)
    assert adapter is ADAPTER
    # Celery shares app.task tasks with every app (shared=True), so tasks of apps imported
    # by other tests may be in this registry too: every tracked one must be idempotent
    tracked = adapter.tracked_tasks(app)
    assert "proj.idem" in tracked and "proj.plain" not in tracked
    assert all(isinstance(app.tasks[t], IdempotentTask) for t in tracked)
    assert [adapter.task_kind(app, t) for t in ("proj.idem", "proj.plain", "proj.nope")] == [
        "idempotent", "plain", "unknown"]
    assert set(adapter.handlers(app)) == {"celery", "kombu"}


def test_unknown_names_and_no_app_are_refused(fakefw: type) -> None:
    with pytest.raises(ConfigurationError, match="no reliable_beat adapter named 'nope'"):
        adapters.load_adapter("nope")
    adapters.register_adapter("broken", "fakefw_adapter_mod:MISSING")
    with pytest.raises(ConfigurationError, match="names no object"):
        adapters.load_adapter("broken")
    with pytest.raises(ValueError, match="no framework app"):
        adapters.adapter_for(None)


def test_the_celery_adapter_answers_what_the_cli_asks() -> None:
    """The command line imports no adapter: ``-A``, the app's zone and ``entries import`` are
    the Celery adapter's answers (the whole protocol, checked by ``isinstance``)."""
    from reliable_beat.celery import importers
    from reliable_beat.celery.adapter import ADAPTER

    assert isinstance(ADAPTER, adapters.AppAdapter)
    app = Celery("cliq", set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    assert ADAPTER.load_app(None) is None
    assert ADAPTER.load_app(None, parent_app=app) is app  # prepared: its tasks imported
    assert ADAPTER.app_timezone(app) == "Europe/Berlin"
    assert ADAPTER.importers() is importers
