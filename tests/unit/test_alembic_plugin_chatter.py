"""Alembic's import-time ``setup plugin alembic.autogenerate.*`` INFO lines never reach a
root logger at INFO (Django's ``LOGGING``): a fresh user saw seven of them before every
``manage.py reliable_beat`` command's output."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_schema_commands_print_no_alembic_plugin_setup_lines(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rb.db'}"
    script = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(name)s %(levelname)s %(message)s")
        from reliable_beat.db.dialects import Store
        from reliable_beat.db import migrate
        store = Store.from_url({url!r})
        migrate.ensure_schema(store, run_migrations=True)
        print("current", migrate.current(store))
        logging.getLogger("alembic.runtime.plugins").info("setup plugin %s", "x.y")
        logging.getLogger("alembic.runtime.plugins").warning("a real plugin warning")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "setup plugin" not in out, out
    assert "current " in out and "current None" not in out, out  # it did migrate
    assert "a real plugin warning" in out, out  # only the setup chatter is dropped
