"""The core knows no framework: no core module imports Celery, kombu, Dramatiq or Django, nor
an adapter package (``reliable_beat.celery``, ``.dramatiq``, ``.contrib``), even lazily inside
a function or under ``TYPE_CHECKING``. The core reaches an adapter only through the hook
:mod:`reliable_beat.adapters` (adapters named by ``"module:attr"`` strings).

Core = every module of the package except the adapters (``celery/``, ``dramatiq/``,
``contrib/``), the command line (``cli/``, checked on its own below) and the Celery testing
kit (``testing/kit.py``, ``testing/pytest.py`` and ``testing/__init__.py`` which re-exports the
kit: they run Celery tasks and workers). The package root may import the two
Celery public names lazily in its ``__getattr__`` (``reliable_beat.ReliableScheduler``,
``reliable_beat.IdempotentTask``), nothing else of an adapter.

The command line (``cli/``) holds to the same rule: it loads the ``-A`` app, the app's zone
and the RedBeat / django-celery-beat importers through :mod:`reliable_beat.adapters`, and an
adapter's own commands (``reliable-beat dramatiq ...``) come in through the entry point group
``reliable_beat.cli`` (:func:`reliable_beat.cli.plugin_command`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "reliable_beat"

FORBIDDEN_TOP = ("celery", "kombu", "dramatiq", "django", "amqp", "redbeat", "django_celery_beat")
FORBIDDEN_OWN = ("reliable_beat.celery", "reliable_beat.dramatiq", "reliable_beat.contrib")
NOT_CORE_DIRS = ("celery", "dramatiq", "contrib", "cli")
NOT_CORE_FILES = ("testing/__init__.py", "testing/kit.py", "testing/pytest.py")
#: (file, function) -> modules it may import: the public Celery names, resolved lazily.
ALLOWED = {
    ("__init__.py", "__getattr__"): {"reliable_beat.celery.scheduler",
                                     "reliable_beat.celery.task"},
}


def core_modules() -> list[Path]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in NOT_CORE_DIRS or rel.as_posix() in NOT_CORE_FILES:
            continue
        if "migrations" in rel.parts:  # Alembic revisions: SQLAlchemy + Alembic only
            continue
        out.append(path)
    return out


def cli_modules() -> list[Path]:
    return sorted((PACKAGE / "cli").rglob("*.py"))


def _forbidden(module: str) -> bool:
    top = module.partition(".")[0]
    return top in FORBIDDEN_TOP or any(
        module == own or module.startswith(own + ".") for own in FORBIDDEN_OWN)


def imports_of(path: Path) -> list[tuple[int, str, str]]:
    """``(line, enclosing function or "", module)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = func or child.name
            if isinstance(child, ast.Import):
                found.extend((child.lineno, func, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against the module's package
                    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
                    package = parts if path.name == "__init__.py" else parts[:-1]
                    package = package[:len(package) - (child.level - 1)]
                    base = ".".join(package + ((child.module,) if child.module else ()))
                else:
                    base = child.module or ""
                found.append((child.lineno, func, base))
                # `from reliable_beat import celery` imports the adapter package too
                found.extend((child.lineno, func, f"{base}.{a.name}") for a in child.names
                             if base == "reliable_beat")
            visit(child, name)

    visit(tree, "")
    return found


def test_the_core_is_most_of_the_package() -> None:
    names = {p.relative_to(PACKAGE).as_posix() for p in core_modules()}
    # the modules the framework-neutral claim is about are all walked
    assert {"beat.py", "loop.py", "execution.py", "relay.py", "redispatch.py", "runtime.py",
            "handlers.py", "metrics.py", "settings.py", "schedules/__init__.py", "entries.py",
            "adapters.py", "workflows/__init__.py", "db/dialects.py"} <= names


@pytest.mark.parametrize("path", core_modules(),
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_core_module_imports_no_framework(path: Path) -> None:
    rel = path.relative_to(PACKAGE).as_posix()
    bad = [
        f"reliable_beat/{rel}:{line}: imports {module}"
        + (f" (in {func})" if func else "")
        for line, func, module in imports_of(path)
        if _forbidden(module) and module not in ALLOWED.get((rel, func), set())
    ]
    assert not bad, (
        "core modules must not import a framework or an adapter package; reach the adapter "
        "through reliable_beat.adapters (adapter_for(app)) or move the code into "
        "reliable_beat/celery|dramatiq/:\n" + "\n".join(bad))


@pytest.mark.parametrize("path", cli_modules(),
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_cli_module_imports_no_framework_nor_adapter(path: Path) -> None:
    rel = path.relative_to(PACKAGE).as_posix()
    bad = [
        f"reliable_beat/{rel}:{line}: imports {module}" + (f" (in {func})" if func else "")
        for line, func, module in imports_of(path) if _forbidden(module)
    ]
    assert not bad, (
        "the command line must not import a framework or an adapter package, even lazily: "
        "load the app / importers through reliable_beat.adapters (load_adapter, adapter_for), "
        "or give the adapter's commands to the 'reliable_beat.cli' entry point group "
        "(pyproject.toml):\n" + "\n".join(bad))


def test_the_cli_is_walked() -> None:
    names = {p.relative_to(PACKAGE).as_posix() for p in cli_modules()}
    assert {"cli/__init__.py", "cli/entries.py", "cli/schedule.py", "cli/status.py"} <= names


def test_the_check_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The parser catches the forms a regression would take (the test can fail)."""
    fake = PACKAGE / "_probe_core_imports.py"
    fake.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from reliable_beat.celery.commands import CliContext\n"
        "def f():\n    import kombu.exceptions\n    from celery import schedules\n"
        "from reliable_beat import dramatiq\n"
        "from .contrib import django\n"
    )
    try:
        mods = {m for _, _, m in imports_of(fake) if _forbidden(m)}
    finally:
        fake.unlink()
    assert mods == {"reliable_beat.celery.commands", "kombu.exceptions", "celery",
                    "reliable_beat.dramatiq", "reliable_beat.contrib"}
