"""Webhook destinations: a row's path never leaves the base URL; the private-address block
(issue 13). Pure functions, no I/O."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reliable_beat.errors import PermanentDeliveryError
from reliable_beat.handlers import WebhookDestination, blocked_reason

DEST = WebhookDestination(name="d", base_url="https://api.example.com:8443/v1/hooks")

ALPHABET = st.sampled_from([*"/.%2eEfF5cC@:?#\\ \r\n\t~-_aZ09",
                            "%2f", "%2e", "%5c", "%252e", "//", ".."])


@settings(max_examples=500, deadline=None)
@given(st.lists(ALPHABET, max_size=20).map("".join))
def test_a_path_never_leaves_the_base(path: str) -> None:
    try:
        url = DEST.url_for(path)
    except PermanentDeliveryError:
        return
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc) == ("https", "api.example.com:8443")
    assert parts.path.startswith("/v1/hooks/")
    segments = [unquote(unquote(s)) for s in parts.path.split("/")]
    assert ".." not in segments and "." not in segments
    assert not any(c in url for c in "\r\n\t #\\")


@pytest.mark.parametrize("path", ["/x?a=1&b=2", "/invoices/42", "/a-b_c~d.e", "/%20x"])
def test_ordinary_paths_are_kept(path: str) -> None:
    assert DEST.url_for(path) == "https://api.example.com:8443/v1/hooks" + path


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"),
    ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),  # the cloud metadata service
    ("fe80::1", "link-local"), ("fc00::1", "private"), ("::ffff:127.0.0.1", "loopback"),
    ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("100.64.0.1", "shared"),
])
def test_blocked_addresses(address: str, reason: str) -> None:
    why = blocked_reason(address)
    assert why is not None and why.startswith(reason), why


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1::1", "8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert blocked_reason(address) is None
