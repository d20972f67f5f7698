"""The app an operator's verb runs with: its ``reliable_beat_*`` settings and its time zone,
resolved the same way for the command line, the Django admin and the dashboard.

:class:`OperatorContext` is what a verb that needs the app, the store and the settings
together takes (:func:`reliable_beat.ops.entries.build_definition`); the command line's
:class:`~reliable_beat.cli.CliContext` is one, :class:`Operator` another (the Django admin's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from reliable_beat.adapters import adapter_for, app_settings
from reliable_beat.db.dialects import Store
from reliable_beat.settings import Settings

__all__ = ["Operator", "OperatorContext", "app_timezone", "settings_for"]


def settings_for(app: Any, database_url: str | None = None,
                 origin: str = "--database-url") -> Settings:
    """The settings of ``app`` (its adapter's :func:`~reliable_beat.adapters.app_settings`),
    with ``database_url`` (said to come from ``origin``) over the app's store URL when given;
    without an app, the defaults with that URL, else the defaults.

    Raises:
        ConfigurationError: a setting of the app is invalid.
    """
    given = (database_url, origin) if database_url else None
    if app is not None:
        return app_settings(app, database_url=given)
    if given is not None:
        return Settings.with_database_url(*given)
    return Settings()


def app_timezone(app: Any) -> str:
    """The IANA zone ``app`` evaluates schedules in (its adapter's
    :meth:`~reliable_beat.adapters.AppAdapter.app_timezone`: Celery's ``app.timezone``), the
    zone of entries that set none; UTC without an app."""
    if app is None:
        return "UTC"
    return adapter_for(app).app_timezone(app)


class OperatorContext(Protocol):
    """The app (None: none given), the store, the settings and the app's zone."""

    @property
    def app(self) -> Any: ...

    @property
    def store(self) -> Store: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def app_timezone(self) -> str: ...


@dataclass
class Operator:
    """An :class:`OperatorContext` over a store already open: the settings are read from the
    app (:func:`settings_for`) when first asked for, as the command line reads them."""

    app: Any
    store: Store
    database_url: str | None = field(default=None, repr=False)  # may hold a password
    _settings: Settings | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = settings_for(self.app, self.database_url)
        return self._settings

    @property
    def app_timezone(self) -> str:
        return app_timezone(self.app)
