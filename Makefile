# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv on first use; torch is pinned to the CPU build (see pyproject.toml).
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rlfusion train

# compileall first: the suite starts a few hundred processes (Ray workers, CLI runs, spawned
# ranks) that import rlfusion; they load its bytecode instead of each compiling the sources
# (~0.1 s of CPU apiece where PYTHONDONTWRITEBYTECODE keeps them from caching it themselves)
test: $(STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/vs_trl.py

clean:
	rm -rf $(VENV) build src/*.egg-info
