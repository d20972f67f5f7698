"""The Django app ``reliable_beat.contrib.django`` (add it to ``INSTALLED_APPS``)."""

from __future__ import annotations

from django.apps import AppConfig


class ReliableBeatConfig(AppConfig):
    """Admin pages over the reliable_beat tables, ``manage.py reliable_beat``, migrations."""

    name = "reliable_beat.contrib.django"
    label = "reliable_beat"
    verbose_name = "Reliable beat"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from reliable_beat.contrib.django.signals import on_post_migrate

        post_migrate.connect(on_post_migrate, sender=self,
                             dispatch_uid="reliable_beat_post_migrate")
