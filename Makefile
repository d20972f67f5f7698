# The two commands a newcomer needs:   make demo   and   make test
# Everything installs into ./.venv from this project's own files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-full test-rabbitmq lint type wheel-check docs bench faults clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,docs,bench]"
	touch $@

# Runs the payouts example on the embedded default (SQLite store, filesystem broker): two beats,
# a worker and a relay for a bounded time, then prints the report.
demo: $(VENV)/.installed
	$(PY) -m examples.payouts --seconds 40

# Unit, integration (real PostgreSQL + Redis started by the tests) and acceptance tests.
# CI size vs full size, split deliberately (docs/development.md): `make test` runs every
# kind of test at least once: every unit and integration test on SQLite, PostgreSQL and Redis,
# one real-process test of each crash/kill kind, the fault smoke, the examples, and a MariaDB
# subset (the integration suite, the workflow engine's unit suites, one kill and one pause on
# real workers). Tests marked `full` are the further variants of a kind CI already runs once
# (another framework's break-it demo, the Dramatiq fault smoke, ...); `make test-full` runs
# them, every MariaDB variant and the RabbitMQ broker axis.
# (the real-process tests first: the two xdist workers take files in this order)
MARIADB_CI_SUBSET := tests/acceptance/test_beats.py::test_sigstop_inside_claim_transaction \
	tests/acceptance/test_idempotent_task.py::test_sigkill_mid_body_redelivers_and_makes_one_effect \
	tests/acceptance/test_idempotent_task.py::test_sigstop_past_lease_is_fenced_out_on_wake tests/acceptance/test_relay_kill.py \
	tests/integration tests/unit/test_workflows.py tests/unit/test_workflow_versions.py tests/unit/test_workflow_sagas.py
# The main pass hands out files in collection order (--no-loadscope-reorder): the long
# real-process files (tests/acceptance, tests/faults) first, the many short unit files last,
# so neither worker idles at the end while the other runs a 1-2 minute test; xdist's default
# order (most tests per file first) put the single-test files, the longest, last.
# The MariaDB subset too: each worker starts its own private MariaDB.
test: $(VENV)/.installed
	RB_WF_KILLS=1 $(PY) -m pytest -q -m "not mariadb and not full" -n 2 --dist loadfile \
		--no-loadscope-reorder --durations=40
	$(PY) -m pytest -q -m "mariadb and not full" -n 2 --dist loadfile --no-loadscope-reorder \
		$(MARIADB_CI_SUBSET)

# Everything: every variant on every store (MariaDB's crash matrix and fault smoke included),
# then the acceptance and fault suites on RabbitMQ. About two hours on 2 cores.
test-full: $(VENV)/.installed
	RELIABLE_BEAT_DEPLOY_SECONDS=60 $(PY) -m pytest -q
	$(PY) -m pytest -q --broker rabbitmq tests/acceptance/test_beats.py \
		tests/acceptance/test_idempotent_task.py tests/acceptance/test_outbox_kill_points.py \
		tests/acceptance/test_relay_kill.py tests/acceptance/test_dramatiq_adapter.py \
		tests/acceptance/test_adapters_celery_dramatiq.py tests/faults

# The RabbitMQ subset CI runs after `make test` (a few minutes): both adapters killed mid-body
# and two beats (test_adapters_celery_dramatiq.py), the relay killed between publish and mark,
# the outbox kill points, and countdown retries not stalling a worker's acks, on a private
# RabbitMQ node. `make test-full` runs the rest.
test-rabbitmq: $(VENV)/.installed
	$(PY) -m pytest -q --broker rabbitmq tests/acceptance/test_relay_kill.py \
		tests/acceptance/test_outbox_kill_points.py tests/acceptance/test_adapters_celery_dramatiq.py \
		"tests/acceptance/test_idempotent_task.py::test_countdown_retries_do_not_stall_the_worker[postgresql]"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check reliable_beat harness tests examples benchmarks scripts
	$(VENV)/bin/lint-imports --no-cache

type: $(VENV)/.installed
	$(VENV)/bin/mypy

# Build the wheel, install it in a clean venv and prove it finds its migrations.
wheel-check: $(VENV)/.installed
	rm -rf dist .venv-wheel
	$(PY) -m pip wheel -q --no-deps -w dist .
	$(PYTHON) -m venv .venv-wheel
	.venv-wheel/bin/pip install -q dist/*.whl
	cd /tmp && RELIABLE_BEAT_DATABASE_URL=sqlite:////tmp/rb-wheel-check.sqlite3 $(CURDIR)/.venv-wheel/bin/reliable-beat db upgrade
	cd /tmp && RELIABLE_BEAT_DATABASE_URL=sqlite:////tmp/rb-wheel-check.sqlite3 $(CURDIR)/.venv-wheel/bin/reliable-beat db check
	rm -f /tmp/rb-wheel-check.sqlite3*

docs: $(VENV)/.installed
	$(VENV)/bin/sphinx-build -W -q -b html docs docs/_build/html

bench: $(VENV)/.installed
	$(PY) -m benchmarks

faults: $(VENV)/.installed
	$(PY) -m harness.faults --minutes 30

clean:
	rm -rf $(VENV) .venv-wheel dist build *.egg-info .tox
