# One path from README to CI: every target sets up what it needs.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
STAMP := $(VENV)/.setup-done

.PHONY: setup run test test-fast bench bench-peer check-engines train-agent eval browser-deps mcp-deps native-deps clean screenshot reliability

$(STAMP): requirements.txt requirements-nodeps.txt requirements-dev.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PYTHON) -m pip install -q --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

setup: $(STAMP) native-deps

# A C compiler with OpenMP for the native decode step (model_backend/native_decode.c, built at first use;
# without one the torch step runs, and tests/test_native.py fails to say so).
native-deps:
	@command -v cc >/dev/null || (apt-get update -qq && apt-get install -y -qq gcc libc6-dev >/dev/null)

# Debian's chromium for the browser tests (Playwright's own download cannot work here).
browser-deps:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# The MCP servers the tests and the mcp: tasks run, in the gitignored .mcp/ (`{servers}` in task files):
# the npm filesystem server (run with Debian's nodejs), and mcp-server-git and mcp-server-sqlite, each
# in its own virtual environment: a server is its own process, and their mcp versions differ from each
# other's and from the app's (mcp-server-git needs mcp 2.x; the app pins 1.30 for Gradio's MCP server).
# Reinstalled when this Makefile changes.
MCP_DIR := .mcp
MCP_STAMP := $(MCP_DIR)/.deps-done
MCP_FS_NPM := @modelcontextprotocol/server-filesystem@2026.8.31
MCP_GIT_PIP := mcp-server-git==2026.10.19 mcp==2.3.0
MCP_SQLITE_PIP := mcp-server-sqlite==2025.4.25 mcp==1.30.0

$(MCP_STAMP): Makefile
	@(command -v node && command -v npm) >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null)
	mkdir -p $(MCP_DIR)
	npm install --silent --no-audit --no-fund --save-exact --prefix $(MCP_DIR) $(MCP_FS_NPM)
	test -x $(MCP_DIR)/git/bin/python || $(PY) -m venv $(MCP_DIR)/git
	$(MCP_DIR)/git/bin/python -m pip install -q $(MCP_GIT_PIP)
	test -x $(MCP_DIR)/sqlite/bin/python || $(PY) -m venv $(MCP_DIR)/sqlite
	$(MCP_DIR)/sqlite/bin/python -m pip install -q $(MCP_SQLITE_PIP)
	touch $(MCP_STAMP)

mcp-deps: $(MCP_STAMP)

run: setup
	$(PYTHON) -m app serve

# Every core (pytest-xdist), a module per worker at a time, the modules with slow, browser or mcp tests first
# (tests/conftest.py `heavy_modules_first`): 12.4-13.5 minutes on 2 cores where one process took 17.
test: setup browser-deps mcp-deps
	$(PYTHON) -m pytest -q --durations=20 -n auto --dist loadfile --no-loadscope-reorder

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow and not browser and not mcp" -n auto --dist loadfile

bench: setup
	$(PYTHON) bench/run_all.py

# Tracked files that browser tests can produce; the tests themselves write only to their tmp_path.
screenshot: setup browser-deps
	ENVACE_SCREENSHOT=$(CURDIR)/docs/screenshot-run.png $(PYTHON) -m pytest -q tests/test_ui_browser.py

reliability: setup browser-deps
	ENVACE_RELIABILITY_JSON=$(CURDIR)/bench/results/reliability.json $(PYTHON) -m pytest -q -s tests/test_ui_concurrency.py

train-agent: setup
	$(PYTHON) -m app train-agent

# docs/EVALUATION.md's table: the embedded agent on the held-out split (override with make eval EVAL_ARGS=...).
# First 12 held-out tasks, first 2 turns, at most 4 steps a turn, tools ranked (the default relevance), the K
# candidates one per top-ranked tool, the logprob selector: about 20 minutes on 2 cores.
EVAL_ARGS ?= --limit 12 --branches 4 --max-turns 2 --max-steps 4 --selector logprob --proposal tools
eval: setup
	$(PYTHON) -m app eval --tasks bfcl:multi_turn_base --split heldout --modes none,parallel,sequential \
		--seed 0 --out runs/eval-heldout $(EVAL_ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache $(MCP_DIR)

# Benchmark only, never part of setup/test/CI: llama.cpp (llama-cpp-python compiles it from source,
# 10+ minutes on 2 cores) in its own environment, against our loop on the same GGUF file.
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.setup-done: requirements-bench.txt
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BENCH_VENV)/bin/python -m pip install -q -r requirements-bench.txt
	touch $@

bench-peer: setup $(BENCH_VENV)/.setup-done
	$(PYTHON) bench/bench_peer.py --peer-python $(BENCH_VENV)/bin/python

# A real serving engine end to end (docs/engines.md): llama-cpp-python's server on the embedded GGUF, an episode in
# the CLI, a step in the browser, step times against the local backend; writes bench/results/engines.json.
check-engines: setup browser-deps $(BENCH_VENV)/.setup-done
	ENVACE_BENCH_PYTHON=$(CURDIR)/$(BENCH_VENV)/bin/python ENVACE_ENGINES_JSON=$(CURDIR)/bench/results/engines.json \
		$(PYTHON) -m pytest -q -s --engines tests/test_engines.py
