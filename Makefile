# The two commands a fresh machine needs (see README): `make demo` and `make test`.
# Both create .venv and install from this repository's own files. On machines without an NVIDIA
# GPU, torch==2.13.0 (CPU wheel, on local disk here) is installed first, so that no dependency
# range can pull multi-GB CUDA wheels.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: install install-dev system-packages sglang-venvs demo test gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e .

install-dev: $(BIN)/python
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e ".[dev]"

demo: install
	$(BIN)/zcpo demo

# Debian/Ubuntu packages the tests use (as root, else through sudo): bubblewrap, the code tool's
# sandbox; libnuma-dev, which the CPU kernel of the real SGLang servers (tests/rollout/sglang/real/)
# links; Slurm 22.05 and munge, the real one-machine cluster of the job tests (tools/install_slurm.sh:
# their services stay off).
system-packages:
	@missing=""; command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	dpkg -s libnuma-dev >/dev/null 2>&1 || missing="$$missing libnuma-dev"; \
	[ -z "$$missing" ] || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; }
	@tools/install_slurm.sh

# The real SGLang 0.5.3.post3 and 0.5.23 servers of tests/rollout/sglang/real/ run from venvs made by the
# recipe in ../shared/sglang-cpu (minutes per release the first time, then cached in
# ~/.cache/megatron_zcpo/test-packages/sglang-cpu, keyed by the recipe's checksums). Without the recipe
# those tests skip; with ZCPO_REQUIRE_REAL_SGLANG=1 (CI's .ci/run) a venv that cannot be made fails.
sglang-venvs: install-dev system-packages
	$(BIN)/python -m megatron_zcpo.testing.real_sglang_server build

# Exit code 5 means "no tests collected": not a failure of the suite. ZCPO_REQUIRE_SLURM: the
# real-Slurm tests fail instead of skipping when Slurm is missing. Two pytest-xdist workers, each test
# file (or group of files sharing servers, ports or the Slurm cluster: tests/conftest.py) in one worker.
test: install-dev system-packages sglang-venvs
	ZCPO_REQUIRE_SLURM=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=40 tests; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# GPU acceptance check (tools/gpu_check.py), inside the repository's image on one GPU (its python3
# is the default PYTHON; elsewhere: make gpu-check PYTHON=.venv/bin/python). Without a GPU it runs
# the CPU-checkable parts, prints "no GPU: skipped ..." and exits 3.
gpu-check:
	$(PYTHON) tools/gpu_check.py
