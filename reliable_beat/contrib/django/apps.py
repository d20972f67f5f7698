"""The Django app ``reliable_beat.contrib.django`` (add it to ``INSTALLED_APPS``)."""

from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate

from reliable_beat import joins
from reliable_beat.contrib.django import conf
from reliable_beat.contrib.django.join import JOIN
from reliable_beat.contrib.django.signals import on_post_migrate
from reliable_beat.settings import register_database_url_source


class ReliableBeatConfig(AppConfig):
    """Admin pages over the reliable_beat tables, ``manage.py reliable_beat``, migrations,
    and a task's ``self.transaction()`` on Django's connection (:mod:`.join`)."""

    name = "reliable_beat.contrib.django"
    label = "reliable_beat"
    verbose_name = "Reliable beat"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Without a reliable_beat_database_url setting, beats, workers, relays and the CLI
        # of this project use the Django database (their banners say so).
        register_database_url_source("django", conf.database_url_source)

        # A task's self.transaction() joins Django's connection when the store is a Django
        # database, and refuses ORM writes on another connection inside it (invariant 10).
        joins.register(JOIN)

        post_migrate.connect(on_post_migrate, sender=self,
                             dispatch_uid="reliable_beat_post_migrate")
