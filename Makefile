# dsv4rl — set-up, tests, benchmarks and the CPU demo.
# `make install` installs into the active virtual environment, or creates .venv when none is active.
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PYTHON ?= python3
PY := $(VENV)/bin/python
# The CPU build of torch (pip takes it from the local wheel cache where there is one).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-fast lint demo bench bench-quant clean

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(PY)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[dev]"

test:
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow"

lint:
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

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
