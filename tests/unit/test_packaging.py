"""The declared dependency floors are what the ``oldest`` tox env installs (issue 11)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("oldest_constraints",
                                                  ROOT / ".ci" / "oldest_constraints.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_runtime_dependency_has_a_floor_the_oldest_env_pins() -> None:
    floors = _generator().floors()
    # Every runtime requirement (core + the postgres/redis/http/metrics extras) is pinned.
    assert set(floors) == {"celery", "kombu", "sqlalchemy", "alembic", "croniter", "click",
                           "psycopg", "redis", "httpx", "prometheus-client"}
    # The floors found false by the oldest env stay raised.
    assert floors["croniter"] == "6.2.1" and floors["kombu"] == "5.3.1"
    assert floors["psycopg"] == "3.2.1" and floors["click"] == "8.1.2"


def test_redis_extra_pulls_kombus_redis_transport_requirements() -> None:
    tomllib = _generator().tomllib  # tomllib, or tomli on Python 3.10
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(r.replace(" ", "").startswith("kombu[redis]") for r in extras["redis"])


def test_constraints_file_is_one_pin_a_line() -> None:
    text = _generator().constraints()
    lines = text.splitlines()
    assert lines == sorted(lines) and all("==" in ln for ln in lines)
    assert "croniter==6.2.1" in lines
