"""Serve the dashboard with uvicorn (``reliable-beat dashboard``)."""

from __future__ import annotations

from typing import Any

import uvicorn

from reliable_beat.db.dialects import Store
from reliable_beat.settings import Settings
from reliable_beat.web.app import create_app
from reliable_beat.web.auth import AuthConfig, check_bind

__all__ = ["serve"]


def serve(store: Store, *, settings: Settings, app: Any = None, host: str = "127.0.0.1",
          port: int = 8477, auth: AuthConfig | None = None, **knobs: Any) -> None:
    """Serve the dashboard until interrupted.

    Raises:
        ConfigurationError: ``host`` is not loopback and no token is configured
            (:func:`~reliable_beat.web.auth.check_bind`); nothing is served.
    """
    auth = auth if auth is not None else AuthConfig.from_sources(settings)
    check_bind(host, auth)
    web = create_app(store, settings=settings, app=app, auth=auth, **knobs)
    uvicorn.run(web, host=host, port=port, log_level="warning", proxy_headers=False,
                server_header=False)
