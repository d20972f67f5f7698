"""``docs/quickstart.md`` is run as written: its ``# file: proj.py`` and ``# file:
merchant.py`` blocks are written to a directory, and the commands of its bash block run
there as real processes (``db upgrade``, ``create_tables``, the stand-in merchant, beat,
worker, relay, ``entries trigger``) on the PostgreSQL and Redis the tests start.

Replaced, each checked to be there: the Redis URL, the database URL and the merchant's port
(a free one). Then the triggered run commits one ``payouts`` row and its webhook reaches
the merchant once; no dead letter. The page used to define ``payouts`` without creating it
and left the destination a comment: a first run dead-lettered twice.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from harness.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
BIN = Path(sys.executable).parent
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
pytestmark = [pytest.mark.timeout(180), pytest.mark.postgres, pytest.mark.redis]


def page() -> tuple[dict[str, str], list[str]]:
    files: dict[str, str] = {}
    commands: list[str] = []
    for lang, body in BLOCK.findall(PAGE.read_text()):
        m = re.fullmatch(r"# file: (\w+\.py)", body.partition("\n")[0].strip())
        if lang == "python" and m:
            files[m.group(1)] = body
        elif lang == "bash" and "db upgrade" in body:
            commands = [line.split("  #")[0].strip() for line in body.splitlines()
                        if line.split("  #")[0].strip()]
    return files, commands


def replace(text: str, old: str, new: str) -> str:
    assert old in text, f"the quick start no longer contains {old!r}: update this test"
    return text.replace(old, new)


def test_quick_start_runs_as_written(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    files, commands = page()
    assert set(files) == {"proj.py", "merchant.py"}, files
    assert [c.split(" -A proj")[0].split()[0] for c in commands] == [
        "reliable-beat", "python", "python", "celery", "celery", "celery", "reliable-beat"
    ], commands
    port = str(free_port())
    files["proj.py"] = replace(replace(replace(
        files["proj.py"], "redis://localhost:6379/0", redis_url),
        "postgresql+psycopg://app:secret@db/app", pg_url), "127.0.0.1:8000", f"127.0.0.1:{port}")
    files["merchant.py"] = replace(files["merchant.py"], '("127.0.0.1", 8000)',
                                   f'("127.0.0.1", {port})')
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("RELIABLE_BEAT_")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    engine = sa.create_engine(pg_url)
    procs: list[subprocess.Popen[bytes]] = []
    files_open: list[Any] = []

    def run(command: str) -> str:
        done = subprocess.run(shlex.split(command), cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{command}:\n{done.stdout}{done.stderr}\n{logs()}"
        return done.stdout

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(tmp_path.glob("*.log")))

    try:
        upgrade, tables, merchant, *daemons, trigger = commands
        run(upgrade)
        run(tables)
        for i, command in enumerate([merchant, *daemons]):
            log = open(tmp_path / f"{i}.log", "wb")  # noqa: SIM115
            files_open.append(log)
            argv = shlex.split(command)
            if argv[:4] == ["celery", "-A", "proj", "worker"]:
                argv += ["-P", "solo"]  # one process is enough here
            procs.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        while True:  # the beat syncs the entry at its start
            done = subprocess.run(shlex.split(trigger), cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                break
            assert time.monotonic() < deadline, done.stdout + done.stderr + logs()
            time.sleep(0.5)
        deadline = time.monotonic() + 90
        while "POST /hook pay-merchants@manual:" not in (tmp_path / "0.log").read_text():
            for proc in procs:
                assert proc.poll() is None, f"a process exited ({proc.args}):\n{logs()}"
            assert time.monotonic() < deadline, f"no webhook reached the merchant:\n{logs()}"
            time.sleep(0.3)
        with engine.connect() as conn:
            paid = conn.execute(sa.text("SELECT run_key FROM payouts")).scalars().all()
            dead = conn.execute(sa.text(
                "SELECT count(*) FROM reliable_beat_dead_letters")).scalar_one()
        assert len(paid) == 1 and paid[0].startswith("pay-merchants@manual:"), paid
        assert dead == 0, logs()
        posts = [x for x in (tmp_path / "0.log").read_text().splitlines()
                 if x.startswith("POST ")]
        # the Idempotency-Key header is the outbox row's message id: the run's key, "#1"
        assert posts == [f'POST /hook {paid[0]}#1 {{"run": "{paid[0]}"}}'], posts
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        for log in files_open:
            log.close()
        engine.dispose()
