"""Webhook destinations: a row's path never leaves the base URL; the private-address block
(issue 13); header values the HTTP client would refuse. Pure functions, no I/O."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reliable_beat.errors import PermanentDeliveryError
from reliable_beat.handlers import WebhookDestination, blocked_reason
from reliable_beat.webhook_guard import header_value_problem, normalise_path

DEST = WebhookDestination(name="d", base_url="https://api.example.com:8443/v1/hooks")

ALPHABET = st.sampled_from([*"/.%2eEfF5cC@:?#\\ \r\n\t~-_aZ09;\u00e9\u202e\uff0e",
                            "%2f", "%2e", "%5c", "%252e", "%25252e", "%3b", "%00", "//", ".."])


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
    for segment in parts.path.split("/"):
        for _ in range(5):  # every decoded form, as a server decoding repeatedly sees it
            segment = unquote(segment)
            assert segment.strip(".") or not segment, url
            assert ";" not in segment and "\\" not in segment and "\x00" not in segment
    assert url.isascii() and not any(c in url for c in "\r\n\t #\\")


@pytest.mark.parametrize("path", ["/x?a=1&b=2", "/invoices/42", "/a-b_c~d.e", "/%20x"])
def test_ordinary_paths_are_kept(path: str) -> None:
    assert DEST.url_for(path) == "https://api.example.com:8443/v1/hooks" + path


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"),
    ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),  # the cloud metadata service
    ("fe80::1", "link-local"), ("fc00::1", "private"), ("::ffff:127.0.0.1", "loopback"),
    ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("100.64.0.1", "shared"),
    # IPv6 forms that carry a blocked IPv4 address (fails on the old code: only the
    # IPv4-mapped form was looked into)
    ("::ffff:169.254.169.254", "link-local"),
    ("2002:7f00:1::1", "loopback (IPv4 127.0.0.1 embedded in a 6to4"),
    ("2002:a9fe:a9fe::", "link-local (IPv4 169.254.169.254 embedded in a 6to4"),
    ("2002:a00:1::", "private (IPv4 10.0.0.1 embedded in a 6to4"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback (IPv4 127.0.0.1 embedded in a Teredo"),
    ("64:ff9b::7f00:1", "loopback (IPv4 127.0.0.1 embedded in a NAT64"),
    ("64:ff9b::a9fe:a9fe", "link-local (IPv4 169.254.169.254 embedded in a NAT64"),
    ("64:ff9b:1::a00:1", "private (local-use NAT64"),
    ("::127.0.0.1", "loopback (IPv4 127.0.0.1 embedded in a IPv4-compatible"),
    ("::8.8.8.8", "reserved (deprecated IPv4-compatible"),
    ("::ffff:0:7f00:1", "loopback (IPv4 127.0.0.1 embedded in a IPv4-translated"),
    ("fec0::1", "site-local"),
])
def test_blocked_addresses(address: str, reason: str) -> None:
    why = blocked_reason(address)
    assert why is not None and why.startswith(reason), why


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1::1", "8.8.8.8",
                                     "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_pass(address: str) -> None:
    assert blocked_reason(address) is None


@pytest.mark.parametrize(("path", "reason"), [
    ("/..;/admin", "';'"),  # Tomcat/Spring: the ';...' is dropped before '..' is resolved
    ("/a;jsessionid=1/x", "';'"),
    ("/a%3b/x", "';'"),
    ("/%25252e%25252e/admin", "'.' or '..' segment"),  # three rounds of decoding
    ("/%2525252e%2525252e/admin", "'.' or '..' segment"),  # four
    ("/%252525252e/x", "still percent-encoded after 4 rounds"),  # five: refused as such
    ("/%2e%2e%5cadmin", "encoded '/' or '\\'"),
    ("/a%252fb", "encoded '/' or '\\'"),
    ("/.../x", "'.' or '..' segment"),
    ("/..%20/x", "'.' or '..' segment"),  # Windows servers trim the trailing space
    ("/\uff0e\uff0e/admin", "'.' or '..' segment"),  # full-width dots fold to '..'
    ("/x%00.json", "U+0000"),
    ("/x%0d%0aHost:%20evil", "U+000D"),
    ("/x%C2%85y", "U+0085"),  # NEL, a C1 control character once decoded
    ("/\u202egnp.exe", "U+202E"),  # a bidi override: shows as 'exe.png'
    ("/a\u200bb", "U+200B"),
    ("/a b", "' '"),
    ("/a\\b", "'\\\\'"),
    ("/a#b", "'#'"),
    ("//evil.example/x", "a single '/'"),
    ("relative", "a single '/'"),
    (None, "a single '/'"),
])
def test_refused_paths_name_the_reason(path: object, reason: str) -> None:
    """Fails on the old code for the ';', triple-encoded, trimmed, folded, decoded-control
    and invisible cases (they reached the far end)."""
    with pytest.raises(ValueError, match="'path'") as info:
        normalise_path(path)
    assert reason in str(info.value), str(info.value)
    with pytest.raises(PermanentDeliveryError, match="webhook destination 'd'"):
        DEST.url_for(path)


@pytest.mark.parametrize(("path", "sent"), [
    ("/caf\u00e9", "/caf%C3%A9"),  # percent-encoded as UTF-8, as browsers do
    ("/\u65e5\u672c/\u20ac?q=\u00e9", "/%E6%97%A5%E6%9C%AC/%E2%82%AC?q=%C3%A9"),
    ("/caf%C3%A9", "/caf%C3%A9"),
    ("/discount/50%25", "/discount/50%25"),
    ("/a%20b", "/a%20b"),
    ("/x?next=/../y;z", "/x?next=/../y;z"),  # the query string is data, kept as given
    ("/a//b/", "/a//b/"),
    ("/v1.2/file.tar.gz", "/v1.2/file.tar.gz"),
    ("/", "/"),
])
def test_accepted_paths(path: str, sent: str) -> None:
    assert normalise_path(path) == sent
    assert DEST.url_for(path) == "https://api.example.com:8443/v1/hooks" + sent


@pytest.mark.parametrize(("value", "problem"), [
    ("Bearer abc", None), ("a\tb", None), ("", None),
    ("a\r\nX-Injected: 1", "CR or LF"), ("caf\u00e9", "U+00E9"), ("a\x00", "U+0000"),
    ("a\x7f", "U+007F"), (" a", "leading or trailing"), ("a ", "leading or trailing"),
    (42, "not a string"),
])
def test_header_values(value: object, problem: str | None) -> None:
    found = header_value_problem(value)
    assert (found is None) if problem is None else (found is not None and problem in found)
