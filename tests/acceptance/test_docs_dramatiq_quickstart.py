"""``docs/dramatiq.md``'s quick start is run as written: the fenced blocks whose first line is
``# proj/NAME.py`` are written to ``proj/NAME.py`` (no ``__init__.py``: the page has none),
and the commands of its console block (``reliable-beat db upgrade``, ``reliable-beat
dramatiq beat|relay --broker proj.broker:broker``, ``dramatiq proj.actors``) run as real
processes from the directory holding ``proj/``, without PYTHONPATH pointing at it, on the
real PostgreSQL and Redis the tests start (two beats, as the page says "any number").

Only three strings of the page are replaced, each checked to be there: the Redis URL, the
database URL and the cron string ``"0 2 * * *"`` (by a 3 s interval, so a slot is due while
the test runs). Then each slot of ``pay_merchants`` fires once (one run, one ``payouts``
row carrying the run's fence token) and the outbox row it commits reaches ``send_invoice``
through the relay.
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

import pytest
import sqlalchemy as sa

pytest.importorskip("dramatiq")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "dramatiq.md"
BIN = Path(sys.executable).parent
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
pytestmark = [pytest.mark.timeout(300)]


def quick_start() -> tuple[dict[str, str], list[str]]:
    """(``{path: text}`` of the ``# proj/...`` blocks, the commands of the console block
    that runs them), from the page's ``## Quick start`` section."""
    text = PAGE.read_text()
    section = text[text.index("## Quick start"):]
    section = section[:section.index("\n## ", 1)]
    files: dict[str, str] = {}
    commands: list[str] = []
    for lang, body in BLOCK.findall(section):
        first = body.partition("\n")[0].strip()
        m = re.fullmatch(r"# (proj/\w+\.py)", first)
        if lang == "python" and m:
            files[m.group(1)] = body
        elif lang == "console" and "--broker proj.broker:broker" in body:
            commands = [line.split("#")[0].strip() for line in body.splitlines()
                        if line.split("#")[0].strip()]
    return files, commands


def replace(text: str, old: str, new: str) -> str:
    assert old in text, f"the quick start no longer contains {old!r}: update this test"
    return text.replace(old, new)


@pytest.mark.postgres
@pytest.mark.redis
def test_quick_start_runs_as_written(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    files, commands = quick_start()
    assert set(files) == {"proj/broker.py", "proj/actors.py"}, files
    assert [" ".join(c.split()).split(" --")[0] for c in commands] == [
        "reliable-beat db upgrade", "reliable-beat dramatiq beat", "dramatiq proj.actors",
        "reliable-beat dramatiq relay"], commands
    files["proj/broker.py"] = replace(
        replace(files["proj/broker.py"], "redis://localhost:6379/0", redis_url),
        "postgresql+psycopg://app@db/app", pg_url)
    files["proj/actors.py"] = replace(files["proj/actors.py"], 'periodic="0 2 * * *"',
                                      "periodic=3")
    (tmp_path / "proj").mkdir()
    for name, body in files.items():
        (tmp_path / name).write_text(body)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1",
               RELIABLE_BEAT_DATABASE_URL=pg_url)
    engine = sa.create_engine(pg_url)
    procs: list[subprocess.Popen[bytes]] = []

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(tmp_path.glob("*.log")))

    try:
        upgrade = subprocess.run(shlex.split(commands[0]), cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
        with engine.begin() as conn:  # the user's own migration creates their table
            conn.execute(sa.text("CREATE TABLE payouts (run_id BIGINT PRIMARY KEY, "
                                 "fence BIGINT NOT NULL)"))
        for i, command in enumerate([commands[1], *commands[1:]]):  # two beats
            log = open(tmp_path / f"{i}-{command.split()[1]}.log", "wb")  # noqa: SIM115
            procs.append(subprocess.Popen(shlex.split(command), cwd=tmp_path, env=env,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))

        def succeeded(task: str) -> list[dict[str, object]]:
            with engine.connect() as conn:
                return [dict(r) for r in conn.execute(sa.text(
                    "SELECT * FROM reliable_beat_runs WHERE task = :t AND state = 'succeeded'"
                ).bindparams(t=task)).mappings()]

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if len(succeeded("pay_merchants")) >= 2 and succeeded("send_invoice"):
                break
            for proc in procs:
                assert proc.poll() is None, f"a process exited ({proc.args}):\n{logs()}"
            time.sleep(1)
        else:
            pytest.fail(f"no two paid slots and a sent invoice within 180 s:\n{logs()}")

        with engine.connect() as conn:
            runs = [dict(r) for r in conn.execute(sa.text(
                "SELECT id, fire_at, state, fence_token FROM reliable_beat_runs "
                "WHERE entry_name = 'pay_merchants'")).mappings()]
            paid = {r.run_id: r.fence for r in conn.execute(sa.text(
                "SELECT run_id, fence FROM payouts"))}
            invoices = conn.execute(sa.text(
                "SELECT count(*) FROM reliable_beat_runs WHERE task = 'send_invoice' "
                "AND idempotency_key = 'invoice:42:send'")).scalar_one()
        slots = [r["fire_at"] for r in runs]
        assert len(slots) == len(set(slots)), runs  # one run per slot, whichever beat fired
        done = [r for r in runs if r["state"] == "succeeded"]
        assert {r["id"]: r["fence_token"] for r in done} == {
            k: v for k, v in paid.items() if k in {r["id"] for r in done}}, (runs, paid)
        assert set(paid) <= {r["id"] for r in runs}, (runs, paid)  # one effect per run
        assert invoices == 1, invoices  # one key, sent by the relay once per slot, run once
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        engine.dispose()


def test_a_beat_whose_broker_module_declares_no_actor_says_so(tmp_path: Path) -> None:
    """The quick start's ``proj/broker.py`` without its ``import proj.actors`` line (the
    mistake the page used to make): the beat warns on stderr, naming the module and the fix,
    instead of only logging "0 entries; nothing to sync"."""
    files, _ = quick_start()
    broker = files["proj/broker.py"]
    line = next(x for x in broker.splitlines() if x.startswith("import proj.actors"))
    broker = replace(broker, line + "\n", "")
    broker = replace(broker, "postgresql+psycopg://app@db/app",
                     f"sqlite:///{tmp_path / 'rb.sqlite3'}")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "broker.py").write_text(broker)
    (tmp_path / "proj" / "actors.py").write_text(files["proj/actors.py"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([str(BIN / "reliable-beat"), "dramatiq", "beat", "--broker",
                             "proj.broker:broker"], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        while not lines or not lines[-1].startswith(("dramatiq beat ", "error:")):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    [warning] = [x for x in lines if x.startswith("warning: dramatiq beat:")] or [""]
    assert "proj.broker:broker declares no periodic actor" in warning, lines
    assert "import proj.actors" in warning, lines
