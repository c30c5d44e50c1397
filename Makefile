# jobrelay — the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Installs come from uv.lock (every package pinned, with its hashes): the versions the suite
# passes with, for everyone, until `make lock` moves them. uv installs them in parallel; uv
# itself is pinned (UV_VERSION) and fetched from PyPI with pip the first time.
UV_VERSION := 0.13.9
UV := $(VENV)/.uv-$(UV_VERSION)/bin/uv
# The venv is .venv whatever the caller's VIRTUAL_ENV or uv settings; uv never downloads a
# Python (the venv's is the one $(PYTHON) made).
UV_RUN := UV_PROJECT_ENVIRONMENT=$(VENV) UV_PYTHON_DOWNLOADS=never $(UV)
# --locked: a uv.lock out of date with pyproject.toml stops the install (it is never
# re-resolved on the way); --quiet as pip was.
UV_SYNC := $(UV_RUN) sync --locked --quiet --python $(BIN)/python
STALE_LOCK := { echo "make: uv.lock does not match pyproject.toml (uv, above): run \`make lock\`, then make test, and commit both" >&2; exit 1; }
HASH := $(shell cat pyproject.toml uv.lock | sha1sum | cut -c1-12)
# Two stamps: the demo needs only the runtime; the tests add the test extra (Playwright,
# schemathesis, moto, mypy, ruff, xdist) on top.
RUNTIME_STAMP := $(VENV)/.runtime-$(HASH)
TEST_STAMP := $(VENV)/.test-$(HASH)
# Parallel test processes (pytest-xdist). Most tests wait on subprocesses, PostgreSQL and
# RabbitMQ rather than on the CPU, so more processes than the 2 cores pay. loadscope: a
# module is one unit (its module-scoped servers start once), the modules with `long` tests
# first (tests/conftest.py orders them).
TEST_WORKERS ?= 4
PYTEST_ARGS ?=

.PHONY: demo test test-slow lint typecheck unit bench bench-soak chaos lock clean

# The venv is made without pip (uv fills it; ensurepip alone took 4 s of a fresh `make demo`),
# and uv is fetched with $(PYTHON)'s own pip, or with one ensurepip puts in the venv when
# $(PYTHON) has none.
$(UV):
	@test -x $(BIN)/python || $(PYTHON) -m venv --without-pip $(VENV)
	@if $(PYTHON) -m pip --version >/dev/null 2>&1; then pip="$(PYTHON) -m pip"; \
	else $(BIN)/python -m ensurepip --default-pip >/dev/null && pip="$(BIN)/python -m pip"; fi; \
	echo "$$pip install uv==$(UV_VERSION) --target $(VENV)/.uv-$(UV_VERSION)"; \
	PIP_ROOT_USER_ACTION=ignore PIP_REQUIRE_VIRTUALENV=0 $$pip install --quiet \
	  --disable-pip-version-check --target $(VENV)/.uv-$(UV_VERSION) 'uv==$(UV_VERSION)'

# Each sync is exact: the runtime one removes the test extra if it was there.
$(RUNTIME_STAMP): pyproject.toml uv.lock | $(UV)
	@$(UV_RUN) lock --check --quiet || $(STALE_LOCK)
	$(UV_SYNC)
	@rm -f $(VENV)/.runtime-*
	@touch $(RUNTIME_STAMP)

# --compile-bytecode, as pip did: the suite starts hundreds of processes, and where
# PYTHONDONTWRITEBYTECODE is set each would compile every module it imports again. The
# demo's first run compiles (and caches) only what it imports, sooner than compiling all.
$(TEST_STAMP): $(RUNTIME_STAMP)
	$(UV_SYNC) --extra test --compile-bytecode
	@rm -f $(VENV)/.test-*
	@touch $(TEST_STAMP)

## lock: re-resolve every dependency to the newest version pyproject.toml allows and rewrite
## uv.lock; then run make test and commit pyproject.toml and uv.lock together
lock: | $(UV)
	$(UV_RUN) lock --upgrade

## demo: run the main job end to end on the embedded default (SQLite + local transport);
## installs the runtime only
demo: $(RUNTIME_STAMP)
	$(BIN)/jobrelay demo

## test: lint, type-check and the suite in TEST_WORKERS parallel processes (PostgreSQL +
## RabbitMQ tests included; the soaks are in test-slow). Needs PostgreSQL and RabbitMQ on
## 127.0.0.1 and Chromium for the console tests; leaves those servers running as they were:
## the tests that stop a server stop one of their own. Fault tests kept here, one per
## hand-off at least (tests/acceptance/test_fault_recovery.py unless named):
##   accept: test_api_killed_after_commit_job_is_still_delivered
##   relay/publish: test_relay_killed_before_mark_republishes_without_second_result
##   claim: test_worker_sigkilled_mid_export_completes_once, test_claim_fencing.py
##   outcome/ack: test_worker_killed_after_commit_before_ack_does_not_redo
##   retry: test_worker_crash_in_export_consumes_attempt_and_completes_once
##   quarantine: test_crash_looping_job_ends_quarantined_while_healthy_jobs_flow
##   limits (slots): test_limit_faults.py
test: $(TEST_STAMP) lint typecheck
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not soak" --durations=30 $(PYTEST_ARGS)

## test-slow: the slow-by-nature lane (the short chaos soak and the cluster soak), on servers
## of their own; CI runs it after `make test`
test-slow: $(TEST_STAMP)
	$(BIN)/python -m pytest -m soak --durations=30 $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	# The import arrows: no circles, domain <- storage <- library <- runtime <- worker, relay, maintenance, admin <- api <- processes <- cli (issue 35).
	$(BIN)/python -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_import_layers.py tests/unit/test_exported_members.py

typecheck: $(TEST_STAMP)
	$(BIN)/mypy

unit: $(TEST_STAMP)
	$(BIN)/python -m pytest tests/unit

## bench: throughput through separate api / relay / worker processes (PostgreSQL + RabbitMQ):
## the scaling table (1/2 relays, 1/2/4 workers; one node and a 3-node cluster), then one
## 1,000,000-row export against COPY (the `bench-export:` line), then report.export, then limits
## per key (the `limits:` line), then enqueue_many against one job at a time (the `enqueue:`
## line), then the no-op job against the peers (the `bench:` line), then the drain with
## tracing off, on at 100 % and at 1 % (the `tracing:` line). BENCH_JOBS (default 10000) per phase
BENCH_JOBS ?= 10000
bench: $(TEST_STAMP)
	$(BIN)/python bench/scaling_bench.py --cluster 3 $(SCALING_ARGS)
	$(BIN)/python bench/export_speed.py $(EXPORT_ARGS)
	$(BIN)/python bench/pipeline_bench.py --job export --skip-peers --jobs $(BENCH_JOBS) $(BENCH_ARGS)
	$(BIN)/python bench/limits_bench.py --jobs $(BENCH_JOBS)
	$(BIN)/python bench/enqueue_bench.py --jobs $(BENCH_JOBS)
	$(BIN)/python bench/pipeline_bench.py --job noop --jobs $(BENCH_JOBS) $(BENCH_ARGS)
	$(BIN)/python bench/tracing_bench.py --jobs $(BENCH_JOBS)

## bench-soak: SOAK seconds (default 600) of no-op jobs over HTTP at a fixed rate (half a measured
## maximum), retention a few minutes; a row a minute (rows, dead tuples and sizes per table, outbox
## backlog, relay and end-to-end p99); fails unless they stay flat and no job is lost
SOAK ?= 600
bench-soak: $(TEST_STAMP)
	$(BIN)/python bench/soak_bench.py --soak $(SOAK) $(SOAK_ARGS)

## chaos: the fault proof: N exports under kill -9 and service restarts (PostgreSQL + RabbitMQ).
## It RESTARTS THE MACHINE'S PostgreSQL and RabbitMQ (every other client loses its
## connections) unless CHAOS_ARGS points it at servers of your own (jobrelay chaos --help)
chaos: $(TEST_STAMP)
	$(BIN)/jobrelay chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
