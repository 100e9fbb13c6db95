# Two entry points for a newcomer: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast check docs bytecode gpu-check clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sweeps,export,trackers,s3]'
	touch $(STAMP)

# An editable install leaves the project's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE is set
# (as on some clusters and CI images) every start compiles them again (~0.07 s). compileall writes the
# bytecode pip writes for an installed package, and skips what is already up to date.
bytecode: $(STAMP)
	$(PY) -m compileall -q framework experiments

run: bytecode
	$(PY) run.py

# PYTHONDONTWRITEBYTECODE is cleared for the suite's processes (set, as on some CI images, every pytest worker
# rewrites every test module's asserts and every run compiles the modules it imports again; make test-fast took
# 64 s instead of 57): the bytecode goes to __pycache__/, which git ignores.
TEST_ENV := PYTHONDONTWRITEBYTECODE=

# worksteal: a worker that runs out of tests takes queued ones from the other, so the suite's long tests (a submitit
# sweep that mostly waits for its time limit) do not leave one core idle at the end. --durations: the slowest tests,
# where the suite's time goes (issue 43's 12 minutes). `check` and `docs` run beside the suite, not before it: its
# first minute leaves a core partly idle (the tests marked `waits` start first and mostly wait on submitit's clock),
# and a fresh clone's mypy, with no cache yet, takes ~28 s of CPU. Their output follows the suite's; either failing
# fails `make test`.
test: $(STAMP)
	@$(MAKE) --no-print-directory check docs > $(VENV)/checks.log 2>&1 & checks=$$!; \
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal --durations=60; tests=$$?; \
	wait $$checks; checked=$$?; cat $(VENV)/checks.log; \
	[ $$checked -eq 0 ] || echo "make test: make check or make docs failed (above)"; \
	[ $$tests -eq 0 ] && [ $$checked -eq 0 ]

# Lint, format and types of the library (configured in pyproject.toml): part of `make test`, seconds.
check: $(STAMP)
	$(VENV)/bin/ruff check framework hydra_plugins
	$(VENV)/bin/ruff format --check framework hydra_plugins
	$(VENV)/bin/mypy

# The docs site, strict: a broken link or a renamed symbol in the API reference fails. Built into .venv/site.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir $(VENV)/site

# The unit tier (tests/conftest.py): the parts built in this process, no subprocess; about 52 s on 2 cores (2026-11-28, 1,149 tests; 55 s on a fresh clone, whose first run compiles the test modules).
test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 -m unit

# Everything that needs CUDA (bench/gpu_check.py): the CUDA tests, then bench/overhead.py --device cuda and
# bench/realistic.py. Without a CUDA device it says so in one line and exits 0.
gpu-check: $(STAMP)
	@$(PY) bench/gpu_check.py

clean-venv:
	rm -rf $(VENV)
