# The two commands of the README. Both create .venv on first use.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lorafleet-installed
# pip prints one warning per package for this machine's file:// mirrors; hide that noise only.
# (grep's own "nothing left" status is ignored; pip's failure still fails the pipeline.)
QUIET := { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: run test test-fast test-multinode lint docs install clean gpu-kit

run: $(STAMP)
	$(VENV)/bin/lorafleet up

# The unit tests on two pytest-xdist workers (worksteal: an idle worker takes tests queued
# on the other, so one long test file does not leave a core idle at the end), then the tests that start a Ray of their own
# (marked serve or ray) one after another with the machine to themselves: two of the
# suite's Ray clusters never run at once, nor beside CPU-bound unit tests that would fill
# their queues. The two-node Ray test runs on its own (make test-multinode).
UNIT := not serve and not ray and not multinode
test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist worksteal -m "$(UNIT)"
	$(PY) -m pytest -q -m "(serve or ray) and not multinode"

# The inner loop: the unit tests only (nothing marked serve, ray, slow or multinode).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "$(UNIT) and not slow"

test-multinode: $(STAMP)
	$(PY) -m pytest -q -m multinode

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link or a page missing
# from the nav fails, as it fails the suite (tests/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

install: $(STAMP)

# What a bare GPU machine lacks for .ci/gpu (pydantic, pytest: ~5 MB of wheels for its
# Python 3.12), into .dev/ (git-ignored): run here, then `.ci/gpu` there with .dev/ carried.
# The versions are this machine's (the venv's when it exists); no venv is built for it.
GPU_KIT_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-kit:
	$(GPU_KIT_PY) -m benchmarks.gpu_kit stage .dev

# A machine whose Python already has a CUDA torch keeps it (the venv sees system packages);
# otherwise torch 2.13.0 is pinned first, which on this CPU machine is the CPU build on disk,
# so nothing later pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	if python3 -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	  python3 -m venv --system-site-packages $(VENV); \
	else \
	  python3 -m venv $(VENV); \
	  $(PY) -m pip install -q torch==2.13.0 2>&1 | $(QUIET); \
	fi
	$(PY) -m pip install -q -e '.[test,bench,docs]' 2>&1 | $(QUIET)
	$(PY) -c "import torch, replica, kernels, cluster, router"
	touch $(STAMP)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache site
