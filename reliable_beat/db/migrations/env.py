"""Alembic environment for reliable_beat's own migrations (version table
``reliable_beat_alembic_version``, so they never collide with the application's)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from reliable_beat.db.tables import exists_on, metadata

VERSION_TABLE = "reliable_beat_alembic_version"

config = context.config


def include_object(obj: object, name: str | None, type_: str, reflected: bool,
                   compare_to: object) -> bool:
    """Autogenerate skips items declared for other dialects only (``Index.ddl_if``)."""
    return reflected or exists_on(obj, context.get_context().dialect.name)


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        literal_binds=True,
        version_table=VERSION_TABLE,
        render_as_batch=True,
        include_object=include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "", hide_parameters=True)
        with engine.begin() as conn:
            _run(conn)
        engine.dispose()
    else:
        _run(connection)


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,
        include_object=include_object,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
