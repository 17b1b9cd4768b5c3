# Set-up and entry points. `make test` and `make demo` work on a fresh clone (CPU, Python 3.11).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
MCORE_VERSION ?= 0.16.1
PYTEST_ARGS ?=
# Test workers (pytest-xdist, one test file per worker; 0: one process, as before). Each worker
# is a core's worth of work: multi-process tests start their ranks inside it.
TEST_WORKERS ?= 2

.PHONY: venv test test-fast demo clean bench mutate docs docs-check docs-serve
DEMO_ARGS ?=
DEMO_RUN ?= runs/demo

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)" "megatron-core==$(MCORE_VERSION)"
	$(PY) -m pip install -q -e ".[test,hf]"
	touch $@

venv: $(VENV)/.installed

# The whole suite (unit, distributed on gloo, end-to-end), TEST_WORKERS files at a time.
test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Everything but the tests marked slow.
test-fast: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The main job with no --config: the demo recipe, GSPO on a tiny MoE on CPU (about 3 minutes on 2 cores).
# It writes runs/demo; running it again resumes there (rm -rf runs/demo for a fresh run). Then its
# plots: runs/demo/report/report.html (gspo-report, docs/report.md; skipped, with a line, where
# matplotlib is not installed: the run itself succeeded).
demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/gspo-train --logging.run_dir=$(DEMO_RUN) $(DEMO_ARGS)
	@if $(PY) -c "import matplotlib" 2>/dev/null; then $(VENV)/bin/gspo-report $(DEMO_RUN); \
	else echo "make demo: no report: matplotlib is not installed (pip install matplotlib)"; fi

# The CPU benchmark set (docs/benchmarks.md): one table on stdout, the record (commit, date,
# machine, every round) in docs/results/bench.json.
bench: venv
	PYTHONPATH=. OMP_NUM_THREADS=1 $(PY) -m tools.bench --out docs/results/bench.json

# Plant known plausible bugs in the algorithms and show the unit test that catches each
# (tools/mutate.py): one table on stdout, the committed record in docs/results/mutate.json.
mutate: venv
	PYTHONPATH=. OMP_NUM_THREADS=1 $(PY) tools/mutate.py --out docs/results/mutate.json

# The docs site (mkdocs.yml), built into site/ with --strict: a warning (a broken link or anchor, a
# page left out of the nav, a link into the source tree that does not exist) fails it. It needs
# only the `docs` extra's packages (setup.py; tests/unit/test_docs_site.py checks these pins are
# the extra's), in a venv of their own: no torch, no megatron-core. `make docs-check` checks what is
# generated from the code (docs/reference/, gspo_megatron.tools.docs_ref) and the shell commands
# and recipe fragments of the README and the guides against the tree (tools/doc_commands.py): it
# imports the package, so it runs in the training venv (the test suite runs both checks too).
DOCS_VENV ?= .venv-docs
DOCS_REQUIREMENTS := "mkdocs>=1.6,<2" "mkdocs-material>=9.5"

$(DOCS_VENV)/.installed: Makefile
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q $(DOCS_REQUIREMENTS)
	touch $@

docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

docs-check: venv
	PYTHONPATH=. $(PY) -m gspo_megatron.tools.docs_ref --check
	PYTHONPATH=. $(PY) tools/doc_commands.py README.md docs/*.md docs/reference/*.md examples/*/README.md

docs-serve: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) $(DOCS_VENV) *.egg-info .pytest_cache site
