# Two entry points for a newcomer: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sweeps]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) run.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2

clean-venv:
	rm -rf $(VENV)
