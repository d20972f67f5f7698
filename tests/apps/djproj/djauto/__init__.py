"""A Django project laid out as Celery's Django docs show (``proj/__init__.py`` exports
``celery_app``), with NO ``reliable_beat_database_url`` setting: the store is derived from
``DATABASES["default"]``. Used by tests/acceptance/test_django_store.py and tests/django."""

from djauto.celery import app as celery_app

__all__ = ["celery_app"]
