# modality-gateway: `make serve` runs the gateway on routing.yaml; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= routing.yaml

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

# The gateway alone (its base dependencies: what `serve` imports), for `make serve` and `make demo`;
# then only the extras $(CONFIG) asks for (`modality-gateway check --extras`): torch for a local
# encoder, PyAV for video frames, the OpenTelemetry SDK for traces. Each extra once (its stamp).
GATEWAY_STAMP := $(VENV)/.installed-gateway

$(GATEWAY_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-extra-*
	$(PY) -m pip install -q -e .
	touch $@

# Where torch's wheel comes from for a local encoder: the package index pip is set up for, or with
# TORCH_INDEX=<an index of torch wheels> that one too (PyTorch's CPU index on a machine without a
# GPU: its CPU wheel is ~200 MB, the default index's Linux wheel brings CUDA, several GB)
TORCH_INDEX ?=

extras: $(GATEWAY_STAMP) ## install the extras $(CONFIG) needs, and no more (serve and demo do this first); TORCH_INDEX= for torch's
	@needed=$$($(VENV)/bin/modality-gateway check --extras $(CONFIG)) || exit 2; \
	for extra in $$needed; do \
	  [ -f $(VENV)/.installed-extra-$$extra ] && continue; \
	  flags=""; \
	  case $$extra in \
	    encoder) echo "$(CONFIG) runs a local encoder backend (encoders: kind: local): installing torch and the backend, ~1.2 GB"; \
	      if [ -n "$(TORCH_INDEX)" ]; then flags="--extra-index-url $(TORCH_INDEX)"; \
	      elif ! command -v nvidia-smi >/dev/null; then \
	        echo "  no GPU here: TORCH_INDEX=<PyTorch's CPU wheel index> installs its CPU wheel, if this index's torch brings CUDA"; fi;; \
	    *) echo "$(CONFIG) needs the $$extra extra: installing it";; \
	  esac; \
	  $(PY) -m pip install -q $$flags -e ".[$$extra]" && touch $(VENV)/.installed-extra-$$extra || exit 1; \
	done

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,encoder,video,tracing]'
	touch $@ $(GATEWAY_STAMP) $(VENV)/.installed-extra-encoder $(VENV)/.installed-extra-video $(VENV)/.installed-extra-tracing

install: $(STAMP) ## create .venv and install the gateway with its dev tools

# PORT=8081 (and HOST=0.0.0.0) override routing.yaml's server.port (server.host)
SERVE_FLAGS = --config $(CONFIG) $(if $(PORT),--port $(PORT)) $(if $(HOST),--host $(HOST))

serve: extras ## run the gateway on $(CONFIG) (default routing.yaml; PORT=, HOST= override its own): installs the gateway alone, then what $(CONFIG) needs
	$(VENV)/bin/modality-gateway serve $(SERVE_FLAGS)

# the stand-ins' ports (routing.yaml's); other ones serve a copy of $(CONFIG) that points at them
VLLM_PORT ?= 8000
SGLANG_PORT ?= 30000
WHISPER_PORT ?= 8001
DEMO_CONFIG := $(if $(filter-out 8000 30000 8001,$(VLLM_PORT) $(SGLANG_PORT) $(WHISPER_PORT)),$(VENV)/demo-routing.yaml,$(CONFIG))

demo: extras ## the gateway plus stand-in engines on :8000 (vLLM), :30000 (SGLang), :8001 (Whisper); PORT=, VLLM_PORT=, SGLANG_PORT=, WHISPER_PORT= move them
	@trap 'kill 0' EXIT INT TERM; \
	if [ "$(DEMO_CONFIG)" != "$(CONFIG)" ]; then \
	  sed -e 's#127.0.0.1:8000\b#127.0.0.1:$(VLLM_PORT)#g' -e 's#127.0.0.1:30000\b#127.0.0.1:$(SGLANG_PORT)#g' \
	      -e 's#127.0.0.1:8001\b#127.0.0.1:$(WHISPER_PORT)#g' $(CONFIG) > $(DEMO_CONFIG); fi; \
	$(PY) -m tools.standin --port $(VLLM_PORT) --name vllm & \
	$(PY) -m tools.standin --port $(SGLANG_PORT) --name sglang & \
	$(PY) -m tools.standin --port $(WHISPER_PORT) --name whisper & \
	$(VENV)/bin/modality-gateway serve --config $(DEMO_CONFIG) $(if $(PORT),--port $(PORT)) $(if $(HOST),--host $(HOST))

cluster-demo: $(STAMP) test-deps ## 2 gateways x 2 encoders on loopback: spread, one killed, a ConfigMap edit, Prometheus
	$(PY) -m tools.cluster_demo

test: $(STAMP) test-deps ## run every test
	$(PY) -m pytest

# The conformance run: the gateway's bodies checked by the engines' own code (tests/conformance/).
# vLLM and SGLang, pinned in tests/conformance/engines.txt, are installed without their
# dependencies (no CUDA), beside the pure-Python packages their protocol modules import
# (tests/conformance/requirements.txt), in a virtualenv kept outside the repo under a key of the
# pins: a second run installs nothing. How to bump a pin: tests/conformance/README.md.
CONF_KEY := $(shell cat tests/conformance/engines.txt tests/conformance/requirements.txt pyproject.toml 2>/dev/null | sha256sum | cut -c1-12)
CONF_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/modality-gateway/conformance-$(CONF_KEY)
CONF_STAMP := $(CONF_VENV)/.installed

# no prerequisites: the venv's path holds the pins' hash, and a fresh clone's newer files must not
# make it stale
$(CONF_STAMP):
	rm -rf $(CONF_VENV)
	$(PYTHON) -m venv $(CONF_VENV)
	$(CONF_VENV)/bin/python -m pip install -q --upgrade pip
	$(CONF_VENV)/bin/python -m pip install -q torch==2.13.0
	$(CONF_VENV)/bin/python -m pip install -q --no-deps -r tests/conformance/engines.txt
	$(CONF_VENV)/bin/python -m pip install -q -r tests/conformance/requirements.txt
	touch $@

# The real coding agents (Claude Code, Codex CLI), pinned in tests/conformance/clients.txt, from npm
# into a cache directory keyed by the pins (Node and npm from Debian): a second run installs nothing.
CLIENTS_KEY := $(shell grep -v '^\#' tests/conformance/clients.txt 2>/dev/null | sha256sum | cut -c1-12)
CLIENTS_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/modality-gateway/clients-$(CLIENTS_KEY)
CLIENTS_STAMP := $(CLIENTS_DIR)/.installed

$(CLIENTS_STAMP):
	rm -rf $(CLIENTS_DIR)
	mkdir -p $(CLIENTS_DIR)
	npm install --prefix $(CLIENTS_DIR) --no-audit --no-fund --loglevel=error $$(grep -v '^#' tests/conformance/clients.txt)
	touch $@

conformance: $(CONF_STAMP) $(CLIENTS_STAMP) test-deps ## the bodies the gateway sends, checked by vLLM's and SGLang's own code, and the real coding agents through it (pinned, cached)
	MODALITY_GATEWAY_CLIENTS=$(CLIENTS_DIR) $(CONF_VENV)/bin/python -m pytest -q tests/conformance

MIN_VENV := .venv-min
MIN_STAMP := $(MIN_VENV)/.installed

$(MIN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(MIN_VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@ $(MIN_VENV)/.installed-gateway

test-minimal: $(MIN_STAMP) test-deps ## every test again on the gateway alone, without the video, encoder and tracing extras (CI runs it)
	$(MIN_VENV)/bin/python -m pytest -q

test-deps: ## system packages the tests use: Debian's prometheus (promtool and the server), wrk (the bench harness's test), curl (the README's quick start), redis-server (shared key limits), chromium (the status page, headless)
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v wrk >/dev/null \
	  && command -v curl >/dev/null && command -v redis-server >/dev/null && command -v chromium >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  $$SUDO apt-get install -y -qq --no-install-recommends prometheus wrk curl redis-server chromium >/dev/null; }

bench: $(STAMP) bench-deps ## the gateway hop vs direct and a minimal proxy, wrk (~7 min): table, docs/bench-hop.png
	$(PY) -m bench.hop --plot docs/bench-hop.png --profile

bench-deps: $(STAMP) test-deps ## what the benchmarks use: Debian's wrk (with the tests'), and the bench extra (matplotlib, py-spy)
	@$(PY) -c 'import matplotlib' 2>/dev/null && [ -x $(VENV)/bin/py-spy ] || $(PY) -m pip install -q -e '.[bench]'

check: $(STAMP) bench-deps ## formatting, lint, mypy --strict on gateway/, mypy on backends/, bench/ and tests/
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --strict gateway/
	$(VENV)/bin/mypy backends/
	$(VENV)/bin/mypy tests/

fmt: $(STAMP) ## format and fix what ruff can
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

.PHONY: extras help install serve demo cluster-demo test test-minimal conformance test-deps bench bench-deps check fmt
