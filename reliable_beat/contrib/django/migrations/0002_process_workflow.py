"""Unmanaged models over ``reliable_beat_workflows`` and ``reliable_beat_beats`` (the admin
reads them): workflows with their schedule group, and the beats' and relays' heartbeat rows
(relays since Alembic 0011_relaywatch). The tables belong to reliable_beat's Alembic
migrations (``0001_initial`` runs them); this migration only records the models' state.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('reliable_beat', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='Process',
            fields=[
                ('owner', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('role', models.CharField(max_length=16)),
                ('schedule_group', models.CharField(max_length=200, null=True)),
                ('config_hash', models.CharField(max_length=64, null=True)),
                ('started_at', models.DateTimeField()),
                ('seen_at', models.DateTimeField()),
                ('stopped_at', models.DateTimeField(null=True)),
                ('unregistered', models.JSONField(default=dict)),
                ('destinations', models.JSONField(null=True)),
            ],
            options={
                'verbose_name': 'beat or relay',
                'verbose_name_plural': 'beats and relays',
                'db_table': 'reliable_beat_beats',
                'ordering': ['schedule_group', 'role', 'owner'],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
        migrations.CreateModel(
            name='Workflow',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('workflow_id', models.CharField(max_length=400, unique=True)),
                ('name', models.CharField(max_length=255)),
                ('version', models.CharField(max_length=64, null=True)),
                ('run_no', models.IntegerField()),
                ('state', models.CharField(max_length=16)),
                ('args', models.JSONField(default=list)),
                ('kwargs', models.JSONField(default=dict)),
                ('result', models.JSONField(null=True)),
                ('error', models.JSONField(null=True)),
                ('block_reason', models.TextField(null=True)),
                ('queue', models.CharField(max_length=200, null=True)),
                ('random_seed', models.BigIntegerField()),
                ('fence_token', models.BigIntegerField()),
                ('leased_by', models.CharField(max_length=200, null=True)),
                ('lease_expires_at', models.DateTimeField(null=True)),
                ('wake_seq', models.BigIntegerField()),
                ('claimed_wake_seq', models.BigIntegerField()),
                ('history_len', models.IntegerField()),
                ('history_bytes', models.BigIntegerField()),
                ('advances', models.IntegerField()),
                ('created_at', models.DateTimeField()),
                ('updated_at', models.DateTimeField()),
                ('finished_at', models.DateTimeField(null=True)),
                ('cancel_requested', models.CharField(max_length=16, null=True)),
                ('parent_pk', models.BigIntegerField(null=True)),
                ('parent_run_no', models.IntegerField(null=True)),
                ('parent_seq', models.IntegerField(null=True)),
                ('entry_name', models.CharField(max_length=200, null=True)),
                ('fire_at', models.DateTimeField(null=True)),
                ('schedule_group', models.CharField(max_length=200, null=True)),
            ],
            options={
                'db_table': 'reliable_beat_workflows',
                'ordering': ['-updated_at', '-id'],
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
    ]
