"""The ``celery -A proj reliable-beat ...`` hook (the ``celery.commands`` entry point).

It mounts the framework-neutral root group (:mod:`reliable_beat.cli`) under ``celery``; the
group takes the app Celery already loaded. It re-exports the Celery app loader the root
group uses for ``-A`` (:func:`load_celery_app`, :func:`prepare_app`, in
:mod:`reliable_beat.celery.app_loader`, reached through
:meth:`reliable_beat.celery.adapter.CeleryAdapter.load_app`), and the names that lived here
before the CLI moved to :mod:`reliable_beat.cli`.
"""

from __future__ import annotations

from reliable_beat.celery.app_loader import load_celery_app, prepare_app
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
