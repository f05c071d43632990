# Set-up and the two everyday commands. `make demo` trains the default job, `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build that lies on this project's machines. On a GPU machine: make demo TORCH=torch
TORCH ?= torch==2.13.0

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, so that nothing that depends on it pulls a multi-GB build of its own choosing.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install "$(TORCH)"
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e '.[dev,trackers,optimizers]'
	touch $@ $(VENV)/.installed

# tcmalloc, which the `effitrain` command preloads on Linux (jemalloc only when asked for): a steadier,
# smaller memory peak on CPUs (docs/memory.md). Best effort: without root or apt, runs use glibc's malloc.
$(VENV)/.allocators: | $(BIN)/python
	(apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 libjemalloc2) || \
		echo "effitrain: tcmalloc not installed (apt-get failed): runs use glibc's malloc"
	touch $@

demo: $(VENV)/.installed $(VENV)/.allocators
	$(BIN)/effitrain train

# The built-in `fashion-mnist` reads Debian's package (the tests train on it).
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
$(FASHION_MNIST):
	apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist

# The report's browser test (tests/integration/test_report.py) drives Debian's headless Chromium through its driver.
CHROMEDRIVER := /usr/bin/chromedriver
$(CHROMEDRIVER):
	apt-get update -qq && apt-get install -y -qq chromium chromium-driver

# One pytest worker per logical CPU (xdist's `auto` counts physical cores), each with one torch thread:
# the suite is CPU-bound and much of it single-threaded (process start-ups), so this keeps both cores of
# a 2-core machine busy (xeon2c, 2026-12-05: 10:35 and 15:15 in two runs, 24:31 one test at a time).
test: $(VENV)/.installed-dev $(VENV)/.allocators $(FASHION_MNIST) $(CHROMEDRIVER)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n logical

.PHONY: demo test
