# Two commands: `make demo` and `make test`. Each creates or refreshes .venv first.
# TORCH_SPEC pins the CPU build that lies on this machine's disk; on a GPU machine set e.g.
# TORCH_SPEC="torch" to take the CUDA build from the index.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.tpkit-installed
MPI_STAMP := $(VENV)/.tpkit-mpi

.PHONY: venv mpi demo test test-fast bench clean

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[hf,dev,plot,lightning]" "$(TORCH_SPEC)" -c constraints.txt  # torch named again: extras never replace it
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

demo: venv
	$(PY) -m tpkit.cli demo

test: venv mpi
	$(PY) -m pytest -q tests

test-fast: venv
	$(PY) -m pytest -q -m "not slow" tests

bench: venv
	$(PY) bench/comm_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
