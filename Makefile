# `make run` and `make test` each bootstrap .venv on a fresh machine first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Reinstalled when the packaging changes or a package (or subpackage) gains or loses a
# module: a strict editable install links the files that existed when it was made, and a
# directory's mtime moves when an entry is added or removed in it, not in its subdirectories.
STAMP := $(VENV)/.installed-stamp
PACKAGE_DIRS := $(shell find protocol daemon client -type d -not -name __pycache__)
PACKAGES := -p subagentd.protocol -p subagentd.daemon -p subagentd.client

.PHONY: run test lint typecheck check-units bench clean

$(STAMP): pyproject.toml $(PACKAGE_DIRS) daemon/processes/_clone3.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]' --config-settings editable_mode=strict
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/subagentd

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy $(PACKAGES)
	$(BIN)/mypy tests

test: lint typecheck
	# `subagentctl top` is tested in a real terminal: tmux (Debian's), else those tests skip.
	command -v tmux >/dev/null || (apt-get update -qq && apt-get install -y -qq tmux) \
		|| echo "tmux could not be installed: the terminal tests of top are skipped"
	# subagentd-mcp under the TypeScript SDK most MCP hosts embed (tests/mcp_ts, pinned by
	# its package-lock.json): from the npm registry, else those tests skip.
	if command -v npm >/dev/null; then npm ci --silent --no-audit --no-fund --prefix tests/mcp_ts \
		|| echo "npm ci failed: the TypeScript SDK tests of subagentd-mcp are skipped"; \
		else echo "npm not found: the TypeScript SDK tests of subagentd-mcp are skipped"; fi
	$(BIN)/pytest

# Every benchmark, side by side with supervisord (from PyPI, into the venv):
# writes bench/results/<date>.md and .json and prints the table. See bench/README.md.
# bench/files.py counts the daemon's file syscalls with strace (Debian's package).
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet supervisor
	command -v strace >/dev/null || (apt-get update -qq && apt-get install -y -qq strace)
	# Measured as installed: with compiled bytecode (a session may turn its writing off).
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis
