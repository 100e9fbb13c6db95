# Two entry points for a newcomer: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bytecode clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sweeps]'
	touch $(STAMP)

# An editable install leaves the project's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE is set
# (as on some clusters and CI images) every start compiles them again (~0.07 s). compileall writes the
# bytecode pip writes for an installed package, and skips what is already up to date.
bytecode: $(STAMP)
	$(PY) -m compileall -q framework experiments

run: bytecode
	$(PY) run.py

test: $(STAMP)
	$(PY) -m pytest -q -n 2

clean-venv:
	rm -rf $(VENV)
