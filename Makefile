# MASC: `make demo` and `make test` are the whole set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# A bare `torch` requirement can pull several GB of CUDA packages; install this first.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
MASC := $(VENV)/bin/masc
STAMP := $(VENV)/.masc-installed
DATA ?= data/small
PYTEST_ARGS ?=

.PHONY: install test test-all demo clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.cfg pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -m "not gpu and not slow" --durations=15 $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

demo: install
	$(MASC) simulate dataset --config configs/small.yaml --out $(DATA)
	$(MASC) simulate preview $(DATA) --out $(DATA)/preview.png
	@echo "demo done: dataset in $(DATA), preview in $(DATA)/preview.png"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
