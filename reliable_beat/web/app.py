"""The dashboard's ASGI app: :func:`create_app` (Starlette, Jinja2 templates, SVG timelines).

Mount it in an existing ASGI app at a prefix::

    from reliable_beat.web import create_app
    app.mount("/beat", create_app(database_url="postgresql+psycopg://..."))

Every page is server-rendered; a few lines of JavaScript (``static/live.js``) re-fetch the
page's main part every few seconds (header ``X-RB-Live: 1``) and swap it in place. Every
value printed goes through :func:`display` (the CLI's redaction, then Jinja2's autoescape).
Authentication, roles and CSRF: :mod:`reliable_beat.web.auth`; actions:
:mod:`reliable_beat.web.actions`.
"""

from __future__ import annotations

import hmac
import json
import math
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from sqlalchemy.exc import OperationalError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, PlainTextResponse, RedirectResponse
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route

from reliable_beat.db.dialects import Store
from reliable_beat.db.types import infinity_text
from reliable_beat.entries import get_entry
from reliable_beat.errors import ReliableBeatError, StoreUnavailableError
from reliable_beat.ops import describe as ops_describe
from reliable_beat.ops import requeue as ops_requeue
from reliable_beat.redaction import get_logger, redact_text, redact_value
from reliable_beat.relay import outbox_status
from reliable_beat.runs import DeadLetterNotFound, get_dead_letter
from reliable_beat.settings import Settings
from reliable_beat.web import queries as q
from reliable_beat.web.actions import perform, record
from reliable_beat.web.alarms import AlarmCache
from reliable_beat.web.auth import (
    CSRF_COOKIE,
    CSRF_FIELD,
    AuthConfig,
    authenticate,
    csrf_problem,
    flash_signature,
    is_loopback_host_header,
    new_csrf_token,
)
from reliable_beat.web.timeline import (
    OUTCOMES,
    last_slots,
    legend_cells,
    strip,
    strip_svg,
)
from reliable_beat.workflows.engine import get_workflow, replay_check, workflow_counts
from reliable_beat.workflows.errors import WorkflowNotFound
from reliable_beat.workflows.registry import get_definition

__all__ = ["DashboardConfig", "create_app", "display"]

log = get_logger("reliable_beat.web")

HERE = Path(__file__).parent
PER_PAGE = 50
LIVE_HEADER = "x-rb-live"


class DashboardConfig:
    """What the app needs: the store, the settings, the framework app (optional: it lets
    ``trigger`` publish at once and ``requeue`` send the task), the tokens, and its knobs."""

    def __init__(self, store: Store, *, settings: Settings | None = None, app: Any = None,
                 auth: AuthConfig | None = None, slots: int = 40,
                 late_after_seconds: float = 5.0, refresh_seconds: float = 5.0,
                 status_ttl_seconds: float = 5.0) -> None:
        self.store = store
        self.settings = settings or Settings(database_url=store.url)
        self.app = app
        #: one replay check at a time (it runs workflow code, which may block)
        self.replay_slot = threading.Lock()
        self.auth = auth if auth is not None else AuthConfig.from_sources(self.settings)
        self.slots = slots
        self.late_after = timedelta(seconds=late_after_seconds)
        self.refresh_seconds = refresh_seconds
        self.alarms = AlarmCache(store, ttl=status_ttl_seconds,
                                 redispatch_seconds=self.settings.redispatch_seconds,
                                 retry_cap_seconds=self.settings.retry_cap_seconds)


def display(value: Any) -> Any:
    """What a template prints for ``value``: the CLI's redaction (URLs with passwords,
    secret-named keys, tokens), instants as UTC text, JSON for structures. Applied to every
    ``{{ ... }}`` (the environment's ``finalize``); Markup (the templates' own) passes."""
    if isinstance(value, Markup):
        return value
    if value is None:
        return "-"
    if infinity_text(value) is not None:
        return f"malformed: {infinity_text(value)}"
    if isinstance(value, datetime):
        at = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S") + " UTC"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(redact_value(value), default=str, sort_keys=True)
    if isinstance(value, (bool, int, float)):
        return value
    return redact_text(value)


def _age(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or math.isnan(seconds):
        return "-"
    s = float(seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _environment() -> Environment:
    env = Environment(loader=FileSystemLoader(str(HERE / "templates")),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      finalize=display, trim_blocks=True, lstrip_blocks=True)
    env.filters["seg"] = lambda v: quote(str(v), safe="")  # one path segment
    env.filters["age"] = _age
    env.globals["OUTCOMES"] = OUTCOMES
    env.globals["strip_svg"] = strip_svg  # Markup built in Python (see timeline.strip_svg)
    env.globals["legend_cells"] = legend_cells()
    return env


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _local_back(request: Request, back: str | None, default: str) -> str:
    """A redirect target inside the dashboard (never another site)."""
    back = back or default
    if not back.startswith("/") or back.startswith("//") or "\\" in back:
        back = default
    return _root(request) + back


class _Guard(BaseHTTPMiddleware):
    """Authenticates every request, hands out the CSRF cookie, sets the security headers."""

    def __init__(self, app: Any, auth: AuthConfig) -> None:
        super().__init__(app)
        self.auth = auth

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint
                       ) -> StarletteResponse:
        host = request.client.host if request.client else None
        who = authenticate(request.headers.get("authorization"), host, self.auth)
        if who is None:
            if self.auth.configured:
                return PlainTextResponse(
                    "authentication required: a viewer or operator token (Bearer, or the "
                    "password of basic auth)", 401,
                    headers={"WWW-Authenticate": 'Basic realm="reliable-beat dashboard"'})
            return PlainTextResponse(
                "refused: this dashboard has no authentication configured, so it serves "
                "loopback clients only. Set RELIABLE_BEAT_DASHBOARD_OPERATOR_TOKEN / "
                "RELIABLE_BEAT_DASHBOARD_VIEWER_TOKEN to serve others.", 403)
        if not self.auth.configured and not is_loopback_host_header(request.headers.get("host")):
            # DNS rebinding: another site's page, resolved to 127.0.0.1, in the operator's
            # browser. Its requests come from loopback but carry the site's own name.
            return PlainTextResponse(
                "refused: this dashboard has no authentication configured, so it answers "
                "only requests addressed to a loopback name (localhost, 127.0.0.1, [::1]); "
                "open it at one of those, or set RELIABLE_BEAT_DASHBOARD_OPERATOR_TOKEN / "
                "RELIABLE_BEAT_DASHBOARD_VIEWER_TOKEN to serve other names.", 403)
        request.state.who = who
        cookie = request.cookies.get(CSRF_COOKIE)
        request.state.csrf = cookie or new_csrf_token()
        response = await call_next(request)
        if not cookie:
            response.set_cookie(CSRF_COOKIE, request.state.csrf, httponly=True,
                                samesite="strict", path=_root(request) or "/")
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
            "frame-ancestors 'none'; form-action 'self'")
        response.headers["Cache-Control"] = "no-store"
        return response


def _verified_flash(request: Request) -> str | None:
    """The action's message from the query string, only when this dashboard signed it for
    this browser (a crafted link's ``?msg=`` is not shown)."""
    query = request.query_params
    message, outcome, sig = query.get("msg"), query.get("outcome") or "", query.get("sig")
    if not message or not sig:
        return None
    wanted = flash_signature(request.state.csrf, outcome, message)
    return message if hmac.compare_digest(sig, wanted) else None


class _Pages:
    """The route handlers (sync: Starlette runs them in its thread pool)."""

    def __init__(self, cfg: DashboardConfig) -> None:
        self.cfg = cfg
        self.env = _environment()

    def render(self, request: Request, template: str, status_code: int = 200, /,
               **context: Any) -> HTMLResponse:
        root = _root(request)
        query = request.query_params
        context.update(
            request=request, root=root, who=request.state.who, csrf=request.state.csrf,
            live_only=request.headers.get(LIVE_HEADER) == "1",
            refresh_ms=int(self.cfg.refresh_seconds * 1000),
            flash=_verified_flash(request), flash_outcome=query.get("outcome"),
            here=request.url.path[len(root):] + (f"?{request.url.query}"
                                                 if request.url.query else ""))
        body = self.env.get_template(template).render(**context)
        return HTMLResponse(body, status_code)

    def not_found(self, request: Request, what: str) -> HTMLResponse:
        return self.render(request, "error.html", 404, message=what)

    async def store_unavailable(self, request: Request, exc: Exception) -> StarletteResponse:
        """503 while the database cannot be reached (not a 500 with a traceback); the page's
        live refresh keeps asking, so it comes back by itself."""
        log.warning("dashboard: the store %s cannot be reached (%s); answering 503",
                    self.cfg.store.safe_url, type(exc).__name__)
        message = (f"The store {self.cfg.store.safe_url} cannot be reached right now "
                   f"({type(exc).__name__}). Beats, workers and relays wait for it and go "
                   "on where they stopped; this page answers again once it is back.")
        if not hasattr(request.state, "who"):
            return PlainTextResponse(message, 503)
        return self.render(request, "error.html", 503, heading="Store unavailable",
                           message=message)

    # ------------------------------------------------------------------ pages ----
    def overview(self, request: Request) -> HTMLResponse:
        status, age, error = self.cfg.alarms.get()
        with self.cfg.store.engine.connect() as conn:
            now = self.cfg.store.now(conn)
            data = q.overview(conn, now)
        return self.render(request, "overview.html", status=status, status_age=age,
                           status_error=error, now=now, **data)

    def entries(self, request: Request) -> HTMLResponse:
        p = request.query_params
        flt = q.EntryFilter(group=p.get("group") or None, task=p.get("task") or None,
                            outcome=p.get("outcome") or None, name=p.get("q") or None)
        page = _int(p.get("page"), 1)
        with self.cfg.store.engine.connect() as conn:
            now = self.cfg.store.now(conn)
            rows, total = q.entry_page(conn, flt, page=page, per_page=PER_PAGE)
            slots = last_slots(conn, [r["name"] for r in rows], self.cfg.slots)
            groups = q.entry_groups(conn)
        for r in rows:
            r["strip"] = strip(slots.get(r["name"], []), schedule_spec=r.get("schedule"),
                               n=self.cfg.slots, late_after=self.cfg.late_after, now=now)
        pages = max(1, -(-total // PER_PAGE))
        keep = {k: v for k, v in (("group", flt.group), ("task", flt.task),
                                  ("outcome", flt.outcome), ("q", flt.name)) if v}
        return self.render(request, "entries.html", rows=rows, total=total, page=page,
                           pages=pages, flt=flt, groups=groups, states=q.ENTRY_STATES,
                           keep=urlencode(keep), now=now)

    def entry(self, request: Request) -> HTMLResponse:
        name = request.path_params["name"]
        try:
            row = get_entry(self.cfg.store, name)
        except ReliableBeatError:
            return self.not_found(request, f"no entry named {name!r}")
        with self.cfg.store.engine.connect() as conn:
            now = self.cfg.store.now(conn)
            recent = q.entry_runs(conn, name, PER_PAGE)
            slots = last_slots(conn, [name], self.cfg.slots)
        strip_cells = strip(slots.get(name, []), schedule_spec=row.get("schedule"),
                            n=self.cfg.slots, late_after=self.cfg.late_after, now=now)
        try:
            fires = q.next_fires(row["schedule"], str(row.get("timezone") or "UTC"),
                                 max(now, row["next_fire_at"] - timedelta(microseconds=1))
                                 if isinstance(row.get("next_fire_at"), datetime) else now, 12)
            fires_error = None
        except (ReliableBeatError, TypeError, ValueError, KeyError) as exc:
            fires, fires_error = [], str(exc)
        try:
            described = ops_describe.describe(self.cfg.store, self.cfg.app, name)
        except (ReliableBeatError, TypeError, ValueError):
            described = None
        audit = q.audit_rows(self.cfg.store, limit=20, target=name)
        return self.render(request, "entry.html", e=row, runs=recent, strip=strip_cells,
                           fires=fires, fires_error=fires_error, described=described,
                           audit=audit, now=now)

    def runs(self, request: Request) -> HTMLResponse:
        p = request.query_params
        before = None
        if p.get("before_at") and p.get("before_id"):
            try:
                before = (datetime.fromisoformat(p["before_at"]), int(p["before_id"]))
            except ValueError:
                before = None
        with self.cfg.store.engine.connect() as conn:
            rows = q.run_page(conn, entry=p.get("entry") or None, state=p.get("state") or None,
                              before=before, per_page=PER_PAGE)
        nxt = None
        if len(rows) == PER_PAGE and isinstance(rows[-1]["created_at"], datetime):
            nxt = urlencode({**{k: v for k, v in p.items() if k in ("entry", "state") and v},
                             "before_at": rows[-1]["created_at"].isoformat(),
                             "before_id": rows[-1]["id"]})
        return self.render(request, "runs.html", rows=rows, entry=p.get("entry") or "",
                           state=p.get("state") or "", next_query=nxt,
                           states=q.ENTRY_STATES[:-1])

    def run(self, request: Request) -> HTMLResponse:
        key = request.path_params["key"]
        with self.cfg.store.engine.connect() as conn:
            run, tries = q.run_detail(conn, key)
        if run is None:
            return self.not_found(request, f"no run with key {key!r}")
        return self.render(request, "run.html", run=run, attempts=tries,
                           audit=q.audit_rows(self.cfg.store, limit=20, target=key))

    def dead_letters(self, request: Request) -> HTMLResponse:
        p = request.query_params
        pending = p.get("pending") == "1"
        with self.cfg.store.engine.connect() as conn:
            rows = q.dead_letter_page(conn, pending=pending, before=_int(p.get("before"), 0)
                                      or None, per_page=PER_PAGE)
        nxt = rows[-1]["id"] if len(rows) == PER_PAGE else None
        return self.render(request, "dead_letters.html", rows=rows, pending=pending,
                           next_before=nxt)

    def dead_letter(self, request: Request) -> HTMLResponse:
        try:
            dl = get_dead_letter(self.cfg.store, int(request.path_params["id"]))
        except (DeadLetterNotFound, ValueError):
            return self.not_found(request, f"no dead letter {request.path_params['id']!r}")
        try:
            plan = ops_requeue.plan_requeue(self.cfg.store, dl)
            refused = ops_requeue.app_problem(plan, self.cfg.app)
            if refused is not None and self.cfg.app is None:
                refused += "; or start the dashboard with the app: `reliable-beat -A APP dashboard`"
            question = plan.question
        except ops_requeue.RequeueRefused as exc:
            refused, question = str(exc), None
        return self.render(request, "dead_letter.html", dl=dl, question=question,
                           refused=refused,
                           audit=q.audit_rows(self.cfg.store, limit=20, target=str(dl["id"])))

    def workflows(self, request: Request) -> HTMLResponse:
        p = request.query_params
        with self.cfg.store.engine.connect() as conn:
            rows = q.workflow_page(conn, state=p.get("state") or None,
                                   name=p.get("name") or None,
                                   before=_int(p.get("before"), 0) or None, per_page=PER_PAGE)
            counts = workflow_counts(conn)
        nxt = rows[-1]["id"] if len(rows) == PER_PAGE else None
        return self.render(request, "workflows.html", rows=rows, counts=counts,
                           state=p.get("state") or "", name=p.get("name") or "",
                           next_before=nxt)

    def workflow(self, request: Request) -> HTMLResponse:
        wid = request.path_params["wid"]
        try:
            wf = get_workflow(self.cfg.store, wid, events=True)
        except WorkflowNotFound:
            return self.not_found(request, f"no workflow {wid!r}")
        asked = (request.query_params.get("replay") == "1"
                 and request.headers.get(LIVE_HEADER) != "1")
        return self.render(request, "workflow.html", wf=wf, replay_asked=asked,
                           replay=self.replay_verdict(wid, wf["name"]) if asked else None)

    def replay_verdict(self, wid: str, name: str) -> tuple[str, str]:
        """(``ok`` | ``mismatch`` | ``unchecked`` | ``busy``, what to say): the workflow's
        stored history replayed against the code this process registers, as `workflows
        replay` does. It runs the workflow's own code, which may block: only when asked
        (never on the live refresh), and one at a time per dashboard process."""
        if not self.cfg.replay_slot.acquire(blocking=False):
            return ("busy", "not checked: another replay check is still running in this "
                    "dashboard (a workflow's code that blocks holds it); try again later")
        try:
            return self._replay_verdict(wid, name)
        finally:
            self.cfg.replay_slot.release()

    def _replay_verdict(self, wid: str, name: str) -> tuple[str, str]:
        if get_definition(name) is None:
            return ("unchecked", f"not checked: workflow {name!r} is not registered in this "
                    "process; start the dashboard with the app that registers it "
                    "(`reliable-beat -A APP dashboard`)")
        try:
            problem = replay_check(self.cfg.store, wid)
        except WorkflowNotFound:
            return ("unchecked", "not checked: the workflow is gone")
        if problem is None:
            return ("ok", "this process's code replays the stored history without a mismatch")
        return ("mismatch", problem)

    def outbox(self, request: Request) -> HTMLResponse:
        p = request.query_params
        state = str(p.get("state") or "pending")
        state = state if state in ("pending", "dead", "sent") else "pending"
        with self.cfg.store.engine.connect() as conn:
            backlog = outbox_status(conn)
            rows = q.outbox_rows(conn, state=state, destination=p.get("destination") or None,
                                 per_page=PER_PAGE)
        return self.render(request, "outbox.html", backlog=backlog, rows=rows, state=state,
                           destination=p.get("destination") or "")

    def audit(self, request: Request) -> HTMLResponse:
        return self.render(request, "audit.html", rows=q.audit_rows(self.cfg.store, limit=200))

    async def act(self, request: Request) -> StarletteResponse:
        action = request.path_params["action"]
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        who = request.state.who
        remote = request.client.host if request.client else None
        problem = csrf_problem(request.cookies.get(CSRF_COOKIE), form.get(CSRF_FIELD),
                               request.headers.get("origin"), request.headers.get("host"))
        if problem is not None:
            await run_in_threadpool(_record_refusal, self.cfg.store, who, action, form,
                                    f"CSRF: {problem}", remote)
            return PlainTextResponse(f"refused: {problem}", 403)
        done = await run_in_threadpool(perform, self.cfg.store, self.cfg.app, who, action,
                                       form, backfill_limit=self.cfg.settings.backfill_limit,
                                       remote=remote)
        if done.outcome == "refused" and not who.can_act:
            return PlainTextResponse(f"refused: {done.message}", 403)
        back = _local_back(request, form.get("back"), "/")
        sep = "&" if "?" in back else "?"
        sig = flash_signature(request.state.csrf, done.outcome, done.message)
        return RedirectResponse(f"{back}{sep}" + urlencode(
            {"msg": done.message, "outcome": done.outcome, "sig": sig}), 303)

    def static(self, request: Request) -> StarletteResponse:
        name = request.path_params["name"]
        if name not in ("live.js", "dashboard.css"):
            return PlainTextResponse("not found", 404)
        return FileResponse(HERE / "static" / name)


def _record_refusal(store: Store, who: Any, action: str, form: dict[str, str], error: str,
                    remote: str | None) -> None:
    record(store, who, action, form.get("target") or "-",
           {k: v for k, v in form.items() if k not in ("csrf", "target")}, "refused", error,
           remote)


def _int(value: str | None, default: int) -> int:
    try:
        return max(int(value or default), 0) or default
    except ValueError:
        return default


def create_app(store: Store | None = None, *, database_url: str | None = None,
               settings: Settings | None = None, app: Any = None,
               auth: AuthConfig | None = None, **knobs: Any) -> Starlette:
    """The dashboard as an ASGI app.

    Args:
        store: the store (or give ``database_url``, or ``settings``).
        settings: the settings (tokens, backfill limit, redispatch timing); default: read
            from the environment for ``store``'s URL.
        app: the Celery app / Dramatiq broker: ``trigger`` publishes at once, ``requeue``
            sends the task through it (None: triggers go through the relay; requeue refused).
        auth: the tokens (default: from ``settings``, then the environment).
        knobs: ``slots`` (cells per timeline strip, 40), ``late_after_seconds`` (5),
            ``refresh_seconds`` (5), ``status_ttl_seconds`` (5).
    """
    if store is None:
        url = database_url or (settings.database_url if settings else Settings().database_url)
        store = Store.from_url(url, role="dashboard")
    cfg = DashboardConfig(store, settings=settings, app=app, auth=auth, **knobs)
    pages = _Pages(cfg)
    routes = [
        Route("/", pages.overview),
        Route("/entries", pages.entries),
        Route("/entries/{name:path}", pages.entry),
        Route("/runs", pages.runs),
        Route("/runs/{key:path}", pages.run),
        Route("/dead-letters", pages.dead_letters),
        Route("/dead-letters/{id}", pages.dead_letter),
        Route("/workflows", pages.workflows),
        Route("/workflows/{wid:path}", pages.workflow),
        Route("/outbox", pages.outbox),
        Route("/audit", pages.audit),
        Route("/actions/{action}", pages.act, methods=["POST"]),
        Route("/static/{name}", pages.static),
    ]
    web = Starlette(routes=routes, middleware=[Middleware(_Guard, auth=cfg.auth)],
                    exception_handlers={StoreUnavailableError: pages.store_unavailable,
                                        OperationalError: pages.store_unavailable})
    web.state.dashboard = cfg
    return web
