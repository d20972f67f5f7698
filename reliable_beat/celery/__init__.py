"""The Celery adapter: scheduler, task base class, publishing and the CLI sub-command.

``beat_scheduler = "reliable_beat.celery:ReliableScheduler"`` (or
``"reliable_beat.ReliableScheduler"``).

Celery and kombu are the ``celery`` extra (``pip install 'reliable-beat[celery]'``); importing
this package checks that both are installed in the supported range and raises an
:class:`ImportError` naming the extra otherwise. The core (``reliable_beat.*`` outside
``celery/``, ``dramatiq/``, ``contrib/`` and the CLI) never imports this package: it reaches
it through the adapter hook (:mod:`reliable_beat.adapters`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CELERY_RANGE", "KOMBU_RANGE", "IdempotentTask", "ReliableScheduler"]

#: Supported versions (``>=`` lower, ``<`` upper), as in the ``celery`` extra of pyproject.
CELERY_RANGE = ((5, 3), (6,))
KOMBU_RANGE = ((5, 3, 1), (6,))
_EXTRA = "pip install 'reliable-beat[celery]'"


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def _check(dist: str, low: tuple[int, ...], high: tuple[int, ...]) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version(dist)
    except PackageNotFoundError:
        raise ImportError(
            f"reliable_beat.celery (the Celery adapter) needs {dist}, which is not installed: "
            f"{_EXTRA}"
        ) from None
    if not low <= _version_tuple(found) < high:
        want = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise ImportError(
            f"reliable_beat.celery (the Celery adapter) supports {dist}{want}, found {dist} "
            f"{found}: {_EXTRA} installs a supported one"
        )


_check("celery", *CELERY_RANGE)
_check("kombu", *KOMBU_RANGE)


def __getattr__(name: str) -> Any:
    if name == "ReliableScheduler":
        from reliable_beat.celery.scheduler import ReliableScheduler

        return ReliableScheduler
    if name == "IdempotentTask":
        from reliable_beat.celery.task import IdempotentTask

        return IdempotentTask
    raise AttributeError(name)
