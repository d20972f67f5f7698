"""The web dashboard through Starlette's TestClient, on SQLite, PostgreSQL (and MariaDB).

Every page renders from a seeded store (tests/apps/dashboard_seed.py); the timeline shows
each slot's outcome where it happened (a gap, a missed slot, a fenced-out attempt); actions
work for an operator, are refused for a viewer and without CSRF, and are audited; values
stay escaped; off loopback without a token nothing is served.
"""

from __future__ import annotations

import base64
import re
import warnings
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from sqlalchemy import select

from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import entries, operator_actions
from reliable_beat.errors import ConfigurationError
from reliable_beat.web import AuthConfig, check_bind, create_app
from tests.apps.dashboard_seed import XSS, Seeded, seed

with warnings.catch_warnings():  # Starlette 1.x: "install httpx2" (httpx still works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

OPERATOR_TOKEN = "op-" + "o" * 30
VIEWER_TOKEN = "view-" + "v" * 30
LOOPBACK = ("127.0.0.1", 50000)


def _client(store: Store, *, auth: AuthConfig | None = None,
            client: tuple[str, int] = LOOPBACK, headers: dict[str, str] | None = None,
            **kw: Any) -> TestClient:
    return TestClient(create_app(store, auth=auth or AuthConfig(), **kw), client=client,
                      headers=headers, base_url="http://127.0.0.1:8000")


@pytest.fixture
def seeded(store: Store) -> Seeded:
    return seed(store)


@pytest.fixture
def local(store: Store) -> Iterator[TestClient]:
    with _client(store) as c:
        yield c


def _csrf(page: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m, "no CSRF field in the page"
    return m.group(1)


def _strip_outcomes(html: str, entry_row_marker: str) -> list[str]:
    row = html.split(entry_row_marker, 1)[1].split("</svg>", 1)[0]
    return re.findall(r'data-outcome="([a-z_]+)"', row)


def test_every_page_renders_and_the_timeline_shows_each_outcome(
        store: Store, seeded: Seeded, local: TestClient) -> None:
    pages = {
        "/": ["Alarms", "dead letters wait for a person", "Outbox backlog", "Workers"],
        "/entries": [seeded.entry, "fenced out"],
        f"/entries/{seeded.entry}": ["Next fires (UTC)", "Pause", "Trigger now", "Backfill"],
        "/runs": [seeded.dead_key],
        f"/runs/{seeded.fenced_key}": ["fenced_out", "Clear the lease"],
        "/dead-letters": [seeded.dead_key],
        f"/dead-letters/{seeded.dead_letter_id}": ["Yes, requeue it", "permanent"],
        "/workflows": ["Workflows"],
        "/outbox": ["Outbox"],
        "/audit": ["Operator actions"],
    }
    for path, must in pages.items():
        r = local.get(path)
        assert r.status_code == 200, (path, r.text[:500])
        for text in must:
            assert text in r.text, (path, text)
    # the strip: the last 8 slots, oldest first, each outcome where it happened
    html = local.get(f"/entries?q={seeded.entry}").text
    assert _strip_outcomes(html, f'data-entry="{seeded.entry}"') == seeded.outcomes
    # hover: the lateness of the late slot; click: through to the run
    assert "dispatched 40.0 s after its slot" in html
    assert f'href="/runs/{quote(seeded.fenced_key, safe="")}"' in html
    # the live refresh asks for the main part only
    part = local.get("/entries", headers={"X-RB-Live": "1"}).text
    assert "<html" not in part and "data-outcome" in part


def test_entries_filters_and_pages(store: Store, seeded: Seeded, local: TestClient) -> None:
    assert seeded.entry in local.get("/entries?task=payouts.pay").text
    assert seeded.entry not in local.get("/entries?task=other.task").text
    assert seeded.entry in local.get("/entries?outcome=succeeded").text
    assert seeded.entry not in local.get("/entries?outcome=dead").text
    assert "page 1 of 1" in local.get("/entries").text


def test_entry_page_marks_dst_in_the_entrys_zone(store: Store, seeded: Seeded,
                                                 local: TestClient) -> None:
    html = local.get(f"/entries/{seeded.xss_entry}").text
    assert "Next fires (Europe/Paris)" in html
    assert "CET" in html or "CEST" in html


def test_operator_actions_work_and_are_audited(store: Store, seeded: Seeded,
                                               local: TestClient) -> None:
    page = local.get(f"/entries/{seeded.entry}").text
    r = local.post("/actions/pause", data={"csrf": _csrf(page), "target": seeded.entry,
                                           "back": f"/entries/{seeded.entry}"},
                   follow_redirects=False)
    assert r.status_code == 303, r.text
    with store.engine.connect() as conn:
        assert conn.execute(select(entries.c.paused)
                            .where(entries.c.name == seeded.entry)).scalar_one() is True
        audit = conn.execute(select(operator_actions)).mappings().all()
    assert [(a["actor"], a["role"], a["action"], a["target"], a["outcome"]) for a in audit] == [
        ("local", "operator", "pause", seeded.entry, "ok")]
    shown = local.get(r.headers["location"]).text
    assert "paused" in shown and "Resume" in shown
    # trigger: a manual run appears
    local.post("/actions/trigger", data={"csrf": _csrf(page), "target": seeded.entry})
    assert f"{seeded.entry}@manual:" in local.get(f"/runs?entry={seeded.entry}").text
    # requeue asks for the confirmation first (as the CLI does); without an app it says how
    r = local.post("/actions/requeue", data={"csrf": _csrf(page),
                                             "target": str(seeded.dead_letter_id)})
    assert "not confirmed" in r.text
    r = local.post("/actions/requeue", data={"csrf": _csrf(page), "confirm": "yes",
                                             "target": str(seeded.dead_letter_id)})
    assert "-A APP" in r.text
    with store.engine.connect() as conn:
        outcomes = [o for (o,) in conn.execute(
            select(operator_actions.c.outcome).order_by(operator_actions.c.id))]
    assert outcomes == ["ok", "ok", "refused", "failed"]


def test_viewer_and_missing_csrf_are_refused(store: Store, seeded: Seeded) -> None:
    auth = AuthConfig(operator_token=OPERATOR_TOKEN, viewer_token=VIEWER_TOKEN)
    with _client(store, auth=auth) as anon:
        assert anon.get("/").status_code == 401  # a token is needed, loopback or not
    with _client(store, auth=auth,
                 headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}) as viewer:
        page = viewer.get(f"/entries/{seeded.entry}")
        assert page.status_code == 200
        assert 'data-action="pause"' not in page.text  # no buttons for a viewer
        r = viewer.post("/actions/pause", data={"csrf": viewer.cookies["rb_csrf"],
                                                "target": seeded.entry})
        assert r.status_code == 403 and "only operators may act" in r.text
    basic = base64.b64encode(f"alice:{OPERATOR_TOKEN}".encode()).decode()
    with _client(store, auth=auth, headers={"Authorization": f"Basic {basic}"}) as op:
        op.get("/")
        r = op.post("/actions/pause", data={"target": seeded.entry})  # no CSRF field
        assert r.status_code == 403 and "CSRF" in r.text
        r = op.post("/actions/pause", data={"csrf": "forged", "target": seeded.entry})
        assert r.status_code == 403
        r = op.post("/actions/pause", data={"csrf": op.cookies["rb_csrf"],
                                            "target": seeded.entry},
                    headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "another site" in r.text
        r = op.post("/actions/pause", data={"csrf": op.cookies["rb_csrf"],
                                            "target": seeded.entry}, follow_redirects=False)
        assert r.status_code == 303
    with store.engine.connect() as conn:
        rows = conn.execute(select(operator_actions.c.actor, operator_actions.c.role,
                                   operator_actions.c.outcome)
                            .order_by(operator_actions.c.id)).all()
        paused = conn.execute(select(entries.c.paused)
                              .where(entries.c.name == seeded.entry)).scalar_one()
    assert [tuple(r) for r in rows] == [("viewer-token", "viewer", "refused")] + [
        ("alice", "operator", "refused")] * 3 + [("alice", "operator", "ok")]
    assert paused is True


def test_off_loopback_without_a_token_is_refused(store: Store) -> None:
    with pytest.raises(ConfigurationError, match="no token configured"):
        check_bind("0.0.0.0", AuthConfig())
    check_bind("127.0.0.1", AuthConfig())
    check_bind("0.0.0.0", AuthConfig(operator_token=OPERATOR_TOKEN))
    # mounted in a server that binds elsewhere: the app itself refuses non-loopback peers
    with _client(store, client=("203.0.113.9", 40000)) as far:
        r = far.get("/")
        assert r.status_code == 403 and "loopback clients only" in r.text


def test_without_a_token_a_foreign_host_name_is_refused(store: Store, seeded: Seeded) -> None:
    """DNS rebinding: another site's page, its name resolved to 127.0.0.1, in the operator's
    browser. The request comes from loopback, with that site's name as ``Host``: no page is
    read and no action runs (the CSRF token it could read from a page would pass)."""
    with _client(store) as local:
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST."):
            assert local.get("/", headers={"host": host}).status_code == 200, host
        evil = {"host": "evil.example:8000", "origin": "http://evil.example:8000"}
        r = local.get(f"/entries/{seeded.entry}", headers=evil)
        assert r.status_code == 403 and "loopback name" in r.text
        assert seeded.entry not in r.text
        token = _csrf(local.get(f"/entries/{seeded.entry}").text)
        r = local.post("/actions/pause", headers=evil, follow_redirects=False,
                       data={"csrf": token, "target": seeded.entry})
        assert r.status_code == 403
    with _client(store, auth=AuthConfig(operator_token=OPERATOR_TOKEN),
                 headers={"authorization": f"Bearer {OPERATOR_TOKEN}"}) as tokened:
        # with a token, the name the dashboard is reached by is the operator's business
        assert tokened.get("/", headers={"host": "dashboard.internal"}).status_code == 200


def test_a_crafted_link_cannot_show_its_own_message(store: Store, seeded: Seeded,
                                                     local: TestClient) -> None:
    """An action's message comes back signed for this browser; a link's own ``?msg=`` (e.g.
    "re-enter your token at https://evil.example") is not shown as the dashboard's."""
    bait = "Session expired: re-enter your token at https://evil.example"
    page = local.get(f"/entries/{seeded.entry}", params={"msg": bait, "outcome": "ok"}).text
    assert bait not in page and 'id="flash"' not in page
    r = local.post("/actions/pause", follow_redirects=False,
                   data={"csrf": _csrf(page), "target": seeded.entry,
                         "back": f"/entries/{seeded.entry}"})
    shown = local.get(r.headers["location"]).text
    assert 'id="flash"' in shown and f"entry {seeded.entry!r} paused" in shown.replace(
        "&#39;", "'")
    # the same signed link in another browser (another CSRF cookie) shows nothing
    with _client(store) as other:
        assert 'id="flash"' not in other.get(r.headers["location"]).text


def test_an_unreachable_store_is_a_503_page_not_a_traceback() -> None:
    dead = Store.from_url("postgresql+psycopg://rb:s3cret-pw@127.0.0.1:9/nowhere")
    try:
        with TestClient(create_app(dead, auth=AuthConfig()), client=LOOPBACK,
                        base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as local:
            for path in ("/", "/entries", "/runs", "/workflows"):
                r = local.get(path)
                assert r.status_code == 503, (path, r.status_code, r.text[:300])
                assert "cannot be reached" in r.text and "s3cret-pw" not in r.text
    finally:
        dead.dispose()


def test_xss_payloads_stay_escaped(store: Store, seeded: Seeded, local: TestClient) -> None:
    for path in ("/", "/entries", f"/entries/{seeded.xss_entry}", "/runs",
                 f"/runs/{seeded.dead_key}", "/dead-letters",
                 f"/dead-letters/{seeded.dead_letter_id}", "/audit",
                 f"/entries?q={XSS}", f"/runs?entry={XSS}", f"/nope?msg={XSS}",
                 f"/?msg={XSS}&outcome={XSS}"):
        html = local.get(path).text
        assert "<script>alert" not in html and "<img src=x" not in html, path
    assert "&lt;script&gt;alert" in local.get(f"/entries/{seeded.xss_entry}").text


def test_secrets_are_redacted_as_in_the_cli(store: Store, local: TestClient) -> None:
    from reliable_beat import entries as rb_entries
    from reliable_beat import schedules as sch
    from reliable_beat.entries import EntryDefinition

    rb_entries.save_runtime_entry(store, EntryDefinition(
        name="with-secret", task="t.x", schedule=sch.CronSchedule("0 3 * * *", "UTC"),
        kwargs={"api_token": "s3cr3t-value", "url": "https://bob:hunter2@example.com/x"}),
        create=True)
    html = local.get("/entries/with-secret").text
    assert "s3cr3t-value" not in html and "hunter2" not in html


def test_command_names_the_web_extra_when_it_is_missing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import sys

    from click.testing import CliRunner

    from reliable_beat.cli import reliable_beat

    monkeypatch.setitem(sys.modules, "reliable_beat.web", None)  # as if not installed
    r = CliRunner().invoke(reliable_beat, ["--database-url", f"sqlite:///{tmp_path}/x.db",
                                           "dashboard"])
    assert r.exit_code == 2
    assert "pip install 'reliable-beat[web]'" in r.output


def test_command_refuses_a_public_bind_without_a_token(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from click.testing import CliRunner

    from reliable_beat.cli import reliable_beat

    monkeypatch.delenv("RELIABLE_BEAT_DASHBOARD_OPERATOR_TOKEN", raising=False)
    monkeypatch.delenv("RELIABLE_BEAT_DASHBOARD_VIEWER_TOKEN", raising=False)
    r = CliRunner().invoke(reliable_beat, ["--database-url", f"sqlite:///{tmp_path}/x.db",
                                           "dashboard", "--host", "0.0.0.0"])
    assert r.exit_code == 2
    assert "no token configured" in r.output


def test_strip_hover_text_redacts_and_escapes_a_stored_reason(store: Store,
                                                              local: TestClient) -> None:
    """The strip is built in Python: a run's reason (stored text, e.g. a broker error) is
    redacted and escaped in its cell's hover text; the link quotes the key."""
    from datetime import timedelta

    from reliable_beat import entries as rb_entries
    from reliable_beat import schedules as sch
    from reliable_beat.db.tables import runs
    from reliable_beat.entries import EntryDefinition
    from reliable_beat.slots import idempotency_key

    name = "reasoned"
    rb_entries.save_runtime_entry(store, EntryDefinition(
        name=name, task="t.x", schedule=sch.CronSchedule("*/5 * * * *", "UTC")), create=True)
    with store.begin() as conn:
        now = store.now(conn)
        last = sch.CronSchedule("*/5 * * * *", "UTC").previous_at_or_before(now)
        assert last is not None
        for i, at in enumerate((last - timedelta(minutes=5), last)):
            conn.execute(runs.insert().values(
                idempotency_key=idempotency_key(name, at), entry_name=name, fire_at=at,
                task="t.x", args=[], kwargs={}, state="dead" if i else "succeeded",
                attempts=1, created_at=at, updated_at=now,
                reason=f"trigger undeliverable: redis://u:hunter2@h:6379/0 {XSS}" if i
                else None))
    html = local.get(f"/entries?q={name}").text
    row = html.split(f'data-entry="{name}"', 1)[1].split("</svg>", 1)[0]
    assert re.findall(r'data-outcome="([a-z_]+)"', row) == ["on_time", "dead"]
    assert "hunter2" not in html and "<script>alert" not in html
    assert "trigger undeliverable: redis://u:***@h:6379/0 &lt;script&gt;" in row
    assert f'href="/runs/{quote(idempotency_key(name, last), safe="")}"' in row
