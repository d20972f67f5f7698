"""A Celery app whose tasks have fixed signatures, and a ``beat_schedule`` with entries whose
arguments cannot fit them (``entries add`` refuses those by name; ``schedule sync`` and a
beat's start name them at ERROR and sync them all).

Broker: in-memory (``memory://``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import Celery

from reliable_beat.celery.task import IdempotentTask

app = Celery("argsapp", broker="memory://")
app.conf.timezone = "UTC"


@app.task(name="argsapp.bill", base=IdempotentTask, bind=True)
def bill(self: Any, amount: int) -> None:
    """A bound task: ``self`` is not an argument of the entry."""


@app.task(name="argsapp.plain")
def plain(amount: int, currency: str = "EUR") -> None:
    """A plain task with one required and one optional argument."""


@app.task(name="argsapp.anything")
def anything(*args: Any, **kwargs: Any) -> None:
    """Takes any arguments."""


@app.task(name="argsapp.untyped", typing=False)
def untyped(amount: int) -> None:
    """``typing=False``: Celery does not check its arguments, nor do we."""


def inject_session(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator that supplies the first argument itself (``functools.wraps``: the
    wrapper's ``__wrapped__`` signature has one argument more than the task takes)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn("SESSION", *args, **kwargs)
    return wrapper


@app.task(name="argsapp.wrapped")
@inject_session
def wrapped(session: str, merchant: str) -> str:
    """Called with ``merchant`` only: Celery runs it (``apply(args=["m1"])``)."""
    return merchant


GOOD = {
    "good-bill": {"task": "argsapp.bill", "schedule": 60, "args": [5]},
    "good-plain": {"task": "argsapp.plain", "schedule": 60, "kwargs": {"amount": 1}},
    "good-any": {"task": "argsapp.anything", "schedule": 60, "args": [1, 2, 3],
                 "kwargs": {"x": 1}},
    "good-untyped": {"task": "argsapp.untyped", "schedule": 60, "args": [1, 2, 3]},
    "elsewhere": {"task": "other.app.task", "schedule": 60, "args": [1, 2, 3]},
    "good-wrapped": {"task": "argsapp.wrapped", "schedule": 60, "args": ["m1"]},
}
BAD = {
    "bill-missing": {"task": "argsapp.bill", "schedule": 60},
    "bill-too-many": {"task": "argsapp.bill", "schedule": 60, "args": [1, 2, 3]},
    "plain-wrong-kwarg": {"task": "argsapp.plain", "schedule": 60, "kwargs": {"amt": 1}},
}
app.conf.beat_schedule = {**GOOD, **BAD}
