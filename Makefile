# Sluice — the two commands of the README, and a few helpers.
#   make run    set everything up and run web, workers, dispatcher and fake vendor (Ctrl-C stops all)
#   make test   install the test dependencies and pass the whole suite (SQLite, then PostgreSQL + Redis)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PG_URL ?= postgres://postgres@127.0.0.1:5432/test
REDIS ?= redis://127.0.0.1:6379/0
PYTEST_ARGS ?=

.PHONY: run test test-sqlite test-s3 test-distributed poc bench profile chaos chaos-short netns install browser engine migrate clean

poc: install
	$(PY) manage.py poc run all

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

# This installation's own secret key, kept in var/ (never the published development key).
var/secret_key:
	@mkdir -p var && umask 077 && $(PYTHON) -c "import secrets; print(secrets.token_urlsafe(50))" > $@

install: $(VENV)/.installed var/secret_key

migrate: install
	$(PY) manage.py migrate --noinput

run: engine migrate
	$(PY) manage.py seed_demo
	$(VENV)/bin/honcho start -f Procfile

# Debian's Chromium for the browser tests (Playwright cannot download its own browser here).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Debian's LibreOffice (writer, calc, impress, without GUI), poppler, and python3-uno for the warm
# converters: the local conversion engine.
engine:
	@if command -v soffice >/dev/null 2>&1 && command -v pdftotext >/dev/null 2>&1 && /usr/bin/python3 -c "import uno" 2>/dev/null; then :; else \
	  echo "installing Debian's LibreOffice and poppler-utils for the local conversion engine"; \
	  (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    libreoffice-writer-nogui libreoffice-calc-nogui libreoffice-impress-nogui poppler-utils python3-uno fonts-dejavu-core >/dev/null \
	  || echo "could not install LibreOffice: conversions go to the vendor channels (the console says so)"; fi

test: install browser engine test-sqlite test-s3 test-distributed

test-sqlite: install
	@echo "== $$(date +%T) SQLite =="
	$(PY) -m pytest $(PYTEST_ARGS)
	@echo "== $$(date +%T) POC scenarios on SQLite, both dialects =="
	$(PY) manage.py poc run all
	$(PY) manage.py poc run all --dialect assemblyai

# The tests that store, read, serve and delete files and results, with every one of them in a
# bucket of a real S3 protocol server the tests start (moto's server mode).
S3_TESTS := tests/integration/test_pipeline.py tests/integration/test_cancel_results_notifications.py \
	tests/integration/test_retention_quarantine.py tests/integration/test_api_intake.py \
	tests/integration/test_portal_and_metrics.py tests/integration/test_precheck.py \
	tests/integration/test_hostile_inputs.py tests/integration/test_money_paths.py \
	tests/integration/test_local_engine.py tests/integration/test_console_recovery.py \
	tests/e2e/test_portal_browser.py
test-s3: install
	@echo "== $$(date +%T) files and results in an S3 bucket =="
	SLUICE_STORAGE_URL=s3://sluice-suite/run SLUICE_DATA_DIR=$(CURDIR)/var/test-s3 $(PY) -m pytest $(PYTEST_ARGS) $(S3_TESTS)

# The tests of the queue's messages (written with their transaction, taken, resent), run again on
# PostgreSQL with the embedded broker: a deployment with PostgreSQL and no Redis.
QUEUE_TESTS := tests/integration/test_api_intake.py tests/integration/test_batch_intake.py \
	tests/integration/test_pipeline.py tests/integration/test_precheck.py tests/integration/test_costs.py \
	tests/integration/test_worker_pool.py tests/integration/test_rows.py \
	tests/integration/test_broker_doorbell.py

# The scenarios whose outcome turns on how the queue's messages travel (lost, duplicated, taken
# by a worker that dies or is fenced), run again with the embedded broker on PostgreSQL.
BROKER_SCENARIOS := delivery-interrupted,timeout-cancel-worker-lost,zombie-worker,cancel-race,mixed-load

# The same suite against PostgreSQL + Redis where they answer on 127.0.0.1 (our machines and CI),
# but for the tests marked `once` (the fake vendor, streams, commands: nothing the database or
# the broker changes), and every POC scenario there; then the queue's tests and the broker's scenarios on PostgreSQL
# with the embedded broker. The AssemblyAI dialect's scenarios run once, on SQLite: its adapter is
# the same code on any database.
test-distributed: install
	@if $(PY) scripts/services_up.py; then \
	  echo "== $$(date +%T) PostgreSQL + Redis =="; \
	  DATABASE_URL=$(PG_URL) REDIS_URL=$(REDIS) $(PY) -m pytest -m "not once" $(PYTEST_ARGS) && \
	  echo "== $$(date +%T) POC scenarios on PostgreSQL + Redis ==" && \
	  DATABASE_URL=$(PG_URL) REDIS_URL=$(REDIS) $(PY) manage.py poc run all && \
	  echo "== $$(date +%T) PostgreSQL with the embedded broker (no Redis) ==" && \
	  env -u REDIS_URL DATABASE_URL=$(PG_URL) $(PY) -m pytest $(PYTEST_ARGS) $(QUEUE_TESTS) && \
	  env -u REDIS_URL DATABASE_URL=$(PG_URL) $(PY) manage.py poc run $(BROKER_SCENARIOS) && \
	  $(MAKE) --no-print-directory chaos-short && echo "== $$(date +%T) done =="; \
	else echo "PostgreSQL or Redis not reachable on 127.0.0.1: distributed run skipped"; fi

bench: install
	$(PY) manage.py bench

# A pipeline run under py-spy: the share of CPU per kind of process and Sluice's costliest functions.
profile: install
	$(VENV)/bin/pip install --quiet -e '.[test,profile]'
	$(PY) scripts/profile_pipeline.py

# Sluice on namespaced hosts under partitions, kills and vendor faults (root; docs/deployment.md).
chaos: install netns
	$(PY) manage.py chaos --tasks 500 --minutes 15

# The short run make test does: about 100 tasks, every fault kind at least once, about 2 minutes.
chaos-short: install
	@if [ "$$(id -u)" != 0 ]; then echo "chaos run skipped: network namespaces need root (CI runs as root)"; else \
	  $(MAKE) --no-print-directory netns && echo "== $$(date +%T) chaos: namespaced hosts, partitions, kills, vendor faults ==" && \
	  $(PY) manage.py chaos --tasks 100 --minutes 5; fi

# Debian's iproute2, for the network namespaces of tasks/hosts.py.
netns:
	@command -v ip >/dev/null 2>&1 || { echo "installing Debian's iproute2 for the namespaced hosts"; \
	  (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; }

clean:
	rm -rf var/test var/test-s3 .pytest_cache
