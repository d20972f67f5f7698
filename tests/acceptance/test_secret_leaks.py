"""The leak test: distinct secrets seeded into every input never appear in any output.

Inputs: the database URL in both forms (``user:password@`` and ``?password=``), the broker
URL (a real Redis with ``requirepass``), webhook destinations (a token in the base URL's path,
an ``Authorization`` header from the environment, an inline ``X-Api-Key``), a token in a row's
query string, a legacy outbox row with a full URL (userinfo, path and query tokens) and auth
headers, an auth header in an entry's publish options, the SMTP password (environment) and a
legacy row's SMTP credentials, and a malformed URL with an unescaped ``@`` in its password.

Outputs, all from real processes: a ``celery beat`` at DEBUG (banner, sync log, ticks) with
its metrics server, a second beat whose database is down and a third whose URL cannot be
parsed, ``reliable-beat relay`` (banner and DEBUG log, deliveries that fail and dead-letter),
``reliable-beat metrics serve`` (banner and a scrape) and ``metrics textfile``, and every
read command of the CLI with and without ``--json`` (status, entries, runs, dead-letters,
outbox, db), with the database up and down. Every output is grepped for every secret:
zero hits. Sanity checks make sure each output says what it should (it is not empty).

A second test gives an ``IdempotentTask`` credentials as keyword arguments (``key=``,
``api_key=``) and has it fail quoting them: a real ``celery worker`` at DEBUG, ``runs show``
and ``dead-letters list`` show neither.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import sqlalchemy as sa

from harness.servers import free_port
from reliable_beat import outbox
from reliable_beat.db.dialects import Store
from reliable_beat.db.tables import dead_letters

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"
sys.path.insert(0, str(APPS))

from unchecked_rows import unchecked  # noqa: E402

CLI = [sys.executable, "-m", "reliable_beat.cli"]

# distinct, greppable, and shaped like real secrets (letters and digits)
SECRETS = {
    "db password (userinfo)": "LkDbUserinfo4f81c2",
    "db password (query)": "LkDbQuery7e55a0",
    "broker password": "LkBroker93bd17",
    "webhook userinfo password": "LkWhUser2c7f0e",
    "webhook path token": "LkWhPathToken51d9a8e3",
    "webhook query token": "LkWhQuery8a3c61",
    "destination base URL token": "LkDestPath7c0e93b21f",
    "destination inline key": "LkDestKey4b8e10",
    "row path query token": "LkRowQuery2d6f55",
    "SMTP password (settings)": "LkSmtpSet9e21c7",
    "Authorization header": "LkAuthBearer6b0d94",
    "X-Api-Key header": "LkApiKey0e77c3",
    "entry X-Api-Key header": "LkEntryKey5a19f2",
    "SMTP password": "LkSmtpPw3f62b8",
    "malformed URL password": "LkMalformed9d04e1",
}


class _EchoingWebhook(BaseHTTPRequestHandler):
    """Refuses every request with 400, echoing what it got (as careless servers do)."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = (f"rejected {self.path} Authorization: {self.headers.get('Authorization')} "
                f"X-Api-Key: {self.headers.get('X-Api-Key')}").encode()
        self.send_response(400)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def webhook_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoingWebhook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def smtp_server(tmp_path: Path) -> Iterator[tuple[int, str, list[bytes]]]:
    """A real SMTP server offering STARTTLS and AUTH (over TLS), refusing every login:
    ``(port, CA file, passwords it was sent)``."""
    controller = pytest.importorskip("aiosmtpd.controller")
    import socket
    import ssl

    from aiosmtpd.smtp import AuthResult

    sys.path.insert(0, str(APPS))
    from far_ends import self_signed_cert

    cert = self_signed_cert(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert.cert, cert.key)
    tried: list[bytes] = []

    def refuse(server: object, session: object, envelope: object, mechanism: str,
               auth_data: object) -> AuthResult:
        tried.append(getattr(auth_data, "password", b""))
        return AuthResult(success=False, handled=False)

    with socket.socket() as probe:  # aiosmtpd's Controller cannot take port 0
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    ctl = controller.Controller(
        object(), hostname="127.0.0.1", port=port, tls_context=context, require_starttls=True,
        authenticator=refuse, auth_require_tls=True, auth_required=True,
    )
    ctl.start()
    try:
        yield port, str(cert.cert), tried
    finally:
        ctl.stop()


@pytest.fixture
def broker_url(tmp_path: Path) -> Iterator[str]:
    """A private Redis that requires the broker password."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(exe):
        pytest.skip("redis-server not installed")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--requirepass", SECRETS["broker password"]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        url = f"redis://:{SECRETS['broker password']}@127.0.0.1:{port}/0"
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(url, socket_timeout=2).ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _env(db_url: str, broker_url: str, webhook_port: int = 1, closed: int = 1,
         smtp: tuple[int, str] = (1, ""), **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CELERY_CONFIG_MODULE", None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), str(APPS)]),
        PYTHONUNBUFFERED="1",
        RB_LEAK_DB_URL=db_url,
        RELIABLE_BEAT_DATABASE_URL=db_url,
        RB_LEAK_BROKER_URL=broker_url,
        RB_LEAK_WEBHOOK_BASE=(f"http://127.0.0.1:{webhook_port}/hook/"
                              f"{SECRETS['destination base URL token']}"),
        RB_LEAK_WEBHOOK_DOWN=(f"http://127.0.0.1:{closed}/services/"
                              f"{SECRETS['destination base URL token']}"),
        RB_LEAK_SMTP_PORT=str(smtp[0]),
        RB_LEAK_SMTP_CA=smtp[1],
        RB_LEAK_API_KEY=SECRETS["entry X-Api-Key header"],
        RB_LEAK_AUTH=f"Bearer {SECRETS['Authorization header']}",
        RB_LEAK_DEST_KEY=SECRETS["destination inline key"],
        RB_LEAK_SMTP_PW=SECRETS["SMTP password (settings)"],
        **extra,
    )
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)
    return f"$ {' '.join(cmd[3:])}\n(exit {done.returncode})\n{done.stdout}{done.stderr}"


def _start(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait_text(path: Path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        out = path.read_text(errors="replace") if path.exists() else ""
        if text in out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {path.name} after {timeout:.0f} s:\n{out}")
        time.sleep(0.25)


def _scrape(port: int, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return str(r.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_no_secret_reaches_any_output(pg_store: Store, pg_url: str, broker_url: str,
                                      webhook_port: int,
                                      smtp_server: tuple[int, str, list[bytes]],
                                      tmp_path: Path) -> None:
    smtp = smtp_server[:2]
    base = sa.engine.make_url(pg_url)  # trust auth: the passwords are accepted, and unused
    url_userinfo = base.set(password=SECRETS["db password (userinfo)"]).render_as_string(False)
    url_query = base.update_query_dict(
        {"password": SECRETS["db password (query)"]}).render_as_string(False)
    closed = free_port()
    down_userinfo = base.set(port=closed, password=SECRETS["db password (userinfo)"]
                             ).render_as_string(False)
    down_query = base.set(port=closed).update_query_dict(
        {"password": SECRETS["db password (query)"]}).render_as_string(False)
    malformed = (f"postgresql+psycopg://postgres:ab@{SECRETS['malformed URL password']}"
                 f"@127.0.0.1:notaport/{base.database}")
    outputs: dict[str, str] = {}

    # outbox rows whose deliveries fail and dead-letter (reliable_beat_outbox_max_attempts=1);
    # the legacy row is one outbox.add refuses now: written as an earlier version did
    with pg_store.begin() as conn, unchecked():
        outbox.add(conn, "webhook", {  # the server answers 400: permanent
            "destination": "leaky", "path": f"/x?token={SECRETS['row path query token']}",
            "body": {"text": "deploy done"},
        }, key="leak-webhook-400")
        outbox.add(conn, "webhook", {  # nobody listens: retried, exhausted after one attempt
            "destination": "down", "path": "/y", "body": {"text": "nobody listens"},
        }, key="leak-webhook-refused")
        outbox.add(conn, "webhook", {  # a row of an earlier version: refused, dead-lettered
            "url": (f"http://hook:{SECRETS['webhook userinfo password']}@127.0.0.1:"
                    f"{webhook_port}/hook/{SECRETS['webhook path token']}"
                    f"?token={SECRETS['webhook query token']}&team=ops"),
            "body": {"text": "legacy"},
            "headers": {"Authorization": f"Bearer {SECRETS['Authorization header']}",
                        "X-Api-Key": SECRETS["X-Api-Key header"]},
        }, key="leak-webhook-legacy")
        outbox.add(conn, "smtp", {"from": "rb@example.com", "to": ["ops@example.com"],
                                  "subject": "leak test", "text": "hello"},
                   headers={"smtp_host": "127.0.0.1", "smtp_port": closed,
                            "smtp_user": "rb", "smtp_password": SECRETS["SMTP password"]},
                   key="leak-smtp-refused")

    # a real beat at DEBUG, with its metrics server; the store URL carries ?password=
    metrics_port = free_port()
    beat_log = tmp_path / "beat.log"
    beat = _start([sys.executable, "-m", "celery", "-A", "leakapp", "beat", "-l", "debug",
                   "--pidfile=", "-s", str(tmp_path / "beat-schedule")],
                  _env(url_query, broker_url, webhook_port, closed, smtp,
                       RB_LEAK_METRICS_PORT=str(metrics_port)),
                  tmp_path, beat_log)
    try:
        _wait_text(beat_log, "synced", 120)
        _wait_text(beat_log, "slot.fired", 120)
        outputs["beat metrics scrape"] = _scrape(metrics_port)
    finally:
        _stop(beat)
    outputs["beat log (DEBUG)"] = beat_log.read_text(errors="replace")

    # the relay: banner and DEBUG log; every seeded row fails once and is dead-lettered
    env_a = _env(url_userinfo, broker_url, webhook_port, closed, smtp)
    env_b = _env(url_query, broker_url, webhook_port, closed, smtp)
    for name, env in (("userinfo", env_a), ("query", env_b)):
        outputs[f"relay --once ({name})"] = _run(
            [*CLI, "-A", "leakapp", "relay", "--once", "--loglevel", "DEBUG"], env, tmp_path)
    # the SMTP password really went out (over TLS) and was refused
    assert SECRETS["SMTP password (settings)"].encode() in smtp_server[2]
    with pg_store.engine.connect() as conn:
        dead = conn.execute(sa.select(dead_letters.c.id, dead_letters.c.key)).all()
    assert {r.key for r in dead} >= {"leak-webhook-400", "leak-webhook-refused",
                                     "leak-webhook-legacy"}, dead

    # metrics serve (banner + scrape) and textfile
    serve_port = free_port()
    serve_log = tmp_path / "metrics-serve.log"
    server = _start([*CLI, "metrics", "serve", "--port", str(serve_port)], env_b, tmp_path,
                    serve_log)
    try:
        _wait_text(serve_log, "serving metrics", 60)
        outputs["metrics serve scrape"] = _scrape(serve_port)
    finally:
        _stop(server)
    outputs["metrics serve banner"] = serve_log.read_text(errors="replace")
    outputs["metrics textfile"] = _run([*CLI, "metrics", "textfile", str(tmp_path / "m.prom")],
                                       env_a, tmp_path)
    outputs["metrics textfile file"] = (tmp_path / "m.prom").read_text()

    # every read command, with and without --json, with both URL forms
    with pg_store.engine.connect() as conn:
        run_key = conn.execute(sa.text(
            "SELECT idempotency_key FROM reliable_beat_runs LIMIT 1")).scalar()
    commands: list[list[str]] = [
        ["status"], ["status", "--json"], ["entries", "list"], ["entries", "list", "--json"],
        ["entries", "show", "leak-every-second"],
        ["entries", "show", "leak-every-second", "--json"],
        ["runs"], ["runs", "--json"], ["dead-letters", "list"], ["dead-letters", "list", "--json"],
        ["outbox", "status"], ["outbox", "status", "--json"], ["db", "check"], ["db", "current"],
        ["db", "check", "--json"], ["db", "current", "--json"],
        ["schedule", "list"], ["schedule", "list", "--json"],
        *[["dead-letters", "show", str(r.id)] for r in dead],
    ]
    if run_key:
        commands += [["runs", "show", run_key], ["runs", "show", run_key, "--json"]]
    for cmd in commands:
        outputs[" ".join(cmd) + " (userinfo)"] = _run([*CLI, *cmd], env_a, tmp_path)
    for cmd in (["status"], ["status", "--json"], ["db", "check"], ["db", "check", "--json"],
                ["-A", "leakapp", "schedule", "sync"], ["-A", "leakapp", "schedule", "sync",
                                                        "--json"]):
        outputs[" ".join(cmd) + " (query)"] = _run([*CLI, *cmd], env_b, tmp_path)
        outputs[" ".join(cmd) + " (via celery)"] = _run(
            [sys.executable, "-m", "celery", "-A", "leakapp", "reliable-beat", *cmd],
            env_b, tmp_path)

    # the database down (both forms) and a URL that cannot be parsed
    for name, url in (("down, userinfo", down_userinfo), ("down, query", down_query),
                      ("malformed", malformed)):
        env = _env(url, broker_url, webhook_port, closed, smtp)
        for cmd in (["status"], ["status", "--json"], ["db", "check"],
                    ["dead-letters", "list", "--json"],
                    ["-A", "leakapp", "relay", "--once", "--loglevel", "DEBUG"]):
            outputs[f"{' '.join(cmd)} ({name})"] = _run([*CLI, *cmd], env, tmp_path)
        log = tmp_path / f"beat-{name.replace(', ', '-')}.log"
        proc = _start([sys.executable, "-m", "celery", "-A", "leakapp", "beat", "-l", "debug",
                       "--pidfile=", "-s", str(tmp_path / "beat-schedule-2")], env, tmp_path, log)
        try:
            if name == "malformed":
                proc.wait(timeout=120)
            else:
                _wait_text(log, "retrying in", 120)
        finally:
            _stop(proc)
        outputs[f"beat log ({name})"] = log.read_text(errors="replace")

    # sanity: the outputs really show what they are about (a vacuous pass is a failure)
    everything = "\n".join(outputs.values())
    assert "reliable_beat_up 1.0" in outputs["beat metrics scrape"]
    assert "reliable_beat_up 1.0" in outputs["metrics serve scrape"]
    assert "dead-lettered" in outputs["relay --once (userinfo)"]
    assert "127.0.0.1" in outputs["status (userinfo)"]
    assert json.loads(outputs["dead-letters list --json (userinfo)"].split("\n", 2)[2])
    assert "Connection refused" in outputs["status (down, query)"]
    assert "not a SQLAlchemy URL" in outputs["status (malformed)"]
    assert "Authorization" in everything and "***" in everything

    # httpx turns URL userinfo into "Authorization: Basic base64(user:password)"
    basic = base64.b64encode(f"hook:{SECRETS['webhook userinfo password']}".encode()).decode()
    hits = []
    for what, secret in SECRETS.items():
        for channel, text in outputs.items():
            needles = (secret, secret.lower(), base64.b64encode(secret.encode()).decode()[:12])
            if what == "webhook userinfo password":
                needles += (basic,)
            for needle in needles:
                at = text.find(needle)
                if at != -1:
                    hits.append(f"{what} in {channel}: ...{text[max(0, at - 120):at + 40]!r}")
                    break
    (tmp_path / "outputs.txt").write_text(
        "\n\n".join(f"===== {k}\n{v}" for k, v in outputs.items()))
    assert not hits, "secrets leaked:\n" + "\n".join(hits)


# the credentials a task is given and its exception quotes (tests/apps/secret_app.py)
TASK_SECRETS = {"key kwarg": "LkTaskKey8c41d2e9", "api_key kwarg": "LkTaskApi5e07b3f1"}


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_task_failing_with_its_credentials_leaks_none(pg_store: Store, pg_url: str,
                                                        redis_url: str, tmp_path: Path) -> None:
    """An ``IdempotentTask`` is called with ``key=`` and ``api_key=`` keyword arguments and
    fails with an exception quoting them (``key=... api_key=...``, an ``Authorization``
    header): a real ``celery worker`` at DEBUG (Celery's "TaskPool: Apply" line with the
    message body, its "raised unexpected" ERROR line and traceback, reliable_beat's
    dead-letter ERROR line), ``runs show`` (text and JSON) and ``dead-letters list --json``
    quote neither, and still show the idempotency key in full. On the old code ``key=`` was
    shown in clear everywhere, and Celery's own lines showed both."""
    run_key = "charge:c-42:2026-03"
    queue = f"q-secrets-{os.getpid()}"
    env = _env(pg_url, redis_url, RB_SECRET_BROKER_URL=redis_url, RB_SECRET_DB_URL=pg_url)
    log = tmp_path / "worker.log"
    worker = _start([sys.executable, "-m", "celery", "-A", "secret_app", "worker", "--pool",
                     "solo", "-c", "1", "-Q", queue, "-l", "debug", "--without-gossip",
                     "--without-mingle", "--without-heartbeat"], env, tmp_path, log)
    try:
        _wait_text(log, "ready.", 60)
        sent = subprocess.run(
            [sys.executable, "-c",
             "import sys; from secret_app import charge; charge.apply_async(('c-42',), "
             "{'key': sys.argv[1], 'api_key': sys.argv[2]}, queue=sys.argv[3], "
             "headers={'reliable_beat_key': sys.argv[4]})",
             TASK_SECRETS["key kwarg"], TASK_SECRETS["api_key kwarg"], queue, run_key],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert sent.returncode == 0, sent.stderr
        _wait_text(log, "dead-lettered", 60)
        _wait_text(log, "raised unexpected", 30)
    finally:
        _stop(worker)
    outputs = {"worker log (DEBUG)": log.read_text(errors="replace")}
    db_env = {**env, "RELIABLE_BEAT_DATABASE_URL": pg_url}
    for cmd in (["runs", "show", run_key], ["runs", "show", run_key, "--json"],
                ["dead-letters", "list", "--json"]):
        outputs[" ".join(cmd)] = _run([*CLI, *cmd], db_env, tmp_path)

    worker_log = outputs["worker log (DEBUG)"]
    assert "TaskPool: Apply" in worker_log and "ERROR" in worker_log
    shown = outputs[f"runs show {run_key}"]
    assert "key=*** api_key=***" in shown, shown
    assert f"idempotency key: {run_key}" in shown, shown  # our own words: not mangled
    assert f"idempotency_key   {run_key}" in shown, shown
    assert '"key": "***"' in outputs[f"runs show {run_key} --json"]
    hits = [f"{what} in {channel}: ...{text[max(0, text.find(secret) - 120):][:200]!r}"
            for what, secret in TASK_SECRETS.items() for channel, text in outputs.items()
            if secret in text]
    (tmp_path / "outputs.txt").write_text(
        "\n\n".join(f"===== {k}\n{v}" for k, v in outputs.items()))
    assert not hits, "secrets leaked:\n" + "\n".join(hits)
