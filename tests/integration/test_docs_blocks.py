"""Every code block of ``docs/*.md`` and ``README.md`` is checked; the docs' references exist.

* Every ```python block compiles (``ast.parse``).
* Every ```python block runs, page by page, in one namespace per page seeded with
  :data:`PRELUDE` (the names a page may use without defining them: ``app``, ``payouts``,
  ...), in a child process working in a temporary directory. Excepted: a block preceded by
  ``<!-- skip-exec: reason -->``, and a block whose first line is ``# file: NAME`` or
  ``# proj/NAME.py`` (a file of an example project: the page's own test writes and runs
  those, tests/integration/test_docs_testing.py and
  tests/acceptance/test_docs_dramatiq_quickstart.py, tests/acceptance/test_docs_quickstart.py).
* Every ``outbox.add(conn, "<built-in destination>", {...})`` a block shows (in code or in a
  comment) is checked against that handler's payload check (reliable_beat.payloads): a
  retired ``{"url": ...}`` row fails here.
* Every ``reliable-beat ...`` command of a console/bash/plain block parses with the real
  click command line (no unknown command or option, no missing argument).
* Every relative link and every ``docs/...``, ``tests/...``, ``examples/...`` path or ``NAME.md``
  the docs, README and Makefile mention exists, and no page speaks of files outside the
  repository (``../shared``) or of work not done yet.

The convention is documented in docs/development.md.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from reliable_beat.cli import reliable_beat as cli
from reliable_beat.errors import OutboxPayloadError
from reliable_beat.payloads import BUILTIN_VALIDATORS, check_payload

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w{}-]*)[^\n]*\n"
                   r"(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"<!--\s*skip-exec:\s*(?P<reason>.+?)\s*-->\s*$")
FILE_BLOCK = re.compile(r"#\s*(file:\s*\S+|proj/\w+\.py)\s*$")

#: Run before a page's first block, in the page's namespace: "your app" and its tables.
PRELUDE = '''
from datetime import timedelta
import sqlalchemy as sa
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, declarative_base
from celery import Celery
from celery.schedules import crontab
from reliable_beat import IdempotentTask

app = Celery("proj", broker="memory://", set_as_current=False)
app.conf.reliable_beat_database_url = "sqlite:///store.sqlite3"
my_engine = sa.create_engine("sqlite:///app.sqlite3")
_metadata = sa.MetaData()
payouts = sa.Table("payouts", _metadata, sa.Column("id", sa.Integer, primary_key=True),
                   sa.Column("merchant_id", sa.Integer), sa.Column("period", sa.String(20)),
                   sa.Column("run_id", sa.Integer), sa.Column("run_key", sa.String(200)))
orders = sa.Table("orders", _metadata, sa.Column("id", sa.String(50), primary_key=True),
                  sa.Column("cents", sa.Integer))
_metadata.create_all(my_engine)
_Base = declarative_base()

class Payout(_Base):
    __tablename__ = "orm_payouts"
    id = sa.Column(sa.Integer, primary_key=True)
    merchant_id = sa.Column(sa.Integer)
    run_id = sa.Column(sa.Integer)
'''

#: The child: runs each page's blocks in order; prints one JSON line per failure.
RUNNER = '''
import json, os, sys, traceback
pages = json.load(sys.stdin)
for page in pages:
    os.makedirs(page["dir"]); os.chdir(page["dir"])
    ns = {"__name__": "__docs__"}
    exec(compile(page["prelude"], "<prelude>", "exec"), ns)
    for where, code in page["blocks"]:
        try:
            exec(compile(code, where, "exec"), ns)
        except BaseException:
            print("RB-DOCS-FAILURE " + json.dumps(
                {"where": where, "error": traceback.format_exc(limit=-3)}))
'''


def fenced(path: Path) -> list[tuple[str, str, int, str | None]]:
    """(language, body, line, skip reason) of every fenced block of ``path``."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        indent = m.group("indent")
        body = "\n".join(b[len(indent):] if b.startswith(indent) else b
                         for b in m.group("body").split("\n"))
        out.append((m.group("lang"), body, line, skip.group("reason") if skip else None))
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def python_blocks() -> list[tuple[Path, int, str, str | None]]:
    return [(page, line, body, skip) for page in PAGES
            for lang, body, line, skip in fenced(page) if lang == "python"]


def test_python_blocks_compile() -> None:
    problems = []
    for page, line, body, _ in python_blocks():
        try:
            ast.parse(body)
        except SyntaxError as exc:
            problems.append(f"{rel(page)}:{line + (exc.lineno or 0)}: {exc.msg}")
    assert not problems, "\n".join(problems)


def test_python_blocks_run(tmp_path: Path) -> None:
    pages: list[dict[str, Any]] = []
    skipped = []
    for page, line, body, skip in python_blocks():
        first = body.lstrip().partition("\n")[0]
        if skip or FILE_BLOCK.fullmatch(first.strip()):
            skipped.append(f"{rel(page)}:{line}")
            continue
        if not pages or pages[-1]["page"] != rel(page):
            pages.append({"page": rel(page), "dir": str(tmp_path / page.stem),
                          "prelude": PRELUDE, "blocks": []})
        pages[-1]["blocks"].append((f"{rel(page)}:{line}", "\n" * line + body))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in list(env):
        if name.startswith(("RELIABLE_BEAT_", "DJANGO_SETTINGS")):
            env.pop(name)
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(pages), env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    # a marked line each: a block may print JSON of its own (a console span exporter)
    marker = "RB-DOCS-FAILURE "
    failures = [json.loads(line[len(marker):]) for line in proc.stdout.splitlines()
                if line.startswith(marker)]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not failures, "\n\n".join(f"{f['where']}:\n{f['error']}" for f in failures)
    # the exceptions stay few: each is a file of a project run by its page's test, or named
    assert len(skipped) <= 12, skipped


# --------------------------------------------------------------- outbox payloads shown


def _value(node: ast.AST) -> Any:
    """A payload literal, with the docs' placeholders (``...``, names, calls) as stand-ins."""
    if isinstance(node, ast.Dict):
        pairs = zip(node.keys, node.values, strict=True)
        return {_value(k): _value(v) for k, v in pairs if k is not None}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Set) and all(isinstance(e, ast.Constant) and e.value is Ellipsis
                                         for e in node.elts):
        return {}  # {...}: any JSON object
    if isinstance(node, ast.Constant):
        return "placeholder" if node.value is Ellipsis else node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "1" for v in node.values)
    return "placeholder"


ADD = re.compile(r"\.add\(\s*\w+\s*,\s*\"(?P<dest>[\w-]+)\"\s*,")


def _calls_in_comments(body: str) -> list[str]:
    """``outbox.add(...)`` calls written in comments (a comment block joined line by line)."""
    text = "\n".join(line.split("#", 1)[1] if "#" in line else "" for line in body.splitlines())
    found = []
    for m in ADD.finditer(text):
        start = text.rfind(" ", 0, m.start()) + 1
        for end in range(m.end(), len(text) + 1):
            candidate = text[start:end]
            try:
                ast.parse(candidate.replace("\n", " ").strip())
            except SyntaxError:
                continue
            found.append(candidate.replace("\n", " ").strip())
            break
    return found


def shown_payloads() -> list[tuple[str, str, ast.AST]]:
    """(where, destination, payload node) of every built-in ``.add(tx, "dest", payload)``."""
    out = []
    for page, line, body, _ in python_blocks():
        sources = [body, *_calls_in_comments(body)]
        for source in sources:
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "add" and len(node.args) >= 3
                        and isinstance(node.args[1], ast.Constant)
                        and node.args[1].value in BUILTIN_VALIDATORS):
                    out.append((f"{rel(page)}:{line + getattr(node, 'lineno', 0)}",
                                node.args[1].value, node.args[2]))
    return out


def test_outbox_payloads_shown_are_deliverable() -> None:
    shown = shown_payloads()
    assert len(shown) >= 8, shown  # the pages show webhook, smtp, dramatiq rows
    problems = []
    for where, destination, node in shown:
        if isinstance(node, ast.Set):
            problems.append(f"{where}: show the {destination!r} payload, not {{...}}")
            continue
        try:
            check_payload(destination, _value(node), label=where)
        except OutboxPayloadError as exc:
            problems.append(str(exc))
    assert not problems, "\n".join(problems)


def test_the_payload_check_sees_the_retired_url_form() -> None:
    node = ast.parse('outbox.add(tx, "webhook", {"url": "/payouts", "body": {"id": p.pk}})')
    call = next(n for n in ast.walk(node) if isinstance(n, ast.Call))
    with pytest.raises(OutboxPayloadError, match="'url'"):
        check_payload("webhook", _value(call.args[2]), label="x")


# --------------------------------------------------------------- CLI commands shown


def commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line, argv after ``reliable-beat``) of the commands shown in ``path``'s shell blocks."""
    out = []
    blocks = ([("", path.read_text(), 0, None)] if path.name == "Makefile"
              else fenced(path))
    for lang, body, line, _ in blocks:
        if lang not in ("", "bash", "console", "sh", "shell"):
            continue
        text = re.sub(r"\\\n\s*", " ", body)
        for n, raw in enumerate(text.splitlines()):
            cmd = raw.strip().removeprefix("$ ").split(" #", 1)[0]
            if "reliable-beat" not in cmd:
                continue
            for segment in re.split(r"\|\||&&|[|;]", cmd):
                try:
                    words = shlex.split(segment.split(">", 1)[0])
                except ValueError:
                    continue
                if not words or words[0] not in ("reliable-beat", "celery", "xargs"):
                    continue
                if "reliable-beat" not in words:
                    continue
                # `celery -A proj reliable-beat ...` mounts the same commands
                argv = words[words.index("reliable-beat") + 1:]
                if words[0] == "xargs":  # the id comes from the pipe
                    argv.append("1")
                out.append((line + n + 1, argv))
    return out


def _parse(command: click.Command, argv: list[str], parent: click.Context | None) -> None:
    ctx = command.make_context(command.name, list(argv), parent=parent)
    if isinstance(command, click.Group):
        rest = [*ctx._protected_args, *ctx.args]  # type: ignore[attr-defined]
        if rest:
            _name, sub, args = command.resolve_command(ctx, rest)
            assert sub is not None
            _parse(sub, args, ctx)


def test_cli_commands_shown_parse() -> None:
    shown = [(rel(page), line, argv) for page in [*PAGES, ROOT / "Makefile"]
             for line, argv in commands(page)]
    assert len(shown) > 50, shown
    problems = []
    for where, line, argv in shown:
        try:
            _parse(cli, argv, None)
        except click.exceptions.Exit:
            pass
        except click.ClickException as exc:
            problems.append(f"{where}:{line}: reliable-beat {shlex.join(argv)}: "
                            f"{exc.format_message()}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------- references


MENTION = re.compile(r"(?<![\w./-])((?:\.\./)*(?:docs|tests|examples|harness|benchmarks|"
                     r"reliable_beat|\.\./shared|shared)/[\w./-]*\w)")
BARE_MD = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s]+)\)")


def test_referenced_files_exist() -> None:
    problems = []
    for page in [*PAGES, ROOT / "Makefile"]:
        text = page.read_text()
        for m in LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            if target and not (page.parent / target).exists():
                problems.append(f"{rel(page)}: link to {target!r}, which does not exist")
        for m in MENTION.finditer(text):
            path = m.group(1).split("::", 1)[0].rstrip(".")
            if "/_build" in path:  # made by `make docs`
                continue
            base = page.parent if path.startswith("../") else ROOT
            if not (base / path).exists():
                problems.append(f"{rel(page)}: mentions {path!r}, which does not exist")
        for m in BARE_MD.finditer(text):
            name = m.group(1)
            if not ((ROOT / "docs" / name).exists() or (ROOT / name).exists()):
                problems.append(f"{rel(page)}: mentions {name!r}, which does not exist")
    assert not problems, "\n".join(sorted(set(problems)))


#: Phrases of a page written about the project's own history, not for its users.
HISTORY = re.compile(r"(\bNot yet\b|\bnot yet (?:shipped|implemented|built|available|done)|"
                     r"\bpart 2\b|\bsecond part\b|\*Reserved\.\*|nothing here exists|"
                     r"\bsessions? \d|fresh user|\bthe lead\b|\bhelpers?'|\bissue \d+|"
                     r"\bissues? #\d+|\bthis session\b)")


def test_pages_speak_to_users() -> None:
    problems = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in HISTORY.finditer(line):
                problems.append(f"{rel(page)}:{n}: {m.group(0)!r}: {line.strip()[:100]}")
    assert not problems, "\n".join(problems)
