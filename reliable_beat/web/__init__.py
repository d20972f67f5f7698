"""The web dashboard (``reliable-beat dashboard``; the ``reliable-beat[web]`` extra).

Server-rendered pages from the store: the overview (the alarms of ``status``, heartbeats,
outbox backlog, workflows by state), the entries with a slot timeline each, an entry's page
(next fires in its zone, runs, actions), runs, dead letters, workflows, the outbox and the
audit of operator actions. :func:`create_app` returns the ASGI app, to serve with
:func:`serve` or to mount in another ASGI app at a prefix.

Modules: :mod:`~reliable_beat.web.app` (routes, templates), :mod:`~reliable_beat.web.auth`
(tokens, roles, CSRF, the bind rule), :mod:`~reliable_beat.web.actions` (the operator
actions and their audit), :mod:`~reliable_beat.web.queries` (what the pages read),
:mod:`~reliable_beat.web.timeline` (the slot strips), :mod:`~reliable_beat.web.alarms`.
"""

from __future__ import annotations

from reliable_beat.web.app import DashboardConfig, create_app
from reliable_beat.web.auth import AuthConfig, check_bind
from reliable_beat.web.serve import serve

__all__ = ["AuthConfig", "DashboardConfig", "check_bind", "create_app", "serve"]
