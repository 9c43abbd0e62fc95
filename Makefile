# dsv4rl — set-up, tests, benchmarks and the CPU demo.
# `make install` installs into the active virtual environment, or creates .venv when none is active.
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch: the CPU build for the demo, tests and CI; `make install GPU=1` takes SGLang 0.5.23's torch
# (a CUDA build of several GB), which the trainer must share with the engines' weight-update group.
# ROCm: `make install GPU=1 TORCH_INDEX=https://download.pytorch.org/whl/rocm6.4`.
CPU_TORCH_SPEC ?= torch==2.13.0
GPU_TORCH_SPEC ?= torch==2.14.1
TORCH_SPEC ?= $(if $(GPU),$(GPU_TORCH_SPEC),$(CPU_TORCH_SPEC))
TORCH_INDEX ?=
# Transformer Engine (GPU=1 with a CUDA torch): megatron-core builds its precision-aware optimizer with it
# (parallel.train.precision_aware_optimizer). 2.11.0 is the newest release megatron-core 0.16.1's own pin
# accepts (>=2.9,<2.12). Its torch extension is an sdist built against the installed torch (so
# --no-build-isolation, setuptools and wheel first); the build takes NVIDIA's prebuilt extension from its
# GitHub release or compiles with the CUDA toolkit's nvcc (CUDA_HOME). PyPI has no ROCm build: with a ROCm
# TORCH_INDEX it is skipped, and validation refuses precision_aware_optimizer=true without it (docs/megatron.md).
TE_SPEC ?= transformer-engine[pytorch]==2.11.0
INSTALL_TE := $(if $(GPU),$(if $(findstring rocm,$(TORCH_INDEX)),,1))
# SGLang in its own environment: it pins transformers 5.19 and torch 2.14.1, the trainer needs transformers 5.23.
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_VENV ?= .venv-sglang

.PHONY: install install-sglang sglang-contract test test-fast test-sglang lint demo bench bench-quant clean

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(PY)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e ".[dev,megatron]"
	$(if $(INSTALL_TE),$(PY) -m pip install setuptools wheel)
	$(if $(INSTALL_TE),$(PY) -m pip install --no-build-isolation "$(TE_SPEC)")

# The engines' interpreter (engine.python): SGLang with exactly its own pins, built once per machine in
# $DSV4RL_SGLANG_CACHE (~/.cache/dsv4rl) and linked here; the `sglang` test group runs in it (CI too).
install-sglang:
	bash launch/install_sglang.sh $(SGLANG_VENV) "$(SGLANG_SPEC)" $(PYTHON)

# Re-read SGLang's HTTP routes, request fields, sampling keys and server flags from its released wheel
# (downloaded, never installed) into src/dsv4rl/engine/sglang_contract.json; then `make test` says what moved.
sglang-contract:
	rm -rf build/sglang-wheel
	$(PY) -m pip download --no-deps --quiet -d build/sglang-wheel "$(SGLANG_SPEC)"
	$(PY) -m dsv4rl.engine.sglang_contract build/sglang-wheel/sglang-*.whl

# The whole suite, with its 25 slowest tests named at the end (CI's log keeps them), on TEST_WORKERS
# pytest-xdist workers (a test file per unit of work: tests/conftest.py). Every file with a `slow` test is
# one unit that a single worker runs in turn: two end-to-end runs at once on CI's 2 cores ran over twice as
# slow (their OpenMP threads spin), while the single-threaded unit tests fit beside one. TEST_WORKERS=0
# runs everything in this one process.
TEST_WORKERS ?= 2
test:
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The inner loop: neither the end-to-end runs and the other `slow` tests nor the `sglang` group (SGLang's
# interpreter starts per environment; `make test-sglang` runs that group, `make test` everything).
# Its tests are single-threaded: two workers (FAST_WORKERS) halve its time on two cores.
FAST_WORKERS ?= 2
test-fast:
	$(PY) -m pytest -q -m "not slow and not sglang" --durations=10 -n $(FAST_WORKERS) --dist loadgroup --no-loadscope-reorder

# dsv4rl's output through SGLang 0.5.23's own code, in its interpreter (after `make install-sglang`)
test-sglang:
	$(PY) -m pytest -q -m sglang

lint:
	$(PY) -m ruff check src tests bench examples
	$(PY) -m ruff format --check src tests bench examples

# WeightSync throughput vs memcpy (bench/README.md); `make bench BENCH_ARGS=--quick` for the short run.
bench:
	$(PY) bench/weight_sync.py $(BENCH_ARGS)

# A 1 GiB sync: bucketed vs raw broadcast vs one request per tensor, and quantization per format.
bench-quant:
	$(PY) bench/quant_sync.py $(BENCH_ARGS)

demo:
	$(VENV)/bin/dsv4rl train recipe=tiny_arith run.dir=runs/demo

clean:
	rm -rf runs .pytest_cache .ruff_cache
