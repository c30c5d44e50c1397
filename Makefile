# jobrelay — the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test lint typecheck unit bench bench-soak chaos clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

## demo: run the main job end to end on the embedded default (SQLite + local transport)
demo: $(STAMP)
	$(BIN)/jobrelay demo

## test: lint, type-check and the whole suite (PostgreSQL + RabbitMQ tests included)
test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

## bench: throughput through separate api / relay / worker processes (PostgreSQL + RabbitMQ):
## the scaling table (1/2 relays, 1/2/4 workers; one node and a 3-node cluster), then one
## 1,000,000-row export against COPY (the `bench-export:` line), then report.export, then the
## no-op job against the peers; ends with the `bench:` line
bench: $(STAMP)
	$(BIN)/python bench/scaling_bench.py --cluster 3 $(SCALING_ARGS)
	$(BIN)/python bench/export_speed.py $(EXPORT_ARGS)
	$(BIN)/python bench/pipeline_bench.py --job export --skip-peers $(BENCH_ARGS)
	$(BIN)/python bench/pipeline_bench.py --job noop $(BENCH_ARGS)

## bench-soak: SOAK seconds (default 600) of no-op jobs over HTTP at a fixed rate (half a measured
## maximum), retention a few minutes; a row a minute (rows, dead tuples and sizes per table, outbox
## backlog, relay and end-to-end p99); fails unless they stay flat and no job is lost
SOAK ?= 600
bench-soak: $(STAMP)
	$(BIN)/python bench/soak_bench.py --soak $(SOAK) $(SOAK_ARGS)

## chaos: the fault proof: N exports under kill -9 and service restarts (PostgreSQL + RabbitMQ)
chaos: $(STAMP)
	$(BIN)/jobrelay chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
