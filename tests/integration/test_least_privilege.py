"""The roles of docs/security.md, exactly as written there, on a real PostgreSQL.

The SQL blocks and the upgrade command are parsed out of ``docs/security.md`` (the blocks
after ``<!-- least-privilege: ... -->`` markers) and run as the page says: the setup as the
superuser, ``db upgrade`` as ``rb_owner``, the version-table revoke as ``rb_owner``. Then:

* ``rb_app`` (DML only) runs a real ``ReliableScheduler`` tick, an ``IdempotentTask`` and a
  relay cycle, and is refused ``CREATE TABLE``, temporary tables and writes to the migration
  version table;
* ``rb_monitor`` reads ``status`` and cannot write;
* a table created later by ``rb_owner`` (a future migration) is usable by ``rb_app`` through
  ``ALTER DEFAULT PRIVILEGES``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner

from reliable_beat.celery.commands import reliable_beat
from reliable_beat.celery.task import IdempotentTask
from reliable_beat.cli.status import collect_status
from reliable_beat.db.dialects import Store
from reliable_beat.db.migrate import head
from reliable_beat.db.tables import attempts, entries, outbox, runs
from reliable_beat.relay import Relay

SECURITY_MD = Path(__file__).resolve().parents[2] / "docs" / "security.md"
ROLES = ("rb_app", "rb_monitor", "rb_owner")


def doc_block(marker: str) -> tuple[str, str]:
    """``(language, text)`` of the fenced block right after ``<!-- least-privilege: marker -->``."""
    text = SECURITY_MD.read_text()
    m = re.search(rf"<!-- least-privilege: {re.escape(marker)} -->\n```(\w+)\n(.*?)\n```",
                  text, re.S)
    assert m, f"docs/security.md has no block marked {marker!r}"
    return m.group(1), m.group(2)


def run_script(conn: sa.Connection, script: str) -> None:
    """Run ``script`` as written (several statements, DO blocks) like ``psql -f`` would: on
    the driver connection without parameters, so ``%I`` in it is no placeholder."""
    driver = conn.connection.driver_connection
    assert driver is not None
    driver.execute(script)


def as_role(url: str, role: str) -> str:
    return sa.engine.make_url(url).set(username=role, password=None).render_as_string(False)


def _drop_roles(conn: sa.Connection) -> None:
    for role in ROLES:
        if conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first():
            conn.execute(sa.text(f"DROP OWNED BY {role} CASCADE"))
            conn.execute(sa.text(f"DROP ROLE {role}"))


@pytest.fixture
def roles(pg_url: str) -> Iterator[str]:
    """The documented setup run on a fresh, unmigrated database; yields its superuser URL."""
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    lang, setup = doc_block("setup")
    assert lang == "postgresql"
    with admin.connect() as conn:
        _drop_roles(conn)  # left by an earlier, interrupted run (roles are cluster-wide)
        run_script(conn, setup)
    try:
        yield pg_url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE usename = ANY(:r) AND pid <> pg_backend_pid()"), {"r": list(ROLES)})
            _drop_roles(conn)
        admin.dispose()


def test_documented_roles_have_exactly_what_they_need(roles: str) -> None:
    owner_url = as_role(roles, "rb_owner")
    app_url = as_role(roles, "rb_app")
    monitor_url = as_role(roles, "rb_monitor")

    # the documented upgrade command, with this test's URL for the owner
    lang, command = doc_block("upgrade")
    assert lang == "console"
    argv = shlex.split(command.strip().removeprefix("$ "))
    assert argv[0] == "reliable-beat" and argv[1] == "--database-url"
    assert sa.engine.make_url(argv[2]).username == "rb_owner"
    argv[2] = owner_url
    result = CliRunner().invoke(reliable_beat, argv[1:], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert head() in result.output

    lang, after = doc_block("after-first-upgrade")
    assert lang == "postgresql"
    owner = sa.create_engine(owner_url)
    with owner.begin() as conn:
        run_script(conn, after)

    store = Store.from_url(app_url)
    try:
        _app_role_runs_beat_worker_and_relay(store, app_url)
        for ddl in ("CREATE TABLE rb_should_fail (id int)",
                    "CREATE TEMP TABLE rb_should_fail (id int)",
                    "UPDATE reliable_beat_alembic_version SET version_num = 'x'",
                    "DELETE FROM reliable_beat_alembic_version"):
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), \
                    store.begin() as conn:
                conn.execute(sa.text(ddl))
        with store.connect() as conn:  # the schema check reads the version table
            assert conn.execute(sa.text(
                "SELECT version_num FROM reliable_beat_alembic_version")).scalar_one() == head()

        # a later migration's table, created by the owner, is usable by the app role
        with owner.begin() as conn:
            conn.execute(sa.text(
                "CREATE TABLE reliable_beat_future (id bigserial PRIMARY KEY, note text)"))
        with store.begin() as conn:
            conn.execute(sa.text("INSERT INTO reliable_beat_future (note) VALUES ('ok')"))
    finally:
        store.dispose()
        owner.dispose()

    monitor = Store.from_url(monitor_url)
    try:
        info = collect_status(monitor)
        assert [e["name"] for e in info["entries"]] == ["hourly"]
        with pytest.raises(sa.exc.ProgrammingError, match="permission denied"), \
                monitor.begin() as conn:
            conn.execute(sa.delete(entries))
    finally:
        monitor.dispose()


def _app_role_runs_beat_worker_and_relay(store: Store, app_url: str) -> None:
    app = Celery("lp", broker="memory://")
    app.conf.update(
        reliable_beat_database_url=app_url,
        # hourly: the slot the test makes due is the only one a slow (loaded) tick can find
        beat_schedule={"hourly": {"task": "lp.pay", "schedule": timedelta(hours=1)}},
        task_always_eager=False,
        # one tick, one run: a slow first claim on a loaded machine would also claim the
        # next slot ahead (tests/integration/test_scheduler_hold.py covers that path)
        reliable_beat_claim_ahead_seconds=0,
    )

    @app.task(shared=False, base=IdempotentTask, bind=True, name="lp.pay")
    def pay(self: IdempotentTask) -> str:
        with self.transaction() as tx:
            tx.execute(sa.select(sa.literal(1)))
            self.outbox.add(tx, "celery", {"task": "lp.noop", "args": [], "kwargs": {}})
        return "paid"

    from reliable_beat.celery.scheduler import ReliableScheduler

    scheduler = ReliableScheduler(app=app)  # checks the schema, syncs beat_schedule
    try:
        with store.begin() as conn:  # make the entry due now
            conn.execute(sa.text("UPDATE reliable_beat_entries SET next_fire_at = now()"))
        scheduler.tick()
    finally:
        scheduler.close()
    with store.engine.connect() as conn:
        run = conn.execute(sa.select(runs)).one()
    assert run.state == "dispatched"

    result = pay.apply(headers={"reliable_beat_key": run.idempotency_key})  # the worker side
    assert result.get() == "paid"
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(runs.c.state)).scalar_one() == "succeeded"
        assert conn.execute(sa.select(attempts.c.outcome)).scalar_one() == "succeeded"

    relay = Relay(store, app)
    relay.run_once()  # publishes the task's outbox message through the memory broker
    relay.close()
    with store.engine.connect() as conn:
        states = conn.execute(
            sa.select(outbox.c.state).where(outbox.c.destination == "celery")
        ).scalars().all()
    assert states and set(states) == {"sent"}
