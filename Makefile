# The README's two commands: `make train` and `make test`. Both create the venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DATA   ?= data/stdlib
VLM_DATA ?= data/shapes
CONFIG ?= configs/train/debug.toml
# Where torch comes from. Unset: pip's default index; on Linux that is the CUDA build from PyPI.
# CPU-only machine: make train TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=

.PHONY: train test lint prepare-data prepare-vlm-data clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, from TORCH_INDEX_URL when given, so that the package install finds it satisfied
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

$(DATA)/manifest.json: | $(VENV)/.installed
	$(PY) scripts/prepare_data.py --out $(DATA)

prepare-data: $(DATA)/manifest.json

$(VLM_DATA)/manifest.json: | $(VENV)/.installed
	$(PY) scripts/prepare_vlm_data.py --out $(VLM_DATA)

# the image–caption set configs/train/vlm_debug.toml trains on
prepare-vlm-data: $(VLM_DATA)/manifest.json

train: $(VENV)/.installed $(DATA)/manifest.json
	$(PY) scripts/train.py $(CONFIG) $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check forge scripts tests benchmarks examples
	$(VENV)/bin/ruff format --check forge scripts tests benchmarks examples
	$(VENV)/bin/pyright forge

test: $(VENV)/.installed lint
	# two workers (pytest-xdist): most tests are process start-up, one core each; an idle
	# worker takes tests queued for the other (worksteal), so neither waits at the end
	$(PY) -m pytest -q -n 2 --dist worksteal tests

clean:
	rm -rf runs
