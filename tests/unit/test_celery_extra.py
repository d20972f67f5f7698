"""Celery and kombu are the ``celery`` extra: the adapter checks them at import and names the
extra when one is missing or outside the supported range (reliable_beat/celery/__init__.py)."""

from __future__ import annotations

import importlib.metadata

import pytest

import reliable_beat.celery as adapter


def test_version_tuple_reads_release_numbers() -> None:
    assert adapter._version_tuple("5.3.0rc1") == (5, 3, 0)
    assert adapter._version_tuple("5.6.2") == (5, 6, 2)
    assert adapter._version_tuple("6") == (6,)
    assert adapter._version_tuple("dev") == ()


@pytest.mark.parametrize(("found", "ok"), [
    ("5.3.0", True), ("5.7.1", True), ("5.2.7", False), ("6.0.0", False), ("4.4", False),
])
def test_out_of_range_celery_names_the_extra(monkeypatch: pytest.MonkeyPatch, found: str,
                                             ok: bool) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: found)
    if ok:
        adapter._check("celery", *adapter.CELERY_RANGE)
        return
    with pytest.raises(ImportError) as info:
        adapter._check("celery", *adapter.CELERY_RANGE)
    assert f"found celery {found}" in str(info.value)
    assert "celery>=5.3,<6" in str(info.value)
    assert "pip install 'reliable-beat[celery]'" in str(info.value)


def test_missing_kombu_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(dist: str) -> str:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"needs kombu, which is not installed: pip install "
                                          r"'reliable-beat\[celery\]'"):
        adapter._check("kombu", *adapter.KOMBU_RANGE)


def test_the_installed_versions_pass() -> None:
    adapter._check("celery", *adapter.CELERY_RANGE)
    adapter._check("kombu", *adapter.KOMBU_RANGE)


def test_ranges_match_the_extra_in_pyproject() -> None:
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    extra = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["celery"]

    def spec(name: str, rng: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
        return f"{name}>={'.'.join(map(str, rng[0]))},<{'.'.join(map(str, rng[1]))}"

    assert spec("celery", adapter.CELERY_RANGE) in extra
    assert spec("kombu", adapter.KOMBU_RANGE) in extra
