"""The Django app ``reliable_beat.contrib.django`` (add it to ``INSTALLED_APPS``)."""

from __future__ import annotations

from django.apps import AppConfig


class ReliableBeatConfig(AppConfig):
    """Admin pages over the reliable_beat tables, ``manage.py reliable_beat``, migrations."""

    name = "reliable_beat.contrib.django"
    label = "reliable_beat"
    verbose_name = "Reliable beat"
    default_auto_field = "django.db.models.BigAutoField"
