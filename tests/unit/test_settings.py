"""Settings: unknown keys and wrong types are errors naming the key; defaults stand."""

from __future__ import annotations

import pytest

from reliable_beat.errors import ConfigurationError
from reliable_beat.settings import Settings


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="reliable_beat_lease_seconds") as info:
        Settings.from_mapping({"reliable_beat_lease_secs": 5})
    assert "reliable_beat_lease_secs" in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("reliable_beat_lease_seconds", "abc"), ("reliable_beat_misfire_grace_seconds", -1),
     ("reliable_beat_batch_size", 0), ("reliable_beat_batch_size", 2.5),
     ("reliable_beat_run_migrations", "yes"), ("reliable_beat_misfire_policy", "sometimes"),
     ("reliable_beat_retry_base_seconds", 0), ("reliable_beat_claim_ahead_seconds", -0.5),
     ("reliable_beat_claim_ahead_seconds", 61), ("reliable_beat_catch_up_limit", 10_001)],
)
def test_bad_values_name_the_setting(key: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=key):
        Settings.from_mapping({key: value})


def test_defaults_and_other_keys_ignored() -> None:
    s = Settings.from_mapping({"broker_url": "memory://", "reliable_beat_batch_size": 7})
    assert s.batch_size == 7 and s.lease_seconds == 60.0 and s.metrics_port is None


def test_claim_ahead_default_and_off() -> None:
    assert Settings.from_mapping({}).claim_ahead_seconds == 0.5
    assert Settings.from_mapping({"reliable_beat_claim_ahead_seconds": 0}).claim_ahead_seconds == 0


# -- the forms Celery apps carry settings in (issue 11) ------------------------------------

def _app(namespace: str | None = None, **module: object) -> object:
    import types

    from celery import Celery

    mod = types.SimpleNamespace(**module)
    app = Celery("t", set_as_current=False)
    app.config_from_object(mod, namespace=namespace)
    return app


def test_celery_namespace_upper_case_forms() -> None:
    app = _app("CELERY", CELERY_RELIABLE_BEAT_DATABASE_URL="postgresql://h/db",
               CELERY_RELIABLE_BEAT_LEASE_SECONDS=5, RELIABLE_BEAT_BATCH_SIZE=7)
    s = Settings.from_celery(app)
    assert (s.database_url, s.lease_seconds, s.batch_size) == ("postgresql://h/db", 5, 7)
    assert s.database_url_key == "CELERY_RELIABLE_BEAT_DATABASE_URL"


def test_layers_resolve_as_celery_resolves_them() -> None:
    # Celery 5.7 lets app.conf override the loaded object (9); Celery 5.3 prefers the
    # namespaced key of any layer (5). Ours is whatever this Celery says.
    app = _app("CELERY", CELERY_RELIABLE_BEAT_LEASE_SECONDS=5)
    app.conf.reliable_beat_lease_seconds = 9  # type: ignore[attr-defined]
    celery_says = app.conf.get("reliable_beat_lease_seconds")  # type: ignore[attr-defined]
    assert celery_says in (5, 9)
    assert Settings.from_celery(app).lease_seconds == celery_says


def test_plain_object_and_app_conf_forms() -> None:
    app = _app(None, reliable_beat_database_url="postgresql://a/b", RELIABLE_BEAT_LEASE_SECONDS=3)
    s = Settings.from_celery(app)
    assert (s.database_url, s.lease_seconds) == ("postgresql://a/b", 3)
    app = _app("CELERY", reliable_beat_batch_size=4)
    assert Settings.from_celery(app).batch_size == 4


def test_namespaced_typo_is_an_error_naming_the_key_and_the_fix() -> None:
    app = _app("CELERY", CELERY_RELIABLE_BEAT_LEASE_SECOND=5)
    with pytest.raises(ConfigurationError) as info:
        Settings.from_celery(app)
    text = str(info.value)
    assert "CELERY_RELIABLE_BEAT_LEASE_SECOND (did you mean CELERY_RELIABLE_BEAT_LEASE_SECONDS?)" \
        in text
    assert "reliable_beat_database_url" in text


def test_namespaced_keys_without_the_namespace_are_an_error() -> None:
    app = _app(None, CELERY_RELIABLE_BEAT_DATABASE_URL="postgresql://h/db")
    with pytest.raises(ConfigurationError,
                       match=r"CELERY_RELIABLE_BEAT_DATABASE_URL.*no namespace"):
        Settings.from_celery(app)


def test_two_forms_with_different_values_are_an_error() -> None:
    with pytest.raises(ConfigurationError, match="given twice"):
        Settings.from_mapping({"CELERY_RELIABLE_BEAT_LEASE_SECONDS": 5,
                               "reliable_beat_lease_seconds": 6}, namespace="CELERY")
    same = Settings.from_mapping({"CELERY_RELIABLE_BEAT_LEASE_SECONDS": 5,
                                  "reliable_beat_lease_seconds": 5}, namespace="CELERY")
    assert same.lease_seconds == 5


def test_default_store_warning_names_the_setting_in_the_apps_form() -> None:
    plain = Settings.from_mapping({})
    if plain.database_url != "sqlite:///reliable_beat.sqlite3":
        pytest.skip("RELIABLE_BEAT_DATABASE_URL is set in this environment")
    assert "reliable_beat_database_url" in (plain.default_store_warning("worker") or "")
    namespaced = Settings.from_celery(_app("CELERY"))
    assert "CELERY_RELIABLE_BEAT_DATABASE_URL" in (namespaced.default_store_warning("beat") or "")
    assert Settings(database_url="postgresql://h/db").default_store_warning("beat") is None


# -- the app's time zone, as Celery resolves it ----------------------------------------------

def test_celery_timezone_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery

    from reliable_beat.settings import celery_timezone

    app = Celery("t", set_as_current=False)
    assert celery_timezone(app) == "UTC"  # enable_utc=True, no timezone
    app = Celery("t", set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    assert celery_timezone(app) == "Europe/Berlin"
    monkeypatch.setenv("TZ", "America/New_York")
    app = Celery("t", set_as_current=False)
    app.conf.enable_utc = False  # no timezone: Celery uses the host's local zone
    assert celery_timezone(app) == "America/New_York"
    monkeypatch.setenv("TZ", ":/usr/share/zoneinfo/Asia/Tokyo")
    assert celery_timezone(app) == "Asia/Tokyo"
    # Django's TIME_ZONE under the CELERY namespace is Celery's timezone too.
    app = _app("CELERY", TIME_ZONE="Europe/Paris")
    assert celery_timezone(app) == "Europe/Paris"


def test_host_zone_without_an_iana_name_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery

    from reliable_beat.settings import celery_timezone

    monkeypatch.setenv("TZ", "EST5EDT-nonsense")
    app = Celery("t", set_as_current=False)
    app.conf.enable_utc = False
    with pytest.raises(ConfigurationError, match="timezone"):
        celery_timezone(app)


@pytest.mark.parametrize("key, namespace", [
    ("CELERY_RELIABLE_BEAT_LEASE_SECONDS", "CELERY"),
    ("RELIABLE_BEAT_LEASE_SECONDS", None),
    ("reliable_beat_lease_seconds", None),
])
def test_a_bad_value_is_named_as_the_user_wrote_it(key: str, namespace: str | None) -> None:
    with pytest.raises(ConfigurationError) as err:
        Settings.from_mapping({key: "abc", "reliable_beat_batch_size": -1}, namespace=namespace)
    message = str(err.value)
    assert f"{key}='abc'" in message, message
    assert "reliable_beat_batch_size=-1" in message, message  # the other one, as written
