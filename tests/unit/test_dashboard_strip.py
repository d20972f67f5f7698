"""The strip's SVG (reliable_beat.web.timeline.strip_svg) is built from trusted constants:
a cell's link quotes the run's key as one path segment, which leaves nothing the CLI's
redaction could match (so the link is not passed through it); a title quoting a stored
value is redacted, every title escaped."""

from __future__ import annotations

from datetime import datetime, timezone
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reliable_beat.redaction import redact_text

timeline = pytest.importorskip("reliable_beat.web.timeline")


@given(st.text())
def test_a_quoted_segment_is_left_alone_by_the_redaction(key: str) -> None:
    segment = quote(key, safe="")
    assert redact_text(segment) == segment


@pytest.mark.parametrize("key", ["job@x token=abc://u:pw@h/", "Bearer s3cr3t", "a/b?c=d"])
def test_known_secret_shapes_quote_to_inert_segments(key: str) -> None:
    segment = quote(key, safe="")
    assert redact_text(segment) == segment


def test_titles_are_escaped_and_stored_text_redacted() -> None:
    at = datetime(2026, 5, 1, 2, 0, tzinfo=timezone.utc)
    cells = [timeline.Cell(at, "dead", "x · redis://u:hunter2@h/0 <b>", "k<1>@t", True),
             timeline.Cell(at, "gap", "y <i>", None)]
    svg = str(timeline.strip_svg(cells, "/pre<fix>", 2))
    assert "hunter2" not in svg and "redis://u:***@h/0 &lt;b&gt;" in svg
    assert "<title>y &lt;i&gt;</title>" in svg
    assert 'href="/pre&lt;fix&gt;/runs/k%3C1%3E%40t" data-outcome="dead"' in svg
    assert '<g data-outcome="gap">' in svg and svg.count("<title>") == 2
