"""The admin finds the project's Celery app without ``RELIABLE_BEAT["CELERY_APP"]``, the way
Celery's Django integration lays it out (``proj/__init__.py`` exports ``celery_app``), or
``celery.current_app``, and loads its task modules (``autodiscover_tasks``): the entry's
describe page names the task kind. Before, without the setting, it said ``unknown``."""

from __future__ import annotations

import os
import re

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client, override_settings

from reliable_beat import entries as rb_entries
from reliable_beat import schedules as sch
from reliable_beat.contrib.django import conf
from reliable_beat.entries import EntryDefinition


@pytest.fixture(scope="module")
def admin_client() -> Client:
    call_command("migrate", verbosity=0)
    user = User.objects.filter(username="rb-app-admin").first() or \
        User.objects.create_superuser("rb-app-admin", "x@example.com", "pw")
    c = Client()
    c.force_login(user)
    return c


def _entry(task: str) -> int:
    name = f"kind-{os.urandom(3).hex()}"
    rb_entries.save_runtime_entry(conf.store(), EntryDefinition(
        name=name, task=task, schedule=sch.CronSchedule("0 3 * * *", "UTC")), create=True,
        schedule_group="djtask_app")
    return int(rb_entries.get_entry(conf.store(), name)["id"])


def _kind(client: Client, entry_id: int) -> str:
    page = client.get(f"/admin/reliable_beat/entry/{entry_id}/change/").content.decode()
    found = re.search(r"Task kind: (\w+)", page)
    assert found, page[-3000:]
    return found.group(1)


def test_the_project_packages_celery_app_names_an_autodiscovered_task(
        admin_client: Client) -> None:
    with override_settings(SETTINGS_MODULE="djauto.settings", RELIABLE_BEAT={}):
        import djauto

        assert conf.celery_app() is djauto.celery_app
        # djshop.refund lives in djshop/tasks.py: known only once the app's task modules
        # are loaded as a worker loads them
        assert _kind(admin_client, _entry("djshop.refund")) == "idempotent"
        assert _kind(admin_client, _entry("djauto.record")) == "idempotent"
        assert _kind(admin_client, _entry("no.such.task")) == "unknown"


def test_the_current_app_when_the_settings_module_has_no_package(
        admin_client: Client) -> None:
    from djtask_app import app

    app.set_current()
    with override_settings(RELIABLE_BEAT={}):  # SETTINGS_MODULE "djsettings": no package
        assert conf.celery_app() is app
        assert _kind(admin_client, _entry("dj.pay")) == "idempotent"


def test_the_setting_still_wins(admin_client: Client) -> None:
    import djauto

    djauto.celery_app.set_current()
    with override_settings(RELIABLE_BEAT={"CELERY_APP": "djtask_app:app"}):
        from djtask_app import app

        assert conf.celery_app() is app
        assert _kind(admin_client, _entry("dj.pay")) == "idempotent"
