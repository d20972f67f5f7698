"""``python manage.py reliable_beat ...``: the ``reliable-beat`` CLI with Django's settings.

The Celery app (``-A``) is :func:`reliable_beat.contrib.django.conf.celery_app`
(``RELIABLE_BEAT["CELERY_APP"]``, else the project's ``celery_app``), and the store is the one
its beats and workers use: the app's ``reliable_beat_database_url`` setting, else the Django
database (``status`` says which: ``from Django DATABASES['default']``).
Every sub-command of ``reliable-beat`` works (``db upgrade``, ``entries ...``, ``runs``,
``dead-letters ...``, ``relay``, ``status``). One shorthand::

    python manage.py reliable_beat import django-celery-beat [--dry-run]

is ``entries import django-celery-beat --from-url <the Django database>``: it moves the
project's django-celery-beat entries into reliable_beat with the existing importer (stop
the old beat first; cutover without a double or lost slot).
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

import click
from django.core.management.base import BaseCommand

from reliable_beat.cli import reliable_beat
from reliable_beat.contrib.django import conf
from reliable_beat.contrib.django.db import database_url


class Command(BaseCommand):
    help = "The reliable-beat command line, with this Django project's store and Celery app."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER,
                            help="reliable-beat sub-command and its options")

    def run_from_argv(self, argv: list[str]) -> None:
        # click parses the arguments (Django's parser would reject the sub-commands).
        sys.exit(self.run_cli(argv[2:], prog_name=f"{argv[0]} {argv[1]}"))

    def handle(self, *args: Any, **options: Any) -> None:  # call_command("reliable_beat", ...)
        code = self.run_cli(list(args), prog_name="manage.py reliable_beat")
        if code:
            raise SystemExit(code)

    @staticmethod
    def run_cli(args: list[str], prog_name: str) -> int:
        """Run the CLI with ``args``; returns its exit code."""
        args = list(args)
        if args[:2] == ["import", "django-celery-beat"]:
            args = ["entries", *args]
            if "--from-url" not in args:
                args += ["--from-url", database_url("default")]
        extra: dict[str, Any] = {}
        if "-A" not in args and "--app" not in args and not any(
                a.startswith("--app=") for a in args):
            app = conf.celery_app()
            if app is not None:  # handed over as `celery -A proj reliable-beat` does
                head, _, prog_name = prog_name.rpartition(" ")
                extra["parent"] = click.Context(click.Group(head or "manage.py"),
                                                info_name=head or "manage.py",
                                                obj=SimpleNamespace(app=app))
        try:
            reliable_beat.main(args=args, prog_name=prog_name, standalone_mode=True, **extra)
        except SystemExit as exc:
            return int(exc.code or 0) if not isinstance(exc.code, str) else 1
        return 0
