"""The store is the Django database when no ``reliable_beat_database_url`` is set (the
source the app registers in ``AppConfig.ready()``), and every process says where its store
came from. In-process, on the child's real PostgreSQL (run by tests/integration/test_django.py,
psycopg 3 and psycopg2); the real beat/worker/status processes are in
tests/acceptance/test_django_store.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from django.conf import settings as django_settings
from django.test import override_settings

from reliable_beat.contrib.django import database_url
from reliable_beat.errors import ConfigurationError
from reliable_beat.settings import Settings, database_url_from_sources

FROM_DJANGO = "Django DATABASES['default']"


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("RELIABLE_BEAT_DATABASE_URL", raising=False)
    yield


def test_without_a_setting_the_store_is_the_django_database() -> None:
    assert database_url_from_sources() == (database_url("default"), FROM_DJANGO)
    s = Settings()
    assert s.database_url == database_url("default")
    assert s.database_url.startswith(f"postgresql+{os.environ['RB_DJANGO_DRIVER']}://")
    assert s.database_url_origin == FROM_DJANGO
    assert not s.is_default_store and s.default_store_warning("beat") is None
    # Celery's Django layout: settings without the key, read with the CELERY namespace
    s = Settings.from_mapping({"CELERY_RELIABLE_BEAT_LEASE_SECONDS": 5.0}, namespace="CELERY")
    assert s.database_url == database_url("default") and s.database_url_origin == FROM_DJANGO


def test_the_banner_text_hides_the_password() -> None:
    with override_settings(RELIABLE_BEAT={"DATABASE_ALIAS": "maria"}):
        s = Settings()
        assert s.database_url == ("mysql+pymysql://shop:s3cret-maria@db.internal:3307/shop"
                                  "?charset=utf8mb4")
        assert s.database_url_text == ("mysql+pymysql://shop:***@db.internal:3307/shop"
                                       "?charset=utf8mb4 (from Django DATABASES['maria'])")
        assert "s3cret" not in repr(s)


def test_any_form_of_the_setting_wins() -> None:
    other = "postgresql+psycopg://u:pw@elsewhere:5432/other"
    for conf_map, ns, key in [
        ({"reliable_beat_database_url": other}, None, "reliable_beat_database_url"),
        ({"CELERY_RELIABLE_BEAT_DATABASE_URL": other}, "CELERY",
         "CELERY_RELIABLE_BEAT_DATABASE_URL"),
        ({"RELIABLE_BEAT_DATABASE_URL": other}, "CELERY", "RELIABLE_BEAT_DATABASE_URL"),
    ]:
        s = Settings.from_mapping(conf_map, namespace=ns)
        assert (s.database_url, s.database_url_origin) == (other, key)


def test_the_environment_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELIABLE_BEAT_DATABASE_URL", "sqlite:////tmp/env.sqlite3")
    s = Settings()
    assert s.database_url == "sqlite:////tmp/env.sqlite3"
    assert s.database_url_origin == "$RELIABLE_BEAT_DATABASE_URL"


def test_the_reliable_beat_dict_names_the_url_or_the_alias() -> None:
    with override_settings(RELIABLE_BEAT={"DATABASE_URL": "sqlite:////tmp/dict.sqlite3"}):
        s = Settings()
        assert s.database_url == "sqlite:////tmp/dict.sqlite3"
        assert s.database_url_origin == "Django RELIABLE_BEAT['DATABASE_URL']"
    with override_settings(RELIABLE_BEAT={"DATABASE_ALIAS": "lite"}):
        s = Settings()
        assert s.database_url == "sqlite:///" + os.path.abspath(
            django_settings.DATABASES["lite"]["NAME"])
        assert s.database_url_origin == "Django DATABASES['lite']"


def test_an_unsupported_engine_is_a_clear_error_naming_the_fix() -> None:
    with override_settings(RELIABLE_BEAT={"DATABASE_ALIAS": "legacy"}), \
            pytest.raises(ConfigurationError) as info:
        Settings()
    message = str(info.value)
    assert "DATABASES['legacy']" in message and "django.db.backends.oracle" in message
    assert "RELIABLE_BEAT = {'DATABASE_URL'" in message
    assert "CELERY_RELIABLE_BEAT_DATABASE_URL" in message
    # ... and a setting given: nothing is derived, nothing fails
    with override_settings(RELIABLE_BEAT={"DATABASE_ALIAS": "legacy"}):
        s = Settings.from_mapping({"reliable_beat_database_url": "sqlite:////tmp/x.sqlite3"})
        assert s.database_url_origin == "reliable_beat_database_url"


def test_mysql_cannot_be_joined_and_says_what_to_do_instead() -> None:
    from reliable_beat.contrib.django import atomic_connection

    with pytest.raises(ConfigurationError, match="MySQL/MariaDB"), atomic_connection("maria"):
        pass


@pytest.mark.parametrize(("engine", "host", "port", "expected", "socket_key"), [
    ("django.db.backends.postgresql", "/tmp/a4pg", "55434",
     f"postgresql+{os.environ.get('RB_DJANGO_DRIVER', 'psycopg')}://postgres@/shop"
     "?host=%2Ftmp%2Fa4pg&port=55434", "host"),
    ("django.db.backends.mysql", "/run/mysqld/mysqld.sock", "",
     "mysql+pymysql://postgres@/shop?unix_socket=%2Frun%2Fmysqld%2Fmysqld.sock",
     "unix_socket"),
])
def test_a_unix_socket_host_goes_in_the_query_and_round_trips(
        engine: str, host: str, port: str, expected: str, socket_key: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Django ``HOST`` that is a path is a Unix socket (directory): the store URL names it
    where the driver takes it, so the store connects to that server, not the default one."""
    from sqlalchemy.engine import make_url

    from reliable_beat.joins import same_database

    monkeypatch.setitem(django_settings.DATABASES, "sock", {
        "ENGINE": engine, "NAME": "shop", "USER": "postgres", "HOST": host, "PORT": port})
    url = database_url("sock")
    assert url == expected
    parsed = make_url(url)
    assert parsed.database == "shop" and parsed.host is None
    assert parsed.query[socket_key] == host
    assert parsed.query.get("port") == (port or None)
    other_dir = parsed.update_query_dict({socket_key: "/tmp/elsewhere"})
    assert same_database(parsed, parsed) and not same_database(parsed, other_dir)
