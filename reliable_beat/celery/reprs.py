"""What Celery shows of a trigger's arguments: ``argsrepr`` / ``kwargsrepr`` with secrets masked.

Celery puts a ``repr`` of every message's arguments in its headers (``argsrepr``,
``kwargsrepr``); its worker logs them (the ``extra`` data of the "received" and failure log
records), sends them in events (Flower shows them) and answers ``celery inspect
active / reserved`` with them. Messages published by reliable_beat (a beat's and a relay's
triggers, ``IdempotentTask.apply_async``, a dead letter's requeue) carry these reprs
computed from the arguments passed through :func:`reliable_beat.redaction.redact_value`:
a keyword argument with a credential's name (``api_key``, ``password``, ``token``, a bare
``key``, ...) is shown as ``'***'``, and a string argument as :func:`redact_text` shows it.
The task still receives its real arguments: only what is *shown* changes.
"""

from __future__ import annotations

from typing import Any

from celery.utils.saferepr import saferepr

from reliable_beat.redaction import redact_value

__all__ = ["shown_reprs"]


def shown_reprs(app: Any, args: Any, kwargs: Any) -> tuple[str, str]:
    """``(argsrepr, kwargsrepr)`` of a message of ``app`` with these arguments, redacted.

    The same sizes and depth as Celery's own (``app.amqp.argsrepr_maxsize``,
    ``kwargsrepr_maxsize``, ``task_repr_maxlevels``); ``args`` keeps its type (a list shows
    as ``[...]``, a tuple or nothing as ``(...)``), as Celery shows it.
    """
    maxlevels = app.conf.get("task_repr_maxlevels", 3)
    args_ = args or ()
    shown_args = redact_value(list(args_), user_data=True)
    shown_kwargs = redact_value(dict(kwargs or {}), user_data=True)
    return (
        saferepr(shown_args if isinstance(args_, list) else tuple(shown_args),
                 app.amqp.argsrepr_maxsize, maxlevels=maxlevels),
        saferepr(shown_kwargs, app.amqp.kwargsrepr_maxsize, maxlevels=maxlevels),
    )
