"""The Celery app loader: ``-A spec`` found as ``celery -A spec`` finds it, its tasks loaded.

What :meth:`reliable_beat.celery.adapter.CeleryAdapter.load_app` does for the ``-A`` option
of the root command group (:mod:`reliable_beat.cli`); also re-exported by
:mod:`reliable_beat.celery.commands`, where it lived. It needs no part of the CLI, so the
adapter, which the beat, the relay and the workers load, does not import the CLI.
"""

from __future__ import annotations

import sys
from typing import Any

import click

__all__ = ["load_celery_app", "prepare_app"]


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
