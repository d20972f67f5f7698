"""The ``celery -A proj reliable-beat ...`` hook (the ``celery.commands`` entry point).

It mounts the framework-neutral root group (:mod:`reliable_beat.cli`) under ``celery``; the
group takes the app Celery already loaded. This module also holds the Celery app loader the
root group uses for ``-A`` (:func:`load_celery_app`, :func:`prepare_app`, reached through
:meth:`reliable_beat.celery.adapter.CeleryAdapter.load_app`), and re-exports the names that
lived here before the CLI moved to :mod:`reliable_beat.cli`.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from reliable_beat.cli import (
    COMMAND_MODULES,
    CliContext,
    fail,
    jsonable,
    pass_cli,
    reliable_beat,
)

__all__ = [
    "COMMAND_MODULES",
    "CliContext",
    "fail",
    "jsonable",
    "load_celery_app",
    "pass_cli",
    "prepare_app",
    "reliable_beat",
]


def load_celery_app(spec: str) -> Any:
    """The Celery app named by ``spec`` (``module``, ``module:attr``), found the way
    ``celery -A spec`` finds it (the current directory is importable)."""
    from celery.app.utils import find_app

    sys.path.insert(0, ".")
    return find_app(spec)


def prepare_app(app: Any) -> Any:
    """Load the app's tasks the way ``celery -A proj worker`` does before it consumes: import
    the modules of ``imports`` / ``include`` and the packages given to ``autodiscover_tasks``
    (the loader's ``import_default_modules``, which sends ``import_modules``), then finalize
    the app. So ``entries add --task proj.tasks.record`` and ``entries describe`` know every
    task a worker of the same app knows.

    Returns:
        ``app``.

    Raises:
        click.ClickException: a task module fails to import (the message names it; exit 1).
    """
    try:
        app.loader.import_default_modules()
        app.finalize(auto=True)
    except Exception as exc:
        raise click.ClickException(
            f"could not load the task modules of app {getattr(app, 'main', app)!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return app
