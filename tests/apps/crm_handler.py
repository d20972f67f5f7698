"""User outbox handlers with a ``validate(payload)`` hook
(tests/integration/test_outbox_payload_checks.py)."""

from __future__ import annotations

from typing import Any

delivered: list[Any] = []


class CrmHandler:
    """Delivers ``{"customer": int, ...}``; refuses any other payload where it is written."""

    def __call__(self, message: Any) -> None:
        delivered.append(message.payload)

    @staticmethod
    def validate(payload: Any) -> None:
        if not isinstance(payload, dict) or not isinstance(payload.get("customer"), int):
            raise ValueError("crm rows need 'customer': an integer id")


class InstanceHook:
    """A class whose ``validate`` needs an instance: a configuration error."""

    def __call__(self, message: Any) -> None: ...

    def validate(self, payload: Any) -> None: ...


class NoHook:
    """A handler without a hook: its rows are not checked."""

    def __call__(self, message: Any) -> None: ...
