"""reliable_beat's tables for Django: ``manage.py migrate`` runs reliable_beat's own Alembic
migrations, then records the unmanaged models' state.

Why Alembic under Django and not Django migrations of our own: the schema is one, shared
with projects without Django (CLI ``reliable-beat db upgrade``, Flask, scripts), versioned in
its own table (``reliable_beat_alembic_version``) and upgraded under an advisory lock by
whichever process gets there first. Writing it twice would let the two drift. So this
migration calls :func:`reliable_beat.db.migrate.upgrade` on the store when ``migrate`` runs
for the store's Django database; the app's ``post_migrate`` handler does the same on every
later ``migrate``, so a new reliable_beat release's revisions are applied too. Reversing it
keeps the tables (history is never dropped by a rollback of migrations; drop them by hand).
"""

from django.db import migrations, models


def upgrade_store(apps, schema_editor):  # type: ignore[no-untyped-def]
    from reliable_beat.contrib.django.signals import upgrade_for_alias

    upgrade_for_alias(schema_editor.connection.alias)


class Migration(migrations.Migration):

    initial = True
    # Alembic works on its own connection; nothing of Django's must hold locks meanwhile.
    atomic = False

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.RunPython(upgrade_store, migrations.RunPython.noop, elidable=False),
        migrations.CreateModel(
            name='Attempt',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('attempt', models.IntegerField()),
                ('fence_token', models.BigIntegerField()),
                ('worker', models.CharField(max_length=200, null=True)),
                ('task_id', models.CharField(max_length=64, null=True)),
                ('started_at', models.DateTimeField()),
                ('finished_at', models.DateTimeField(null=True)),
                ('outcome', models.CharField(max_length=16)),
                ('error', models.TextField(null=True)),
                ('retry_in_seconds', models.FloatField(null=True)),
            ],
            options={
                'db_table': 'reliable_beat_attempts',
                'ordering': ['id'],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='DeadLetter',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('kind', models.CharField(max_length=16)),
                ('run_id', models.BigIntegerField(null=True)),
                ('outbox_id', models.BigIntegerField(null=True)),
                ('key', models.CharField(max_length=400)),
                ('entry_name', models.CharField(max_length=200, null=True)),
                ('task', models.CharField(max_length=255, null=True)),
                ('destination', models.CharField(max_length=200, null=True)),
                ('payload', models.JSONField()),
                ('reason', models.CharField(max_length=32)),
                ('error', models.TextField(null=True)),
                ('attempts', models.IntegerField()),
                ('created_at', models.DateTimeField()),
                ('requeued_at', models.DateTimeField(null=True)),
                ('requeued_by', models.CharField(max_length=200, null=True)),
            ],
            options={
                'verbose_name': 'dead letter',
                'db_table': 'reliable_beat_dead_letters',
                'ordering': ['-created_at', '-id'],
                'permissions': [('requeue_deadletter', 'Can requeue a dead letter')],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='Entry',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=200, unique=True)),
                ('task', models.CharField(max_length=255)),
                ('args', models.JSONField(default=list)),
                ('kwargs', models.JSONField(default=dict)),
                ('options', models.JSONField(default=dict)),
                ('schedule_kind', models.CharField(max_length=16)),
                ('schedule', models.JSONField()),
                ('timezone', models.CharField(max_length=64)),
                ('misfire_policy', models.CharField(max_length=16)),
                ('misfire_grace_seconds', models.FloatField()),
                ('catch_up_limit', models.IntegerField()),
                ('catch_up_window_seconds', models.FloatField(null=True)),
                ('overlap_policy', models.CharField(max_length=16)),
                ('enabled', models.BooleanField()),
                ('paused', models.BooleanField()),
                ('paused_at', models.DateTimeField(null=True)),
                ('origin', models.CharField(max_length=16)),
                ('config_hash', models.CharField(max_length=64, null=True)),
                ('start_at', models.DateTimeField(null=True)),
                ('end_at', models.DateTimeField(null=True)),
                ('next_fire_at', models.DateTimeField(null=True)),
                ('last_fire_at', models.DateTimeField(null=True)),
                ('created_at', models.DateTimeField()),
                ('updated_at', models.DateTimeField()),
            ],
            options={
                'verbose_name': 'entry',
                'verbose_name_plural': 'entries',
                'db_table': 'reliable_beat_entries',
                'ordering': ['name'],
                'permissions': [('pause_entry', 'Can pause and resume entries'), ('trigger_entry', 'Can trigger an entry now'), ('backfill_entry', 'Can backfill a window of an entry'), ('edit_entry', 'Can add and change runtime entries')],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='OutboxMessage',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('message_id', models.CharField(max_length=400, unique=True)),
                ('destination', models.CharField(max_length=200)),
                ('payload', models.JSONField()),
                ('headers', models.JSONField(default=dict)),
                ('ordering_key', models.CharField(max_length=200, null=True)),
                ('run_id', models.BigIntegerField(null=True)),
                ('state', models.CharField(max_length=16)),
                ('attempts', models.IntegerField()),
                ('available_at', models.DateTimeField()),
                ('claimed_by', models.CharField(max_length=200, null=True)),
                ('created_at', models.DateTimeField()),
                ('sent_at', models.DateTimeField(null=True)),
                ('last_error', models.TextField(null=True)),
            ],
            options={
                'verbose_name': 'outbox message',
                'db_table': 'reliable_beat_outbox',
                'ordering': ['-id'],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='Run',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('idempotency_key', models.CharField(max_length=400, unique=True)),
                ('entry_name', models.CharField(max_length=200, null=True)),
                ('fire_at', models.DateTimeField(null=True)),
                ('trigger', models.CharField(max_length=16)),
                ('task', models.CharField(max_length=255)),
                ('args', models.JSONField(default=list)),
                ('kwargs', models.JSONField(default=dict)),
                ('state', models.CharField(max_length=16)),
                ('fence_token', models.BigIntegerField()),
                ('leased_by', models.CharField(max_length=200, null=True)),
                ('lease_expires_at', models.DateTimeField(null=True)),
                ('attempts', models.IntegerField()),
                ('result', models.JSONField(null=True)),
                ('error', models.TextField(null=True)),
                ('reason', models.TextField(null=True)),
                ('created_at', models.DateTimeField()),
                ('updated_at', models.DateTimeField()),
                ('dispatched_at', models.DateTimeField(null=True)),
                ('started_at', models.DateTimeField(null=True)),
                ('finished_at', models.DateTimeField(null=True)),
            ],
            options={
                'db_table': 'reliable_beat_runs',
                'ordering': ['-created_at', '-id'],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
    ]
