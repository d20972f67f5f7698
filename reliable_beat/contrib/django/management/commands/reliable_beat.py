"""``python manage.py reliable_beat ...``: the ``reliable-beat`` CLI with Django's settings.

The store is :func:`reliable_beat.contrib.django.conf.store_url` (the Django database unless
``RELIABLE_BEAT["DATABASE_URL"]`` says otherwise) and ``-A`` is ``RELIABLE_BEAT["CELERY_APP"]``.
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
from typing import Any

from django.core.management.base import BaseCommand

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
        from reliable_beat.cli import reliable_beat

        args = list(args)
        if args[:2] == ["import", "django-celery-beat"]:
            args = ["entries", *args]
            if "--from-url" not in args:
                args += ["--from-url", database_url("default")]
        head = ["--database-url", conf.store_url()]
        app = conf.option("CELERY_APP")
        if app and "-A" not in args and "--app" not in args:
            head = ["-A", str(app), *head]
        try:
            reliable_beat.main(args=head + args, prog_name=prog_name, standalone_mode=True)
        except SystemExit as exc:
            return int(exc.code or 0) if not isinstance(exc.code, str) else 1
        return 0
