"""Tests that run inside a configured Django project (``tests/apps/djproj``).

They are collected only in a child pytest started by ``tests/integration/test_django.py``
(``RB_DJANGO_INNER=1``, with ``DJANGO_SETTINGS_MODULE`` and the database in the
environment), so the main test process stays free of Django's global settings.
"""

from __future__ import annotations

import os

if not os.environ.get("RB_DJANGO_INNER"):
    collect_ignore_glob = ["*.py"]
else:
    import django

    django.setup()
