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
# The CI-size suite: everything on SQLite, PostgreSQL and Redis, plus a representative MariaDB
# subset (the integration suite and the concurrency/kill acceptance tests on MariaDB).
# `make test-full` runs every MariaDB variant too (about 10 more minutes on 2 cores).
# Workflows on MariaDB: the engine's unit tests (~20 s); the crash matrix on real processes is
# longer than CI's budget allows: `pytest tests/acceptance/test_workflow_crashes.py -k mariadb`.
MARIADB_CI_SUBSET := tests/integration tests/unit/test_workflows.py tests/unit/test_workflow_versions.py tests/unit/test_workflow_sagas.py tests/acceptance/test_beats.py::test_sigstop_inside_claim_transaction tests/acceptance/test_idempotent_task.py tests/acceptance/test_relay_kill.py \
	tests/faults/test_faults_smoke.py::test_fault_injection_smoke_mariadb
test: $(VENV)/.installed
	RB_WF_KILLS=1 $(PY) -m pytest -q -m "not mariadb" --durations=30
	$(PY) -m pytest -q -m mariadb $(MARIADB_CI_SUBSET)

test-full: $(VENV)/.installed
	$(PY) -m pytest -q

# The RabbitMQ subset CI runs after `make test` (a few minutes): the acceptance suites whose
# guarantees lean on the broker, on a private RabbitMQ node. The rest of the broker axis is
# `$(PY) -m pytest --broker rabbitmq tests/acceptance tests/faults` (docs/operations.md).
test-rabbitmq: $(VENV)/.installed
	$(PY) -m pytest -q --broker rabbitmq tests/acceptance/test_idempotent_task.py \
		tests/acceptance/test_relay_kill.py tests/acceptance/test_outbox_kill_points.py \
		tests/acceptance/test_dramatiq_adapter.py tests/acceptance/test_adapters_celery_dramatiq.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check reliable_beat harness tests examples benchmarks

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
