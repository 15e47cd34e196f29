# MASC: `make demo` and `make test` are the whole set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# A bare `torch` requirement can pull several GB of CUDA packages; install this first.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
MASC := $(VENV)/bin/masc
STAMP := $(VENV)/.masc-installed
DATA ?= data/small
DEMO_DATA ?= data/demo
DEMO_SUBJECTS ?= 8
DEMO_SEED ?= 1000
PORT ?= 9002
SCAN ?= runs/demo-scan
PYTEST_ARGS ?=
DEVICE ?= auto
BENCH ?= runs/bench

.PHONY: install test test-all demo bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.cfg pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[train,test,metrics]"
	touch $(STAMP)

install: $(STAMP)

# The architecture contracts (.importlinter) first, then the tests.
test: install
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -m "not gpu and not slow" --durations=15 $(PYTEST_ARGS)

test-all: install
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

# The demo scans subjects none of the shipped models' training data came from (a dataset seed of
# their own), every one a test subject, and compares the shipped MASC model with the shipped fixed
# order and the conventional orders, each under its MAR network, with tests over the subjects.
demo: install
	$(MASC) simulate dataset --config configs/small.yaml --out $(DEMO_DATA) --subjects $(DEMO_SUBJECTS) \
	    --set dataset.seed=$(DEMO_SEED) --set "dataset.split_fractions=[0, 0, 1]"
	$(MASC) simulate preview $(DEMO_DATA) --out $(DEMO_DATA)/preview.png
	@# closed loop: masc serve in the background (the recommended model as it starts without a config,
	@# then MASC as configs/small.yaml serves it), masc scan against it, then stop the server
	@rc=0; for model in fixed_small masc_small; do \
	    if [ $$model = masc_small ]; then serve_config="--config configs/small.yaml"; else serve_config=""; fi; \
	    $(MASC) serve $$serve_config --port $(PORT) --log-level WARNING & pid=$$!; \
	    for i in $$(seq 120); do $(PY) -c "import socket; socket.create_connection(('127.0.0.1', $(PORT)), 0.2)" 2>/dev/null && break; sleep 0.25; done; \
	    echo "== closed-loop scan against masc serve $$serve_config (shipped:$$model)"; \
	    $(MASC) scan --config configs/small.yaml --data $(DEMO_DATA) --split test --server 127.0.0.1:$(PORT) \
	        --feedback inband --deadline-ms 200 --fallback center-out --out $(SCAN)/$$model \
	        --no-progress --log-level WARNING || rc=$$?; \
	    kill -TERM $$pid; wait $$pid; \
	done; exit $$rc
	@echo "== MASC against the shipped fixed order and the conventional orders, each under its MAR network"
	$(MASC) eval --config configs/small.yaml --data $(DEMO_DATA) --split test --mar shipped:masc_small \
	    --checkpoint shipped:masc_small,shipped:fixed_small --methods random,center-out,fixed-order,masc \
	    --reference center-out --scans $(SCAN)/fixed_small,$(SCAN)/masc_small --out $(SCAN)/eval --log-level WARNING
	@echo "demo done: dataset $(DEMO_DATA), preview $(DEMO_DATA)/preview.png, closed-loop scans $(SCAN)/{fixed_small,masc_small}/ (report.json, images.h5, scan.png), comparison $(SCAN)/eval/ (table.md with its summary, curves.png, examples.png)"

# The benchmarks behind docs/benchmarks.md's figures (on the small data set; the MaskablePPO comparison
# needs the optional `bench` extra, sb3-contrib). DEVICE=cuda on a GPU machine.
bench: install
	@test -d $(DATA) || $(MASC) simulate dataset --config configs/small.yaml --out $(DATA)
	$(MASC) bench unet --device $(DEVICE) --out $(BENCH)/unet.json
	$(MASC) bench env --config configs/small.yaml --data $(DATA) --device $(DEVICE) --n-envs 64 \
	    --steps 100 --mar-width 0 --sb3 --ppo-steps 2048 --out $(BENCH)/env_nomar.json --log-level WARNING
	$(MASC) bench env --config configs/small.yaml --data $(DATA) --device $(DEVICE) --n-envs 64 \
	    --steps 10 --mar-width 16 --sb3 --ppo-steps 1024 --out $(BENCH)/env_mar16.json --log-level WARNING
	@# MaskablePPO training our PolicyNet: the same network on both sides
	$(MASC) bench env --config configs/small.yaml --data $(DATA) --device $(DEVICE) --n-envs 64 \
	    --steps 10 --mar-width 0 --sb3 --sb3-policy ours --ppo-steps 2048 --out $(BENCH)/env_nomar_samenet.json --log-level WARNING
	$(MASC) bench env --config configs/small.yaml --data $(DATA) --device $(DEVICE) --n-envs 64 \
	    --steps 10 --mar-width 16 --sb3 --sb3-policy ours --ppo-steps 1024 --out $(BENCH)/env_mar16_samenet.json --log-level WARNING
	@echo "benchmark results: $(BENCH)/{unet,env_nomar,env_mar16,env_nomar_samenet,env_mar16_samenet}.json"

# Every GPU measurement in one run (under 8 minutes on one H100): gpu-marked tests, U-Net variants at
# paper width, env and PPO throughput, concurrent serving, a paper-scale subject simulated on CUDA.
# Writes $(BENCH)/gpu-check/gpu_check.{json,md}. Without CUDA it runs the CPU-safe parts.
gpu-check: install
	$(MASC) bench gpu-check --out $(BENCH)/gpu-check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
