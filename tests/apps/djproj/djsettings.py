"""Django settings of the test project (``tests/apps/djproj``), from the environment.

* ``RB_DATABASE_URL``: SQLAlchemy URL of the PostgreSQL database (Django's ``default`` and
  the reliable_beat store: one database, so effect and key commit together);
* ``RB_DJANGO_DRIVER``: ``psycopg`` (default) or ``psycopg2``: hides psycopg 3 from this
  process so that Django's PostgreSQL backend falls back to psycopg2.
"""

from __future__ import annotations

import os
import sys

import sqlalchemy as sa

if os.environ.get("RB_DJANGO_DRIVER") == "psycopg2":
    sys.modules["psycopg"] = None  # type: ignore[assignment]  # Django then uses psycopg2

_url = sa.engine.make_url(os.environ.get("RB_DATABASE_URL", "postgresql:///rb"))

SECRET_KEY = "test-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.database,
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.host or "",
        "PORT": str(_url.port or ""),
        "CONN_MAX_AGE": int(os.environ.get("RB_CONN_MAX_AGE", "0")),
        "ATOMIC_REQUESTS": True,
    }
}
# The same database under another alias (what a router may pick), and another database on
# the same server: a transaction there cannot hold the key.
DATABASES["other"] = {**DATABASES["default"]}
DATABASES["elsewhere"] = {**DATABASES["default"], "NAME": "postgres"}
# A second database of the project, to hold the store there (created by the test that uses
# it; no request opens a transaction on it).
DATABASES["second"] = {**DATABASES["default"], "NAME": f"{_url.database}_second",
                       "ATOMIC_REQUESTS": False}
# Backends the store URL is derived from without connecting (tests/django/test_store_url.py):
# MySQL/MariaDB (no mysqlclient needed), a SQLite file, and an unsupported ENGINE.
DATABASES["maria"] = {"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "shop",
                      "PASSWORD": "s3cret-maria", "HOST": "db.internal", "PORT": "3307",
                      "OPTIONS": {"charset": "utf8mb4"}}
DATABASES["lite"] = {"ENGINE": "django.db.backends.sqlite3",
                     "NAME": os.path.join(os.environ.get("RB_SQLITE_DIR", "/tmp"), "rb.sqlite3")}
DATABASES["legacy"] = {"ENGINE": "django.db.backends.oracle", "NAME": "xe"}
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "reliable_beat.contrib.django",
    "djshop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "djurls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
