# `make demo`, `make test` and `make docs`. Each creates or refreshes .venv first, with what it needs:
#   demo: torch + tpkit with the hf extra (transformers builds the demo's Llama)
#   test: that + the dev, plot and lightning extras (and OpenMPI / mpi4py when it can)
#   docs: that + the docs extra (MkDocs Material, mkdocstrings), then `mkdocs build --strict` into site/
# TORCH_SPEC pins the CPU build that lies on this machine's disk; on a GPU machine set e.g.
# TORCH_SPEC="torch" to take the CUDA build from the index.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
BASE_STAMP := $(VENV)/.tpkit-base
STAMP := $(VENV)/.tpkit-installed
DOCS_STAMP := $(VENV)/.tpkit-docs
MPI_STAMP := $(VENV)/.tpkit-mpi
# torch is named again in every install: extras never replace it
PIP := $(PY) -m pip install -q -c constraints.txt

.PHONY: venv mpi demo test test-fast docs bench clean

$(BASE_STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PIP) -e ".[hf]" "$(TORCH_SPEC)"
	touch $@

$(STAMP): $(BASE_STAMP)
	$(PIP) -e ".[hf,dev,plot,lightning]" "$(TORCH_SPEC)"
	touch $@

$(DOCS_STAMP): $(BASE_STAMP)
	$(PIP) -e ".[hf,docs]" "$(TORCH_SPEC)"
	touch $@

venv: $(STAMP)

# OpenMPI from Debian and mpi4py, when this machine allows it (root with apt-get). The stamp is written only
# once mpi4py imports, so a failed attempt is retried by the next `make test`; without MPI the MPI tests skip
# and pytest's summary says why.
$(MPI_STAMP): $(STAMP)
	-@command -v mpirun >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null) ; }
	-@command -v mpicc >/dev/null 2>&1 && $(PY) -m pip install -q -e ".[mpi]"
	@$(PY) -c "import mpi4py" 2>/dev/null && touch $@ || echo "note: MPI not available; the MPI tests will skip"

mpi: $(MPI_STAMP)

demo: $(BASE_STAMP)
	$(PY) -m tpkit.cli demo

# TEST_WORKERS pytest-xdist workers (tests/conftest.py keeps each file, and the files that share a session fixture,
# on one worker); TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2

test: venv mpi
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=40 tests

test-fast: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

# The site: docs/*.md, the API reference from the docstrings (mkdocstrings), the CLI reference generated from
# tpkit's own parsers at build time (docs/hooks/cli_reference.py). --strict: a broken link or reference fails.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: venv
	$(PY) bench/comm_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
