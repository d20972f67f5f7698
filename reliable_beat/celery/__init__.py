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

import re
from typing import Any

__all__ = ["CELERY_RANGE", "KOMBU_RANGE", "IdempotentTask", "ReliableScheduler"]

#: Supported versions (``>=`` lower, ``<`` upper), as in the ``celery`` extra of pyproject.
CELERY_RANGE = ((5, 3), (6,))
KOMBU_RANGE = ((5, 3, 1), (6,))
_EXTRA = "pip install 'reliable-beat[celery]'"


def _version_tuple(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"5.3.0rc1"`` -> ``(5, 3, 0)``."""
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


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


# Resolved on first use, not imported here: Celery imports reliable_beat.celery.commands (and
# so this package) in every `celery` process as a command plugin; importing the task module
# would connect its worker signals in apps that do not use reliable_beat.
def __getattr__(name: str) -> Any:
    if name == "ReliableScheduler":
        from reliable_beat.celery.scheduler import ReliableScheduler

        return ReliableScheduler
    if name == "IdempotentTask":
        from reliable_beat.celery.task import IdempotentTask

        return IdempotentTask
    raise AttributeError(name)
