"""Outbox rows as an earlier version, or a person with SQL access, wrote them: ``outbox.add``
without its write-time payload check, to test what the relay does with such rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from reliable_beat import outbox


@contextmanager
def unchecked() -> Iterator[None]:
    def no_check(*args: Any, **kwargs: Any) -> None:
        return None

    with mock.patch.object(outbox, "check_payload", no_check):
        yield
