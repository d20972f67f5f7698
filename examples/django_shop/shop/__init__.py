"""The shop project. Its Celery app is exported as ``celery_app`` (Celery's Django layout):
shared tasks bind to it, and reliable_beat's admin and ``manage.py reliable_beat`` find it
without ``RELIABLE_BEAT["CELERY_APP"]``."""

from examples.django_shop.shop.celery import app as celery_app

__all__ = ["celery_app"]
