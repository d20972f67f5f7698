"""Values at the edges (issue 12): kombu-compatible JSON and the store's limits, no I/O."""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from kombu.utils import json as kombu_json

from reliable_beat.entries import EntryDefinition, definition_from_celery
from reliable_beat.errors import ConfigurationError, EntryValidationError
from reliable_beat.settings import Settings
from reliable_beat.values import (
    MAX_ENTRY_NAME,
    ValueLimitError,
    check_entry_name,
    check_length,
    to_json_value,
)

NOW = datetime(2026, 3, 1, tzinfo=timezone.utc)
AT = datetime(2026, 3, 1, 12, 30, tzinfo=timezone.utc)


def _define(raw: dict[str, Any], name: str = "e") -> EntryDefinition:
    return definition_from_celery(name, raw, default_timezone="UTC", settings=Settings(),
                                  now=NOW)


@pytest.mark.parametrize("value", [
    None, True, 3, 2.5, "x", [1, (2, 3)], {"a": {"b": [None]}},
    AT, datetime(2026, 3, 1, 12, 30), date(2026, 3, 1), time(12, 30, 1),
    Decimal("12.50"), Decimal("-1E+3"), uuid.uuid4(), b"bytes", b"\xff\xfe",
    {"when": AT, "amounts": [Decimal("0.1"), Decimal("0.2")], "ids": (uuid.uuid4(),)},
    {1: "int key", False: "bool key", 2.5: "float key"},
])
def test_encoding_is_kombus(value: Any) -> None:
    """What we store is what Celery's JSON serializer puts on the wire, and decodes back."""
    assert to_json_value(value) == json.loads(kombu_json.dumps(value))
    assert kombu_json.loads(json.dumps(to_json_value(value))) == kombu_json.loads(
        kombu_json.dumps(value))


@pytest.mark.parametrize(("value", "where"), [
    ([1, {"x": object()}], "args[1]['x']"),
    ({"rate": float("nan")}, "args['rate']"),
    (["a\x00b"], "NUL"),
    ([timedelta(seconds=1)], "timedelta"),
])
def test_values_json_cannot_carry_are_named(value: Any, where: str) -> None:
    with pytest.raises(ValueError, match=__import__("re").escape(where)):
        to_json_value(value, "args")


def test_beat_schedule_arguments_celery_accepts_are_accepted_with_kombus_encoding() -> None:
    """Stock beat sends these through Celery's JSON serializer; main refused the entry."""
    args = [AT, Decimal("9.99"), uuid.UUID(int=7)]
    kwargs = {"day": AT.date()}
    entry = _define({"task": "t", "schedule": 60, "args": args, "kwargs": kwargs})
    assert entry.args == json.loads(kombu_json.dumps(args))
    assert entry.kwargs == json.loads(kombu_json.dumps(kwargs))
    assert kombu_json.loads(json.dumps(entry.args)) == args  # the worker's decoder


def test_beat_schedule_argument_nothing_carries_is_refused_naming_entry_and_argument() -> None:
    with pytest.raises(EntryValidationError) as info:
        _define({"task": "t", "schedule": 60, "args": [1, object()],
                 "kwargs": {"when": timedelta(1)}}, name="nightly")
    text = str(info.value)
    assert "entry 'nightly'" in text and "args[1]" in text and "kwargs['when']" in text


@pytest.mark.parametrize("name", [
    "n" * (MAX_ENTRY_NAME + 1), "two\nlines", "red\x1b[31m", "tab\there", "del\x7f",
])
def test_entry_names_over_the_limit_or_with_control_characters_are_refused(name: str) -> None:
    with pytest.raises(EntryValidationError, match="entry name"):
        _define({"task": "t", "schedule": 60}, name=name)
    with pytest.raises(ValueLimitError):
        check_entry_name(name)


def test_entry_name_at_the_limit_is_accepted() -> None:
    name = "n" * MAX_ENTRY_NAME
    assert _define({"task": "t", "schedule": 60}, name=name).name == name
    assert check_entry_name("ünïcode names · fine") == "ünïcode names · fine"


def test_length_error_names_value_and_limit() -> None:
    with pytest.raises(ConfigurationError, match="is 401 characters long; the limit is 400"):
        check_length("idempotency key", "k" * 401, 400)
    assert check_length("idempotency key", "k" * 400, 400) == "k" * 400


def test_from_json_value_inverts_to_json_value() -> None:
    import uuid as _uuid
    from datetime import date, datetime, time, timezone
    from decimal import Decimal

    from reliable_beat.values import from_json_value, to_json_value

    value = {"d": Decimal("1.10"), "at": datetime(2026, 1, 10, 12, tzinfo=timezone.utc),
             "day": date(2026, 1, 10), "t": time(12, 30), "u": _uuid.uuid4(),
             "b": b"text", "bin": b"\x00\xff", "n": [1, "x", None, {"k": 2.5}]}
    back = from_json_value(to_json_value(value))
    assert back == value and {k: type(v) for k, v in back.items()} == {
        k: type(v) for k, v in value.items()}
    # not a typed object of a known type, or a value that does not decode: kept as is
    for odd in ({"__type__": "nope", "__value__": 1}, {"__type__": "decimal", "__value__": "x"},
                {"__type__": "decimal", "__value__": "1", "extra": 1}):
        assert from_json_value(odd) == odd
