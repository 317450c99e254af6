# `make demo` and `make test` work on a fresh machine: they create .venv and install what they
# need (the CPU torch wheel where there is no GPU). Where the dependencies already import with the
# current Python (an offline GPU machine), that Python is used as it is.
PY ?= python3
VENV := .venv
DEPS_IMPORT := $(shell $(PY) -c "import numpy, scipy, networkx, ml_dtypes, torch, pytest, hypothesis, transformers" >/dev/null 2>&1 && echo yes)
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_REQ := $(if $(HAS_GPU),torch,torch==2.13.0)

ifeq ($(DEPS_IMPORT),yes)
PYTHON := $(PY)
SETUP :=
else
PYTHON := $(VENV)/bin/python
SETUP := $(VENV)/.installed
endif

.PHONY: demo test lint

demo: $(SETUP)
	PYTHONPATH=. $(PYTHON) -m fusionstitching.cli demo

test: $(SETUP)
	PYTHONPATH=. $(PYTHON) -m pytest -q

lint: $(SETUP)
	$(PYTHON) -m ruff check fusionstitching tests

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q "$(TORCH_REQ)"
	$(VENV)/bin/python -m pip install -q -e ".[cuda,test]" ruff
	touch $@
