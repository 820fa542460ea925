# Hangar on one machine. `make up` installs what is missing and runs Hangar; `make test` runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
# The e2b SDK a year older than the one in the test extra, which tests/e2b/test_older_sdk.py runs.
E2B_OLDER := 2.8.1

.PHONY: up install system-deps test-deps venv test lint bench-tti bench-dashboard bench-pause bench-pools bench-network bench-harness bench-e2b bench-reliability bench-microvm bench-traces bench-scheduler bench-burst services

up: install
	$(VENV)/bin/hangar image build busybox
	$(VENV)/bin/hangar up --port $(PORT)

install: system-deps venv

system-deps:
	@scripts/install-system-deps.sh
	@scripts/install-runsc.sh
	@scripts/install-microvm.sh

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml sdk/pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q -e ./sdk
	@touch $@

test-deps: $(VENV)/e2b-$(E2B_OLDER)/.installed
	@scripts/install-test-deps.sh

# Beside the venv, not in it: one Python cannot import two versions of a package.
$(VENV)/e2b-$(E2B_OLDER)/.installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-warn-conflicts --target $(VENV)/e2b-$(E2B_OLDER) e2b==$(E2B_OLDER)
	@touch $@

services:
	@scripts/ensure-test-services.sh

test: install test-deps services
	@scripts/run-tests.sh

lint: venv
	$(VENV)/bin/ruff check dashboard runtime tests bench sdk
	$(VENV)/bin/ruff format --check dashboard runtime tests bench sdk
	$(VENV)/bin/mypy

bench-tti: install
	$(PY) bench/tti.py

bench-dashboard: install
	$(PY) bench/dashboard.py

bench-pause: install
	$(PY) bench/pause.py

bench-pools: install
	$(PY) bench/pools.py

bench-network: install
	$(PY) bench/network.py

bench-harness: install
	$(PY) bench/harness.py

bench-e2b: install
	$(PY) bench/e2b.py

bench-reliability: install
	$(PY) bench/reliability.py

bench-microvm: install
	$(PY) bench/microvm.py

bench-traces: install
	$(PY) bench/traces.py

bench-scheduler: install
	$(PY) bench/scheduler.py

bench-burst: install
	$(PY) bench/burst.py
