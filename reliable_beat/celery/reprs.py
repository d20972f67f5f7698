"""What Celery shows of a trigger's arguments: ``argsrepr`` / ``kwargsrepr`` with secrets masked.

Celery puts a ``repr`` of every message's arguments in its headers (``argsrepr``,
``kwargsrepr``); its worker logs them (the ``extra`` data of the "received" and failure log
records), sends them in events (Flower shows them) and answers ``celery inspect
active / reserved`` with them. Messages published by reliable_beat (a beat's and a relay's
triggers, ``IdempotentTask.apply_async``) carry these reprs
redacted by :func:`reliable_beat.redaction.redact_text`: a keyword argument with a
credential's name (``api_key``, ``password``, ``token``, a bare ``key``, ...) is shown as
``'***'``, and so is a ``name=value`` credential or a URL's password inside a string.
The task still receives its real arguments: only what is *shown* changes.
"""

from __future__ import annotations

from typing import Any

from celery.utils.saferepr import saferepr

from reliable_beat.redaction import redact_text

__all__ = ["shown_reprs"]


def shown_reprs(app: Any, args: Any, kwargs: Any) -> tuple[str, str]:
    """``(argsrepr, kwargsrepr)`` of a message of ``app`` with these arguments, redacted.

    Celery's own reprs (``saferepr`` with ``app.amqp.argsrepr_maxsize``,
    ``kwargsrepr_maxsize`` and ``task_repr_maxlevels``), passed through
    :func:`~reliable_beat.redaction.redact_text`: a repr shows each keyword argument as a
    quoted ``'name': value`` pair, which the text rules mask for a credential's name (a bare
    ``key`` included), and a string argument's own ``name=value`` pairs and URLs. A repr
    without a credential's name costs a few substring checks more than Celery's.
    """
    maxlevels = app.conf.get("task_repr_maxlevels", 3)
    return (
        redact_text(saferepr(args or (), app.amqp.argsrepr_maxsize, maxlevels=maxlevels)),
        redact_text(saferepr(kwargs or {}, app.amqp.kwargsrepr_maxsize, maxlevels=maxlevels)),
    )
