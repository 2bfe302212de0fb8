# Two entry points for a fresh machine: `make demo` (the offline default, end to end) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SNAKE := $(BIN)/snakemake --snakefile $(CURDIR)/Snakefile
JOBS ?= 2
# One thread per CPU job: a tiny model's small matmuls gain little from a second thread, and two jobs
# at once overlap one's start-up (imports) with the other's work.
CPU_THREADS := --set-threads train=1 eval_run=1 eval_base=1

.PHONY: demo test install lint clean-demo

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build. Triton (not a
# dependency of the CPU build) lets the tests run the GPU decode-attention kernel in its interpreter.
$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/activate
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0 triton==3.9.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# The offline default in its own working directory: outputs land in demo/results/.
demo: install
	$(SNAKE) --directory demo --configfile $(CURDIR)/offline.yaml -j$(JOBS) --cores $(JOBS) results/card.md results/card.png $(CPU_THREADS)
	@echo "card: demo/results/card.md and demo/results/card.png"

test: install
	$(BIN)/python -m pytest -q

PY_SRC := talkmethods tests bench workflow_scripts scripts

lint: install
	$(BIN)/ruff format --check $(PY_SRC)
	$(BIN)/ruff check $(PY_SRC)
	$(BIN)/snakefmt --check Snakefile rules/
	$(SNAKE) --lint --configfile offline.yaml

clean-demo:
	rm -rf demo
