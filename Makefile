# Two commands do all set-up on a fresh machine:
#   make demo   - build the tiny example and run spds on it end to end (CPU is enough)
#   make test   - run the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
SPDS := $(VENV)/bin/spds
TINY ?= examples/tiny/build
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: venv demo test lint bench-prepare clean

venv:
	@bash tools/bootstrap.sh $(VENV)

demo: venv
	@bash examples/tiny/demo.sh $(VENV) $(TINY)

# Two workers: most tests wait on process start-up and collectives, not on both cores.
test: venv lint
	$(PY) -m pytest -q -n 2 tests

lint: venv
	$(VENV)/bin/ruff check spds tests bench examples

bench-prepare: venv
	$(PY) bench/bench_prepare.py

clean:
	rm -rf $(TINY) .pytest_cache
